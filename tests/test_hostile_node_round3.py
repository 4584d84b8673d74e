"""A hostile node (or a compromised gateway relaying a genuine node's signatures), third round:
what the earlier reviews did not try. Real certificates from the control-plane CA, real Ed25519
signatures, the real reservation worker and the real gateway over mutual TLS.

- A report the node signed with the key it held before a renewal, withheld and stored after the
  node's newer reports (signed with its renewed key) about the same allocation: the node's sequence
  runs across its keys, so it is a replay and never undoes what the newer reports said.
- Heartbeats that flip the applied generation in every message: each wrote a row, unpaced.
- A node that sends reports and reads none of its acks: the gateway kept every ack in memory.

What held, kept here so it stays held: a superseded session's message in flight is never applied
after the newer session spoke (the old session's reader, and its transaction, are cancelled); a
bind replayed after the allocation was released and its GPUs booked again names the old
allocation, so it never binds the new one, nor does a body naming another allocation than the row
the gateway stored it under.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import grpc
from cryptography.hazmat.primitives import serialization
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc
from controlplane.pki import attest, enrolment
from controlplane.pki.config import PkiSettings
from gateway.config import GatewaySettings
from tests.support import World, eventually, get
from tests.test_gateway import (GatewayThread, connected, enrolled, gateway, heartbeat, hello, inventory_waiting,  # noqa: F401
                                node_row, pool_id)
from tests.test_gateway import eventually as until
from tests.test_hostile_queue import release
from tests.test_pki import Enrolled, NodeKeys, arun, sign
from tests.test_reports import cdi_names, eventually_rows, node, world  # noqa: F401 (fixtures)

_SEQUENCE = itertools.count(1_000_000)  # above test_reports' own counter: newer, one after the other


def renewed(world: World, before: Enrolled) -> Enrolled:
    """The node renewed over its session, as a node does at half its certificate's life: new keys,
    new certificates, the same node (the old certificates stay good until they run out)."""
    keys = NodeKeys()

    async def work(pool: Any) -> enrolment.Issued:
        peer = await enrolment.identify(pool, before.cert.public_bytes(serialization.Encoding.PEM))
        return await enrolment.renew(pool, await enrolment.load_ca(pool, PkiSettings()), PkiSettings(), peer,
                                     keys.csr())

    return Enrolled(keys, arun(world.conninfo, work))


def signed(world: World, by: Enrolled, allocation_id: str, kind: str, sequence: int | None = None
           ) -> tuple[bytes, bytes]:
    """(body, signature) of a report the node signs now about the allocation: bound (naming the
    allocation's devices) or released."""
    body = pb.Report(node_id=by.node_id, sequence=sequence or next(_SEQUENCE),
                           time=int(time.time() * 1000))
    if kind == "bound":
        body.bound.CopyFrom(pb.AllocationBound(allocation_id=allocation_id,
                                                     cdi_devices=cdi_names(world, allocation_id)))
    else:
        body.released.CopyFrom(pb.AllocationReleased(allocation_id=allocation_id, reason="unassigned"))
    raw = body.SerializeToString()
    return raw, sign(by.keys.signing, raw)


def store(world: World, by: Enrolled, allocation_id: str, kind: str, report: tuple[bytes, bytes]) -> None:
    """Keep the signed report as the gateway does (bytes as received) and wake the reservation."""
    body, signature = report
    world.sql("INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)"
              " VALUES (%s, %s, %s, %s, %s, %s)",
              (by.node_id, allocation_id, kind, body, by.key_id, signature))
    world.sql("SELECT wake_reservation(reservation_id) FROM allocations WHERE id = %s", (allocation_id,))


def verdicts(world: World, allocation_id: str, count: int) -> list[str]:
    return [v for (v,) in eventually_rows(world, "SELECT verdict FROM node_reports WHERE allocation_id = %s"
                                          " AND verdict IS NOT NULL ORDER BY id", (allocation_id,), count)]


def lost(r: Any) -> bool:
    return any(c.reason == "BindingLost" for c in r.conditions)


# Replays across a key renewal ------------------------------------------------------------------

def test_a_bind_signed_before_a_renewal_never_undoes_a_newer_release(world: World, node: Enrolled) -> None:
    """The node signs "bound" with its first key; the report is withheld (a compromised gateway
    keeps it). The node renews, binds and then releases with its new key: BindingLost. The old
    bound report stored now is older than the release (the node's sequence runs across its keys):
    a replay. Before, only reports of the same key were compared, so it bound the allocation again
    and cleared BindingLost while the node no longer held the devices."""
    r = world.create(count=1, duration="8h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    withheld = signed(world, node, alloc, "bound")
    fresh = renewed(world, node)
    store(world, fresh, alloc, "bound", signed(world, fresh, alloc, "bound"))
    eventually(world, r.id, lambda x: x.state == "active")
    store(world, fresh, alloc, "released", signed(world, fresh, alloc, "released"))
    eventually(world, r.id, lost)
    store(world, node, alloc, "bound", withheld)
    assert verdicts(world, alloc, 3)[-1] == f"rejected: {attest.REPLAYED}"
    after = get(world, r.id)
    assert lost(after) and [a.state for a in after.allocations] == ["binding"]
    # The node's own newer word still counts: bound again with its current key.
    store(world, fresh, alloc, "bound", signed(world, fresh, alloc, "bound"))
    assert not lost(eventually(world, r.id, lambda x: not lost(x)))


def test_a_release_signed_before_a_renewal_never_loses_a_newer_binding(world: World, node: Enrolled) -> None:
    """The mirror image: a release signed with the old key, withheld, then stored after the node
    bound the allocation with its renewed key, never marks the binding lost."""
    r = world.create(count=1, duration="8h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    store(world, node, alloc, "bound", signed(world, node, alloc, "bound"))
    eventually(world, r.id, lambda x: x.state == "active")
    withheld = signed(world, node, alloc, "released")
    fresh = renewed(world, node)
    store(world, fresh, alloc, "bound", signed(world, fresh, alloc, "bound"))
    store(world, node, alloc, "released", withheld)
    assert verdicts(world, alloc, 3) == ["accepted", "accepted", f"rejected: {attest.REPLAYED}"]
    after = get(world, r.id)
    assert not lost(after) and [a.state for a in after.allocations] == ["bound"]


def test_a_node_enrolled_anew_after_its_revocation_binds_with_a_fresh_sequence(world: World, node: Enrolled) -> None:
    """What the comparison across keys leaves alone: a machine revoked and enrolled again (its disk,
    and its sequence, may be new) is heard about an allocation it held, however low its sequence,
    since the reports of its revoked certificates no longer count."""
    from tests.test_pki import enrol

    r = world.create(count=1, duration="8h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    store(world, node, alloc, "bound", signed(world, node, alloc, "bound"))
    eventually(world, r.id, lambda x: x.state == "active")
    again = enrol(world.conninfo, world.pool_id, "reporter")  # the same name: the same node, old certs revoked
    assert again.node_id == node.node_id
    store(world, again, alloc, "released", signed(world, again, alloc, "released", sequence=1))
    eventually(world, r.id, lost)
    store(world, again, alloc, "bound", signed(world, again, alloc, "bound", sequence=2))
    assert not lost(eventually(world, r.id, lambda x: not lost(x)))



# Stale reports of the node's own earlier allocations (held) -----------------------------------

def test_a_bind_replayed_after_the_atoms_were_booked_again_never_binds_the_new_allocation(
    world: World, node: Enrolled
) -> None:
    """The node's genuine bound report of an allocation since released, replayed once another
    reservation booked the same GPUs: it names the old allocation, which is no longer live, so it
    is never judged for the new one; stored under the new allocation's row while its signed body
    names the old one, it is rejected (the body decides, never the row)."""
    first = world.create(count=8, duration="8h")
    old = eventually(world, first.id, lambda x: x.state == "binding").allocations[0]
    replayed = signed(world, node, old.id, "bound")
    store(world, node, old.id, "bound", replayed)
    eventually(world, first.id, lambda x: x.state == "active")
    release(world, first.id)
    second = world.create(count=8, duration="8h")
    new = eventually(world, second.id, lambda x: x.state == "binding").allocations[0]
    assert sorted(new.device_ids) == sorted(old.device_ids) and new.id != old.id
    store(world, node, old.id, "bound", replayed)  # about the old allocation: never judged
    store(world, node, new.id, "bound", replayed)  # the row says the new one, the body the old one
    assert verdicts(world, new.id, 1) == [f"rejected: {attest.NOT_THIS_BOUND}"]
    assert get(world, second.id).state == "binding"
    assert world.sql("SELECT verdict FROM node_reports WHERE allocation_id = %s ORDER BY id", (old.id,)) == [
        ("accepted",), (None,)]
    store(world, node, new.id, "bound", signed(world, node, new.id, "bound"))
    eventually(world, second.id, lambda x: x.state == "active")

# Heartbeats ----------------------------------------------------------------------------------

def test_heartbeats_that_flip_the_applied_generation_are_paced_like_writes(database: str, pool_id: str) -> None:
    """A heartbeat costs no transaction while its applied generation stays, so the throttle let
    every heartbeat through; one that changes it writes the node's row. A node alternating two
    generations wrote a row per message as fast as it could send. Now such a heartbeat takes a
    token of the node's bucket: past the burst its session waits, as for a report."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=0.001,
                                                     node_messages_burst=4))
    try:
        with capture_logs() as logs:
            flipper, session = connected(gw, pool_id, "flipper")  # the open and the hello: two tokens
            session.send(heartbeat(7))  # a write: the third
            for _ in range(20):  # the same generation: no write, no token
                session.send(heartbeat(7))
            session.send(heartbeat(8))  # a write: the last token
            until(lambda: node_row(database, flipper.node_id)["applied_generation"] == 8, what="generation 8")
            assert not [e for e in logs if e["event"] == "node throttled"]
            session.send(heartbeat(9))  # a write past the burst: it waits for the node's turn
            until(lambda: [e for e in list(logs) if e["event"] == "node throttled"], what="the throttle")
        assert node_row(database, flipper.node_id)["applied_generation"] == 8
        session.close()
    finally:
        gw.stop()



# Acks the node never reads -------------------------------------------------------------------

def test_a_node_that_reads_no_acks_cannot_grow_the_gateways_memory(database: str, pool_id: str) -> None:
    """Each report gets an ack; a node that never reads its stream fills its window, the writer
    waits, and the acks waiting to be written grew with every report the node sent (unpaced with
    the throttle off; at its rate otherwise, for as long as the session lasted). Now past
    node_unsent_acks the reader waits for them to go, and flow control slows the node down; once it
    reads, every ack arrives."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=0,
                                                     node_unsent_acks=50))
    try:
        node = enrolled(gw, pool_id, "deaf")
        sent = 5000
        key_id = "k" * 128  # the longest a report may name: the largest ack
        creds = grpc.ssl_channel_credentials(gw.ca_pem, node.key_pem(), node.cert_pem)
        with capture_logs() as logs, grpc.secure_channel(gw.endpoint, creds,
                                                         options=[("grpc.http2.bdp_probe", 0)]) as channel:
            messages = (pb.NodeMessage(report=pb.AttestedReport(body=b"\xff" + i.to_bytes(2, "big"), key_id=key_id))
                        for i in range(sent))
            call = node_pb2_grpc.NodeGatewayStub(channel).Session(messages, timeout=120)
            until(lambda: [e for e in list(logs) if e["event"] == "node reads no report acks"], timeout=60,
                  what="the reader waiting for the acks to go")
            acks = 0
            for message in call:  # the node reads at last: nothing it sent is lost
                if message.WhichOneof("msg") == "report_ack":
                    assert message.report_ack.outcome == pb.REPORT_IGNORED
                    acks += 1
                    if acks == sent:
                        break
            call.cancel()
        assert acks == sent
    finally:
        gw.stop()

# Two sessions of one node ----------------------------------------------------------------------

def test_a_superseded_sessions_inventory_in_flight_is_never_applied(gateway: GatewayThread, pool_id: str) -> None:
    """The old session's inventory is waiting for the pool's lock when a newer session of the node
    registers: the old session ends, and what it sent is never applied after the newer one spoke."""
    node, old = connected(gateway, pool_id, "flapper", uuid="GPU-OLD")
    stale = hello(uuid="GPU-STALE").hello.inventory
    with inventory_waiting(gateway, pool_id, old, stale):
        new = node.session()
        assert new.recv() is not None
        ended = old.ended()
        assert ended is not None and ended.code() == grpc.StatusCode.ABORTED
    new.send(pb.NodeMessage(hello=pb.Hello(daemon_version="bcd 9.9.9", capabilities=["devices.limits"])))
    until(lambda: node_row(gateway.conninfo, node.node_id)["daemon_version"] == "bcd 9.9.9", what="the new hello")
    stored = node_row(gateway.conninfo, node.node_id)["inventory"]
    assert sorted(g["uuid"] for g in stored["gpus"]) == [f"GPU-OLD-{i}" for i in range(4)]
    new.close()
