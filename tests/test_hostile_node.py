"""A hostile node against the real gateway (mutual TLS, real certificates, real signatures) and
the control plane behind it: what it sends is refused with a clear error, never an INTERNAL, and
never moves anything that is not its own."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc
from controlplane.common.status import error_info
from controlplane.pki import admin
from tests.nodes_support import ControlPlane
from tests.test_gateway import (GatewayThread, Node, binding, connected, cp, enrolled, eventually,  # noqa: F401
                                gateway, hello, join_token, node_row, pool_id)
from tests.test_pki import NodeKeys, arun, sql


def status(exc: grpc.RpcError | None) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(gRPC code, spec code, ErrorInfo details) of a failed call or ended session."""
    assert exc is not None, "the call did not fail"
    info = error_info(exc)
    assert info is not None, f"no ErrorInfo on {exc}"
    return exc.code(), info.reason, dict(info.metadata)


def _raw_session(node: Node, messages: list[bytes]) -> grpc.RpcError:
    """A session that sends these bytes as its messages; the error it ended with."""
    with node.channel() as channel:
        call = channel.stream_stream("/bettercompute.node.v1.NodeGateway/Session", request_serializer=lambda b: b,
                                     response_deserializer=pb.GatewayMessage.FromString)(iter(messages), timeout=30)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
    return ended.value


def _invalid_utf8(message: Any, marker: str = "\u2603") -> bytes:
    """The message's bytes with the UTF-8 of `marker` (in one of its strings) made invalid."""
    raw = message.SerializeToString()
    assert marker.encode() in raw
    return raw.replace(marker.encode(), b"\xff\xfe\xfd")


# Undecodable bytes ---------------------------------------------------------------------------

def test_a_session_message_that_is_not_valid_protobuf_or_utf8_is_invalid_input(
        gateway: GatewayThread, pool_id: str) -> None:
    node = enrolled(gateway, pool_id, "n1")
    for raw in (_invalid_utf8(pb.NodeMessage(hello=pb.Hello(daemon_version="\u2603"))), b"\x0a\xff\xff\xff"):
        ended = _raw_session(node, [raw])
        assert status(ended) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", {"field": "message"})
    # and the gateway still serves the node
    again = node.session()
    again.send(hello(version="bcd-ok"))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["daemon_version"] == "bcd-ok", what="hello")
    again.close()


def test_an_enrolment_that_is_not_valid_utf8_is_invalid_input_and_spends_no_token(
        gateway: GatewayThread, pool_id: str) -> None:
    token = join_token(gateway.conninfo, pool_id, "n1")
    raw = _invalid_utf8(pb.EnrolRequest(join_token=token + "\u2603", csr_pem=b"x"))
    with grpc.secure_channel(gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
        enrol = ch.unary_unary("/bettercompute.node.v1.NodeGateway/Enrol", request_serializer=lambda b: b,
                               response_deserializer=pb.EnrolResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            enrol(raw, timeout=10)
    assert status(refused.value) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", {"field": "message"})
    assert Node(gateway).enrol(token).node_id  # the token was not spent


# Strings a database cannot store -------------------------------------------------------------

@pytest.mark.parametrize("message, field", [
    (hello(version="bcd\x000.5"), "hello.daemonVersion"),
    (hello(clique="7\x00"), "hello.inventory.gpus[0].nvlinkClique"),
    (pb.NodeMessage(inventory=pb.Inventory(generation=2, gpus=[pb.Gpu(
        uuid="GPU-0", model="H100", mig_mode=True, mig_instances=[pb.MigInstance(index=0, profile="1g\x00")])])),
     "inventory.gpus[0].migInstances[0].profile"),
    (hello(version="v" * (64 * 1024 + 1)), "hello.daemonVersion"),
])
def test_a_nul_or_oversized_string_ends_the_session_with_invalid_input_naming_it(
        gateway: GatewayThread, pool_id: str, message: pb.NodeMessage, field: str) -> None:
    node, session = connected(gateway, pool_id, "n1", version="bcd-before")
    session.send(message)
    assert status(session.ended()) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", {"field": field})
    assert node_row(gateway.conninfo, node.node_id)["daemon_version"] == "bcd-before"  # nothing of it applied
    again = node.session()  # and the node may come back with a good one
    again.send(hello(version="bcd-after"))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["daemon_version"] == "bcd-after", what="hello")
    again.close()


# Many repeated entries -----------------------------------------------------------------------

@pytest.mark.parametrize("message, field", [
    # each cpulist is parsed on the gateway's loop: 100,000 of them stalled every session for minutes
    (pb.NodeMessage(inventory=pb.Inventory(generation=2, vcpus=8, numa_nodes=[
        pb.NumaNode(id=i, cpulist="0-8191") for i in range(257)])), "inventory.numaNodes"),
    (pb.NodeMessage(hello=pb.Hello(daemon_version="bcd", capabilities=[f"c{i}" for i in range(257)])),
     "hello.capabilities"),
    (pb.NodeMessage(inventory=pb.Inventory(generation=2, gpus=[pb.Gpu(uuid="GPU-0", model="H100", mig_mode=True,
                                                                       mig_instances=[pb.MigInstance()] * 257)])),
     "inventory.gpus[0].migInstances"),
])
def test_a_message_with_too_many_entries_ends_the_session_with_invalid_input_naming_the_field(
        gateway: GatewayThread, pool_id: str, message: pb.NodeMessage, field: str) -> None:
    node, session = connected(gateway, pool_id, "n1")
    before = node_row(gateway.conninfo, node.node_id)
    session.send(message)
    assert status(session.ended()) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", {"field": field})
    after = node_row(gateway.conninfo, node.node_id)
    assert (after["inventory"], after["capabilities"]) == (before["inventory"], before["capabilities"])
    # at the bound, it goes in
    again = node.session()
    again.send(pb.NodeMessage(inventory=pb.Inventory(generation=3, vcpus=8, numa_nodes=[
        pb.NumaNode(id=i, cpulist=f"{i}") for i in range(256)])))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["inventory_generation"] == 3, what="inventory")
    again.close()


# Signed reports the reservation worker could not take --------------------------------------

def _bound(node: Node, aid: str, sequence: int, **bound: Any) -> pb.NodeMessage:
    return node.report(pb.Report(node_id=node.node_id, sequence=sequence, time=int(time.time() * 1000),
                                 bound=pb.AllocationBound(allocation_id=aid, **bound)).SerializeToString())


@pytest.mark.parametrize("bad", [
    {"env_file": "/run/bcd/\x00.env"},  # the binding (jsonb) takes no NUL: the worker's pass failed
    {"cdi_devices": ["bcd.dev/gpu=GPU-0"] * 3000},  # all of them became the tenant's binding
])
def test_a_signed_report_beyond_the_bounds_is_ignored_and_never_wedges_the_reservation(
        gateway: GatewayThread, cp: ControlPlane, bad: dict[str, Any]) -> None:
    node, session = connected(gateway, cp.pool_id, "n1")
    rid, aid = binding(cp)
    session.send(_bound(node, aid, 1, **bad))
    session.send(_bound(node, aid, 2, cdi_devices=["bcd.dev/gpu=GPU-0", "bcd.dev/gpu=GPU-1"]))
    acks = [session.recv("report_ack").outcome for _ in range(2)]
    cp.drain()
    assert sql(gateway.conninfo, "SELECT last_error FROM work_items WHERE last_error IS NOT NULL") == []
    r = cp.get(rid)
    assert r.state == "active" and list(r.binding.cdi_devices) == ["bcd.dev/gpu=GPU-0", "bcd.dev/gpu=GPU-1"]
    assert acks == [pb.REPORT_IGNORED, pb.REPORT_STORED]
    cp.check_invariants()
    session.close()


# Renewal racing a revocation -----------------------------------------------------------------

def test_a_renewal_racing_the_nodes_revocation_never_leaves_it_a_good_certificate(
        gateway: GatewayThread, pool_id: str) -> None:
    """A node that renews in a loop, so one renewal is in flight when an operator revokes it: the
    certificates that renewal issues must be revoked too (or the renewal refused)."""
    node = enrolled(gateway, pool_id, "n1")
    renewed: list[Any] = []
    fresh = NodeKeys()  # a renewal brings new keys

    def renew() -> None:
        try:
            with node.channel() as ch:
                renewed.append(node_pb2_grpc.NodeGatewayStub(ch).Renew(
                    pb.RenewRequest(csr_pem=fresh.csr()), timeout=30))
        except grpc.RpcError as exc:
            renewed.append(exc)

    def revoke() -> None:
        arun(gateway.conninfo, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "stolen"))

    waiting = ("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s")
    with psycopg.connect(gateway.conninfo) as holder:
        # the renewal gets past its checks, then waits to write its certificates
        holder.execute("LOCK TABLE node_certs IN SHARE ROW EXCLUSIVE MODE")
        renewing = threading.Thread(target=renew)
        renewing.start()
        eventually(lambda: sql(gateway.conninfo, waiting, ("%INSERT INTO node_certs%",)), what="the renewal waiting")
        revoking = threading.Thread(target=revoke)  # meanwhile the operator revokes the node
        revoking.start()
        # The revocation waits behind the renewal on whichever of its statements meets the
        # renewal's locks first (the pool lock, the node's row or its certificates): a second
        # backend waiting on a lock, besides the renewal.
        both_wait = ("SELECT count(*) >= 2 AS two FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                     " AND datname = current_database()")
        eventually(lambda: not revoking.is_alive() or sql(gateway.conninfo, both_wait)[0]["two"],
                   what="the revocation done or waiting for the renewal")
        holder.rollback()
    renewing.join(30)
    revoking.join(30)
    assert len(renewed) == 1
    if isinstance(renewed[0], pb.RenewResponse):
        node.keys = fresh
        node.certified(renewed[0].certificate_pem)
    session = node.session()  # with whatever it holds now
    assert session.recv() is None, "the node holds a good certificate after its revocation"
    assert status(session.error)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert sql(gateway.conninfo, "SELECT c.serial FROM node_certs c LEFT JOIN revocations r USING (serial)"
                                 " WHERE c.node_id = %s AND r.serial IS NULL", (node.node_id,)) == []


# Sizes no host has ------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes, read", [
    # 8 EiB: a per-GPU share of billions of GiB
    ({"memory_bytes": 2**63 - 1, "vcpus": 64}, {"memory_bytes": 0, "vcpus": 64}),
    # negatives, subtracted from each other: the same
    ({"memory_bytes": -2**63, "hugepages_1gi": -2**63, "vcpus": -1},
     {"memory_bytes": 0, "hugepages_1gi": 0, "vcpus": 0}),
    # more vCPUs than CPU ids a cpulist may name
    ({"memory_bytes": 512 * 2**30, "vcpus": 2**31 - 1}, {"memory_bytes": 512 * 2**30, "vcpus": 0}),
])
def test_sizes_beyond_any_host_read_as_zero_and_never_break_the_pools_creates(
        gateway: GatewayThread, cp: ControlPlane, sizes: dict[str, int], read: dict[str, int]) -> None:
    """The pool's per-GPU host share comes from its hosts' sizes; from absurd ones it overflowed
    the API's int32 fields and every create in the pool was INTERNAL."""
    node, session = connected(gateway, cp.pool_id, "n1")
    inventory = hello(gpus=1).hello.inventory  # one GPU: its share is the whole host
    inventory.generation = 2
    for name, value in sizes.items():
        setattr(inventory, name, value)
    inventory.numa_nodes[0].memory_bytes = sizes["memory_bytes"]
    session.send(pb.NodeMessage(inventory=inventory))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["inventory_generation"] == 2, what="inventory")
    cp.server.call(cp.server.app.runtime.capacity.barrier())  # the create plans with the new sizes
    r = cp.create(count=1)
    cp.drain()
    assert cp.get(r.id).state == "binding"
    stored = node_row(gateway.conninfo, node.node_id)["inventory"]
    assert {name: stored[name] for name in read} == read
    assert stored["numa_nodes"][0]["memory_bytes"] == read["memory_bytes"]
    cp.check_invariants()
    session.close()


# The same inventory, again and again ---------------------------------------------------------

def test_an_inventory_that_changes_nothing_wakes_no_placer(gateway: GatewayThread, pool_id: str) -> None:
    """Every placer of the pool re-plans its pending reservations on bc_pool_freed: a node that
    sent the same inventory in a loop had them all re-plan once per message. Only new capacity
    (new or returning GPUs, more host resources, new labels) wakes them."""
    node, session = connected(gateway, pool_id, "n1")
    with psycopg.connect(gateway.conninfo, autocommit=True) as listener:
        listener.execute("LISTEN bc_pool_freed")

        def woken_by(message: pb.NodeMessage, generation: int) -> int:
            """The pool's wake-ups the message caused (up to a marker sent once it was applied)."""
            session.send(message)
            eventually(lambda: node_row(gateway.conninfo, node.node_id)["inventory_generation"] == generation,
                       what="the inventory applied")
            listener.execute("SELECT pg_notify('bc_pool_freed', 'marker')")
            payloads = []
            for notify in listener.notifies(timeout=30):
                if notify.payload == "marker":
                    break
                payloads.append(notify.payload)
            return payloads.count(pool_id)

        same = hello()
        same.hello.inventory.generation = 2
        woken_by(same, 2)  # after the first hello's, whatever it did
        for generation in (3, 4):
            same.hello.inventory.generation = generation
            assert woken_by(same, generation) == 0
            assert woken_by(pb.NodeMessage(inventory=same.hello.inventory), generation) == 0
        more = hello(gpus=5)  # a new GPU
        more.hello.inventory.generation = 5
        assert woken_by(more, 5) == 1
        caps = hello(gpus=5, caps=("devices.limits", "binding.kubernetes"))  # a new capability label
        caps.hello.inventory.generation = 6
        assert woken_by(caps, 6) == 1
    session.close()


# -- a node flooding the gateway --------------------------------------------------------------


def test_the_token_bucket_lets_a_burst_through_then_paces_to_its_rate() -> None:
    from gateway.throttle import TokenBucket

    now = [100.0]
    bucket = TokenBucket(10, 3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert [round(bucket.take(), 3) for _ in range(3)] == [0.1, 0.2, 0.3]  # each waits behind the last
    now[0] += 10  # idle: refilled, never past the burst
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0] and bucket.take() > 0
    assert TokenBucket(0, 1).take() == 0.0  # rate 0: off


def test_a_node_flooding_reports_is_paced_and_nothing_it_sent_is_lost(database: str, pool_id: str) -> None:
    """300 reports at once (unreadable ones: the cheapest for the gateway, no transaction) from one
    node: before the throttle they were all taken in at once, and a node could keep the gateway
    busy as fast as it could send. Now at most the burst and `rate` a second are taken in, and
    every one is still acknowledged (the node is slowed down, not cut off)."""
    import dataclasses

    from gateway.config import GatewaySettings

    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=100,
                                                     node_messages_burst=10))
    try:
        node, session = connected(gw, pool_id, "flood")  # the hello took one token
        sent = time.monotonic()
        for i in range(300):
            session.send(pb.NodeMessage(report=pb.AttestedReport(body=b"\xff" + i.to_bytes(2, "big"),
                                                                 key_id=node.key_id)))
        times = []
        for _ in range(300):
            ack = session.recv("report_ack", timeout=60)
            assert ack is not None and ack.outcome == pb.REPORT_IGNORED
            times.append(time.monotonic() - sent)
        early = sum(1 for t in times if t < 0.5)
        assert early <= 9 + 50 + 5, f"{early} reports taken in within 0.5 s (burst 10, 100/s)"
        assert times[-1] >= (300 - 9) / 100 * 0.9  # paced to the rate, none dropped
        assert node_row(database, node.node_id)["connectivity"] == "connected"
        session.close()
    finally:
        gw.stop()


def test_a_node_renewing_in_a_loop_is_refused_past_its_burst(database: str, pool_id: str) -> None:
    """Every renewal signs two certificates and writes their rows; a node could renew as fast as it
    could call. Past the burst a renewal is QUOTA_EXCEEDED (reason rate-limited, retryAfterSeconds)
    and issues nothing."""
    import dataclasses

    from gateway.config import GatewaySettings

    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_renewals_per_hour=60,
                                                     node_renewals_burst=3))
    try:
        node = enrolled(gw, pool_id, "renews")

        def renew() -> pb.RenewResponse:
            with node.channel() as channel:
                return node_pb2_grpc.NodeGatewayStub(channel).Renew(pb.RenewRequest(csr_pem=NodeKeys().csr()), timeout=10)

        for _ in range(3):
            assert renew().certificate_pem
        issued = sql(database, "SELECT count(*) AS n FROM node_certs WHERE node_id = %s", (node.node_id,))
        with pytest.raises(grpc.RpcError) as refused:
            renew()
        code, reason, details = status(refused.value)
        assert (code, reason, details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", "rate-limited")
        assert 1 <= int(details["retryAfterSeconds"]) <= 60
        assert sql(database, "SELECT count(*) AS n FROM node_certs WHERE node_id = %s", (node.node_id,)) == issued
    finally:
        gw.stop()
