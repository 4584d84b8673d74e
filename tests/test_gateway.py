"""The node gateway with a real database, real TLS, real keys and a minimal node client written
here (the FakeDaemon is a separate program): enrolment, sessions, hello, desired state, reports,
the unreachable sweeper, and `python -m gateway` as a real process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import psycopg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.sql import SQL, Identifier
from psycopg.types.json import Jsonb
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc
from controlplane.nodes import connectivity
from controlplane.pki import admin, attest, certs
from controlplane.pki.config import PkiSettings
from gateway.config import GatewaySettings
from gateway.server import Gateway, start_gateway
from tests.nodes_support import ControlPlane
from tests.support import rpc_error
from tests.test_pki import NodeKeys, arun, seed_pool, split, sql

REPO = pathlib.Path(__file__).resolve().parents[1]
GIB = 1 << 30


class GatewayThread:
    """A real gateway (grpc.aio, TLS, psycopg pool, LISTEN, sweeper) on its own event loop."""

    def __init__(self, conninfo: str, settings: GatewaySettings | None = None, *, listen: str = "127.0.0.1:0",
                 enrol_listen: str = "127.0.0.1:0") -> None:
        self.conninfo = conninfo
        # Embedded in the test process: the gateway leaves that process's heap unfrozen;
        # tests/test_gc_pauses.py covers the freezing.
        self.settings = dataclasses.replace(settings or GatewaySettings(), gc_unfreeze_seconds=0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gateway: Gateway = self.call(start_gateway(
            self.settings, conninfo, listen=listen, enrol_listen=enrol_listen))
        self.endpoint = f"127.0.0.1:{self.gateway.port}"
        self.enrol_endpoint = f"127.0.0.1:{self.gateway.enrol_port}"
        self.ca_pem = self.gateway.ca.pem

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if not self.thread.is_alive():  # stopped already
            return
        try:
            self.call(self.gateway.stop(0.2))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():  # its selector and self-pipe: no descriptors left behind
                self.loop.close()


_OPEN: list[Session] = []


@pytest.fixture(autouse=True)
def _close_sessions() -> Iterator[None]:
    """Streams left open by a failing test would keep gRPC threads alive past the test."""
    yield
    while _OPEN:
        _OPEN.pop().close()


class Session:
    """One Session stream: messages go out through a queue, answers come in on a thread."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.outbox: queue.Queue[pb.NodeMessage | None] = queue.Queue()
        self.inbox: queue.Queue[pb.GatewayMessage | None] = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.call = node_pb2_grpc.NodeGatewayStub(channel).Session(iter(self.outbox.get, None))
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()
        _OPEN.append(self)

    def _pump(self) -> None:
        try:
            for message in self.call:
                self.inbox.put(message)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.inbox.put(None)

    def send(self, message: pb.NodeMessage) -> None:
        self.outbox.put(message)

    def recv(self, kind: str = "desired_state", timeout: float = 30) -> Any:
        """The next message of `kind` (others are skipped); None when the stream ended."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            if message is None:
                self.inbox.put(None)
                return None
            if message.WhichOneof("msg") == kind:
                return getattr(message, kind)

    def ended(self, timeout: float = 30) -> grpc.RpcError | None:
        deadline = time.monotonic() + timeout
        while self.inbox.get(timeout=max(0.0, deadline - time.monotonic())) is not None:
            pass
        self.inbox.put(None)
        return self.error

    def close(self) -> None:
        """Half-close, let the gateway end the session, then close the channel."""
        self.outbox.put(None)
        self.pump.join(5)
        self.channel.close()


class Node:
    """A minimal node daemon: its own keys, enrolment, mutual TLS, signed reports."""

    def __init__(self, gateway: GatewayThread) -> None:
        self.gateway = gateway
        self.keys = NodeKeys()
        self.node_id = ""
        self.cert_pem = b""  # the TLS client certificate
        self.signing_pem = b""  # the report-signing certificate

    def enrol(self, token: str) -> pb.EnrolResponse:
        if self.node_id:  # enrolled before: new keys, as a daemon brings (a key is certified once)
            self.keys = NodeKeys()
        with grpc.secure_channel(self.gateway.enrol_endpoint, grpc.ssl_channel_credentials(self.gateway.ca_pem)) as ch:
            response = node_pb2_grpc.NodeGatewayStub(ch).Enrol(
                pb.EnrolRequest(join_token=token, csr_pem=self.keys.csr()), timeout=10)
        self.node_id = response.node_id
        self.certified(response.certificate_pem)
        return response

    def certified(self, certificate_pem: bytes) -> None:
        signing, tls = split(certificate_pem)
        self.signing_pem, self.cert_pem = certs.pem(signing), certs.pem(tls)

    def key_pem(self) -> bytes:
        return self.keys.tls.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption())

    def channel(self) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(self.gateway.ca_pem, self.key_pem(), self.cert_pem)
        return grpc.secure_channel(self.gateway.endpoint, creds)

    def session(self) -> Session:
        return Session(self.channel())

    @property
    def key_id(self) -> str:
        return certs.key_id(x509.load_pem_x509_certificate(self.signing_pem))

    def report(self, body: bytes) -> pb.NodeMessage:
        signature = self.keys.signing.sign(attest.signed_message(body))
        return pb.NodeMessage(report=pb.AttestedReport(body=body, key_id=self.key_id, signature=signature))


def join_token(conninfo: str, pool_id: str, name: str, role: str = "node") -> str:
    return arun(conninfo, lambda pool: admin.create_join_token(pool, pool_id, name, role, 600))["secret"]


def hello(gpus: int = 4, caps: tuple[str, ...] = ("devices.limits",), clique: str | list[str] = "7",
          version: str = "bcd 0.5.0", uuid: str = "GPU") -> pb.NodeMessage:
    """A hello with GPUs `<uuid>-0`, `<uuid>-1`, ... (a GPU uuid is one node's: give each node its own)."""
    cliques = clique if isinstance(clique, list) else [clique] * gpus
    inventory = pb.Inventory(
        generation=1, vcpus=64, memory_bytes=512 * GIB, hugepages_2mi=0, hugepages_1gi=16, isolated_cpus="",
        numa_nodes=[pb.NumaNode(id=0, cpulist="0-31", memory_bytes=256 * GIB),
                    pb.NumaNode(id=1, cpulist="32-63", memory_bytes=256 * GIB)],
        gpus=[pb.Gpu(uuid=f"{uuid}-{i}", model="H100-SXM5-80GB", memory_mib=81559, numa_node=i // 2,
                     nvlink_cluster="fab-1", nvlink_clique=cliques[i]) for i in range(gpus)])
    return pb.NodeMessage(hello=pb.Hello(daemon_version=version, capabilities=list(caps), inventory=inventory))


def heartbeat(generation: int = 0) -> pb.NodeMessage:
    return pb.NodeMessage(heartbeat=pb.Heartbeat(time=int(time.time() * 1000), applied_generation=generation))


def eventually(check: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def node_row(conninfo: str, node_id: str) -> dict[str, Any]:
    return sql(conninfo, "SELECT * FROM nodes WHERE id = %s", (node_id,))[0]


def binding(cp: ControlPlane, count: int = 2, **kw: Any) -> tuple[str, str]:
    """A reservation created through the API, placed, and moved to binding by the reservation
    worker (which bumps the node's desired state); (reservation id, allocation id)."""
    r = cp.create(count=count, **kw)
    cp.drain()
    r = cp.get(r.id)
    assert r.state == "binding", r
    return r.id, r.allocations[-1].id


def set_limits(conninfo: str, allocation_id: str, limits: dict[str, Any]) -> None:
    """Host-resource limits on an allocation: no API asks for them yet, so this one column is
    written directly (before the worker moves it to binding and the node hears of it)."""
    sql(conninfo, "UPDATE allocations SET limits = %s WHERE id = %s", (Jsonb(limits), allocation_id))


def latest(session: Session, conninfo: str, node_id: str) -> pb.DesiredState:
    """The pushed desired state of the node's current generation (earlier pushes skipped)."""
    want = node_row(conninfo, node_id)["desired_generation"]
    while (state := session.recv(timeout=30)).generation < want:
        pass
    return state


def wakes(conninfo: str, reservation_id: str) -> int:
    """Wake-ups of the reservation waiting for the worker: items due now (a binding's timeout is
    scheduled for later and is not one)."""
    return sql(conninfo, "SELECT count(*) AS n FROM work_items WHERE kind = 'reservation' AND subject = %s"
                         " AND run_at <= compute_now()", (reservation_id,))[0]["n"]


@pytest.fixture
def gateway(database: str) -> Iterator[GatewayThread]:
    gw = GatewayThread(database)
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def pool_id(database: str) -> str:
    return seed_pool(database)


@pytest.fixture
def cp(database: str) -> Iterator[ControlPlane]:
    """The control plane on the gateway's database (a tenant, a pool, a user; workers on demand)."""
    control = ControlPlane(database)
    try:
        yield control
    finally:
        control.stop()


def enrolled(gateway: GatewayThread, pool_id: str, name: str, role: str = "node") -> Node:
    node = Node(gateway)
    node.enrol(join_token(gateway.conninfo, pool_id, name, role))
    return node


@contextlib.contextmanager
def inventory_waiting(gateway: GatewayThread, pool_id: str, session: Session, inventory: pb.Inventory) -> Iterator[None]:
    """The test holds the pool's lock; `session` sends `inventory`, and the block runs once that
    waits for the lock (released when the block ends)."""
    with psycopg.connect(gateway.conninfo) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("pool:" + pool_id,))
        session.send(pb.NodeMessage(inventory=inventory))
        eventually(lambda: sql(gateway.conninfo, "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"),
                   what="the inventory waiting for the pool lock")
        yield


def connected(gateway: GatewayThread, pool_id: str, name: str, **hello_kw: Any) -> tuple[Node, Session]:
    """An enrolled node with an open session that has said hello."""
    node = enrolled(gateway, pool_id, name)
    session = node.session()
    assert session.recv() is not None
    session.send(hello(**hello_kw))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["connectivity"] == "connected", what="hello")
    return node, session


# Enrolment ----------------------------------------------------------------------------------

def test_enrolment_spends_a_join_token_once(gateway: GatewayThread, pool_id: str) -> None:
    token = join_token(gateway.conninfo, pool_id, "gpu-01")
    node = Node(gateway)
    response = node.enrol(token)
    cert = split(response.certificate_pem)[1]
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == response.node_id
    assert response.ca_certificate_pem == gateway.ca_pem
    assert response.not_after == int(cert.not_valid_after_utc.timestamp() * 1000)
    assert node_row(gateway.conninfo, response.node_id)["name"] == "gpu-01"

    expired = join_token(gateway.conninfo, pool_id, "gpu-02")
    sql(gateway.conninfo, "UPDATE join_tokens SET expires_at = now() - interval '1 second'"
                          " WHERE node_id IS NULL")
    for secret in (token, expired, "bcj_wrong", ""):
        with pytest.raises(grpc.RpcError) as refused:
            Node(gateway).enrol(secret)
        assert rpc_error(refused)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")

    with pytest.raises(grpc.RpcError) as bad_csr, grpc.secure_channel(
            gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
        node_pb2_grpc.NodeGatewayStub(ch).Enrol(pb.EnrolRequest(join_token=join_token(
            gateway.conninfo, pool_id, "gpu-03"), csr_pem=b"not a csr"), timeout=10)
    assert rpc_error(bad_csr)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT")


# Mutual TLS: who the node is ---------------------------------------------------------------

def test_session_and_renew_need_a_client_certificate(gateway: GatewayThread, pool_id: str) -> None:
    # The enrolment port never asks for a client certificate: both refuse per call.
    with grpc.secure_channel(gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
        stub = node_pb2_grpc.NodeGatewayStub(ch)
        with pytest.raises(grpc.RpcError) as renew:
            stub.Renew(pb.RenewRequest(csr_pem=NodeKeys().csr()), timeout=10)
        assert rpc_error(renew)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        session = Session(ch)
        assert session.ended() is not None and session.error.code() == grpc.StatusCode.UNAUTHENTICATED
    # The session port requires one in the handshake.
    with grpc.secure_channel(gateway.endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
        session = Session(ch)
        assert session.ended(10).code() == grpc.StatusCode.UNAVAILABLE


def test_the_node_is_the_one_its_certificate_names(gateway: GatewayThread, pool_id: str) -> None:
    a, b = enrolled(gateway, pool_id, "a"), enrolled(gateway, pool_id, "b")
    session = a.session()
    session.send(hello(version="bcd-a"))
    eventually(lambda: node_row(gateway.conninfo, a.node_id)["daemon_version"] == "bcd-a", what="hello")
    assert node_row(gateway.conninfo, b.node_id)["daemon_version"] == ""

    fresh = NodeKeys()  # a renewal brings new keys
    with a.channel() as ch:
        renewed = node_pb2_grpc.NodeGatewayStub(ch).Renew(pb.RenewRequest(csr_pem=fresh.csr()), timeout=10)
    a.keys = fresh
    for cert in split(renewed.certificate_pem):
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == a.node_id
        assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "node"
    a.certified(renewed.certificate_pem)  # a new session with the renewed certificate is the same node
    again = a.session()
    again.send(hello(version="bcd-a2"))
    eventually(lambda: node_row(gateway.conninfo, a.node_id)["daemon_version"] == "bcd-a2", what="hello")
    session.close()
    again.close()


def test_a_revoked_certificate_is_refused_and_its_open_session_closed(gateway: GatewayThread, pool_id: str) -> None:
    node, session = connected(gateway, pool_id, "gpu-01")
    arun(gateway.conninfo, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "stolen"))
    ended = session.ended()
    assert ended is not None and ended.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in ended.details()
    refused = node.session()
    assert refused.ended().code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_session_cancelled_while_it_is_unregistered_is_still_unregistered(
    gateway: GatewayThread, pool_id: str
) -> None:
    """The FakeDaemon's unreachable fault closes its side, then cancels the call: gRPC cancels the
    session's task while it unregisters. The unregistering must finish all the same."""
    node, session = connected(gateway, pool_id, "gpu-01")
    waiting = ("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
               "AND query LIKE '%%UPDATE nodes SET session_id = NULL%%'")
    with capture_logs() as logs, psycopg.connect(gateway.conninfo) as holder:
        holder.execute("SELECT 1 FROM nodes WHERE id = %s FOR UPDATE", (node.node_id,))  # the unregister waits
        session.outbox.put(None)  # the node closes its side: the gateway ends the session...
        eventually(lambda: sql(gateway.conninfo, waiting), what="the unregister waiting for the row")
        session.call.cancel()  # ...and, while it unregisters, the node cancels the call
        eventually(lambda: session.call.done(), what="the call cancelled")
        time.sleep(0.5)  # for the cancellation to reach the gateway's task
        assert sql(gateway.conninfo, waiting)  # still waiting: not cancelled with the call
        holder.rollback()
        eventually(lambda: node_row(gateway.conninfo, node.node_id)["session_id"] is None, 10, "unregistered")
        eventually(lambda: any(e["event"] == "session ended" for e in logs), 10, "the end logged")


def test_the_newest_session_of_a_node_wins_across_gateways(gateway: GatewayThread, pool_id: str) -> None:
    other = GatewayThread(gateway.conninfo)  # a second replica on the same database and CA
    try:
        node, first = connected(gateway, pool_id, "gpu-01")
        node.gateway = other
        second = node.session()
        assert second.recv() is not None
        ended = first.ended()
        assert ended is not None and ended.code() == grpc.StatusCode.ABORTED
        row = node_row(gateway.conninfo, node.node_id)
        assert row["session_gateway"] == other.settings.gateway_id and row["session_id"]
        sql(gateway.conninfo, "SELECT bump_desired(%s)", (node.node_id,))
        assert second.recv().generation == 1  # the winner still gets its desired state
        second.close()
    finally:
        other.stop()


# Hello: labels, capabilities, atoms, host resources -----------------------------------------

def test_hello_writes_labels_capabilities_atoms_and_host_resources(gateway: GatewayThread, cp: ControlPlane) -> None:
    node = enrolled(gateway, cp.pool_id, "gpu-01")
    operator = {"rack": {"value": "r1", "source": "operator"},
                "bc.dev/cap.binding.kubernetes": {"value": "true", "source": "operator"}}
    sql(gateway.conninfo, "UPDATE nodes SET labels = %s WHERE id = %s", (Jsonb(operator), node.node_id))
    session = node.session()
    session.send(hello(caps=("devices.limits", "binding.kubernetes", "Bad Cap!")))
    row = eventually(lambda: (r := node_row(gateway.conninfo, node.node_id))["connectivity"] == "connected" and r)
    assert row["daemon_version"] == "bcd 0.5.0" and row["last_seen"] is not None
    assert row["capabilities"] == ["binding.kubernetes", "devices.limits"]
    assert row["labels"] == {
        "rack": {"value": "r1", "source": "operator"},
        "bc.dev/cap.binding.kubernetes": {"value": "true", "source": "system"},
        "bc.dev/cap.devices.limits": {"value": "true", "source": "system"},
        "fabric.domain": {"value": "fab-1/7", "source": "system"},
    }
    assert row["inventory"]["vcpus"] == 64 and row["inventory"]["numa_nodes"][1]["cpulist"] == "32-63"
    atoms = sql(gateway.conninfo, "SELECT device_uuid, kind, model, numa_node, nvlink_domain, bookable"
                                  " FROM atoms WHERE node_id = %s ORDER BY device_uuid", (node.node_id,))
    assert atoms == [{"device_uuid": f"GPU-{i}", "kind": "gpu", "model": "H100-SXM5-80GB", "numa_node": i // 2,
                      "nvlink_domain": "fab-1/7", "bookable": True} for i in range(4)]
    resources = sql(gateway.conninfo, "SELECT resource, allocatable FROM host_resources WHERE node_id = %s",
                    (node.node_id,))
    assert {r["resource"]: int(r["allocatable"]) for r in resources} == {  # memory beside the huge pages
        "vcpu": 64, "memoryGiB": 512 - 16, "hugepages1Gi": 16}

    # A downgraded daemon on a changed host: the capability labels go (an operator label of the
    # same name was replaced by the system one), a vanished GPU (booked) stays but is not
    # bookable, the GPUs no longer agree on a fabric.
    rid, aid = binding(cp, count=4)  # every GPU, GPU-3 too
    cp.drain()
    session.send(hello(gpus=3, caps=(), clique=["7", "7", "8"]))
    eventually(lambda: "bc.dev/cap.devices.limits" not in node_row(gateway.conninfo, node.node_id)["labels"])
    labels = node_row(gateway.conninfo, node.node_id)["labels"]
    assert labels == {"rack": {"value": "r1", "source": "operator"}}
    gone = sql(gateway.conninfo, "SELECT bookable FROM atoms WHERE node_id = %s AND device_uuid = 'GPU-3'",
               (node.node_id,))
    assert gone == [{"bookable": False}]
    assert wakes(gateway.conninfo, rid) >= 1  # the reservation booked on it hears of it
    cp.drain()
    cp.check_invariants()
    session.close()


# Desired state ------------------------------------------------------------------------------

def test_desired_state_is_pushed_on_connect_and_on_every_bump(gateway: GatewayThread, cp: ControlPlane) -> None:
    node, session = connected(gateway, cp.pool_id, "gpu-01")
    limits = {"cpu_millis": 16000, "memory_bytes": 64 * GIB, "hugepages_1gi": 2, "cpus": "2-17", "mems": "0"}
    ends_first, _ = binding(cp, count=1, duration="30m")
    r = cp.create(count=2, duration="90m")
    set_limits(gateway.conninfo, r.allocations[-1].id, limits)
    cp.drain()
    held = cp.get(r.id)
    assert held.state == "binding"
    placed = cp.create(count=1, start=cp.world.later(24))  # placed, not yet binding
    assert placed.state == "placed"
    # 40 minutes on: the first one's booking has ended (no worker pass since: still binding).
    cp.advance(40 * 60_000)
    assert cp.get(ends_first).state == "binding"
    sql(gateway.conninfo, "SELECT bump_desired(%s)", (node.node_id,))
    state = latest(session, gateway.conninfo, node.node_id)
    [assignment] = state.assignments  # the placed one and the one that ended are not held
    assert assignment == pb.DeviceAssignment(
        allocation_id=held.allocations[-1].id, device_ids=list(held.allocations[-1].device_ids),
        until=held.during.end, binding=pb.BINDING_HOLD, limits=pb.Limits(**limits), device_class="gpu")

    # No polling: every bump reaches the session, pushed on the NOTIFY (the bound is generous;
    # the gateway has no timer that could push it instead).
    with psycopg.connect(gateway.conninfo, autocommit=True) as conn:
        for _ in range(3):
            started = time.monotonic()
            conn.execute("SELECT bump_desired(%s)", (node.node_id,))
            pushed = session.recv(timeout=30)
            assert pushed.generation == node_row(gateway.conninfo, node.node_id)["desired_generation"]
            assert time.monotonic() - started < 10
    session.close()
    fresh = node.session()  # and a new session gets it on connect
    assert fresh.recv().generation == pushed.generation
    fresh.close()
    cp.check_invariants()


# Reports ------------------------------------------------------------------------------------

def cdi_names(conninfo: str, allocation_id: str) -> list[str]:
    """The CDI names bcd gives the allocation's devices (none for an unknown allocation)."""
    rows = sql(conninfo, "SELECT device_ids FROM allocations WHERE id = %s", (allocation_id,))
    return [f"bcd.dev/gpu={d}" for d in rows[0]["device_ids"]] if rows else []


def _bound_body(node_id: str, allocation_id: str, devices: list[str] | None = None) -> bytes:
    return pb.Report(node_id=node_id, sequence=7, time=int(time.time() * 1000), bound=pb.AllocationBound(
        allocation_id=allocation_id, cdi_devices=devices or ["bcd.dev/gpu=GPU-0"],
        env_file="/run/bcd/a.env")).SerializeToString()


def test_a_report_about_another_nodes_allocation_is_ignored_like_an_unknown_one(
        gateway: GatewayThread, cp: ControlPlane) -> None:
    a, session = connected(gateway, cp.pool_id, "a")
    mine, my_alloc = binding(cp, count=4)  # fills a
    b, b_session = connected(gateway, cp.pool_id, "b", uuid="GPU-b")
    theirs, their_alloc = binding(cp, count=2)  # so this one is on b
    assert [cp.get(rid).allocations[-1].node_id for rid in (mine, theirs)] == [a.node_id, b.node_id]
    cp.drain()
    session.send(a.report(_bound_body(a.node_id, their_alloc)))  # signed by a, about b's allocation
    session.send(a.report(_bound_body(b.node_id, their_alloc)))  # claims to be b, on a's session
    session.send(a.report(_bound_body(a.node_id, "alloc_unknown")))
    session.send(pb.NodeMessage(report=pb.AttestedReport(body=b"\xff\x00junk", key_id=a.key_id)))
    session.send(a.report(_bound_body(a.node_id, my_alloc, cdi_names(gateway.conninfo, my_alloc))))  # after the others
    eventually(lambda: sql(gateway.conninfo, "SELECT 1 FROM node_reports WHERE allocation_id = %s", (my_alloc,)))
    theirs_now = sql(gateway.conninfo, "SELECT bound_report FROM allocations WHERE id = %s", (their_alloc,))
    assert theirs_now == [{"bound_report": None}]
    assert sql(gateway.conninfo, "SELECT allocation_id FROM node_reports") == [{"allocation_id": my_alloc}]
    assert wakes(gateway.conninfo, theirs) == 0 and wakes(gateway.conninfo, mine) == 1
    cp.drain()
    assert cp.get(theirs).state == "binding" and cp.get(mine).state == "active"
    cp.check_invariants()
    session.close()
    b_session.close()


def test_a_bound_report_is_kept_byte_for_byte_and_wakes_the_reservation(
        gateway: GatewayThread, cp: ControlPlane) -> None:
    node, session = connected(gateway, cp.pool_id, "gpu-01")
    rid, aid = binding(cp)
    cp.drain()
    # Valid but not canonical (fields out of order): re-serializing would change the bytes.
    body = (pb.Report(bound=pb.AllocationBound(allocation_id=aid, cdi_devices=cdi_names(gateway.conninfo, aid)))
            .SerializeToString() + pb.Report(node_id=node.node_id, sequence=1,
                                             time=int(time.time() * 1000)).SerializeToString())
    message = node.report(body)
    session.send(message)
    row = eventually(lambda: sql(gateway.conninfo, "SELECT node_id, kind, body, key_id, signature FROM node_reports"))[0]
    assert (row["node_id"], row["kind"], bytes(row["body"])) == (node.node_id, "bound", body)
    assert bytes(row["signature"]) == message.report.signature and row["key_id"] == node.key_id
    assert wakes(gateway.conninfo, rid) == 1
    # The evidence is the reservation worker's to write, once the check passed; the gateway's never.
    assert sql(gateway.conninfo, "SELECT state, bound_report FROM allocations WHERE id = %s", (aid,)) == [
        {"state": "binding", "bound_report": None}]

    async def check(pool: Any) -> tuple[bool, str, Any]:  # what the reservation worker will run
        async with pool.connection() as conn:
            return await attest.verify_bound_report(conn, aid, node.node_id, row["body"],
                                                    row["key_id"], row["signature"],
                                                    PkiSettings().offline_grace)

    ok, reason, report = arun(gateway.conninfo, check)
    assert (ok, reason, report.bound.allocation_id) == (True, "", aid)
    cp.drain()  # and the worker, judging it, activates the reservation
    assert cp.get(rid).state == "active" and cp.get(rid).binding.attested
    cp.check_invariants()
    session.close()


def test_failed_and_released_reports_are_kept_and_wake_the_reservation(
        gateway: GatewayThread, cp: ControlPlane) -> None:
    node, session = connected(gateway, cp.pool_id, "gpu-01")
    rid, aid = binding(cp)
    cp.drain()
    now_ms = int(time.time() * 1000)  # a report dated far from its certificate's life never counts
    failed = pb.Report(node_id=node.node_id, sequence=1, time=now_ms,
                       failed=pb.AllocationFailed(allocation_id=aid, reason="resources-exhausted"))
    released = pb.Report(node_id=node.node_id, sequence=2, time=now_ms,
                         released=pb.AllocationReleased(allocation_id=aid, reason="ended"))
    session.send(node.report(failed.SerializeToString()))
    session.send(node.report(released.SerializeToString()))
    kinds = eventually(lambda: [r["kind"] for r in sql(gateway.conninfo, "SELECT kind FROM node_reports ORDER BY id")]
                       if len(sql(gateway.conninfo, "SELECT 1 FROM node_reports")) == 2 else None)
    assert kinds == ["failed", "released"]
    assert wakes(gateway.conninfo, rid) == 2
    assert sql(gateway.conninfo, "SELECT bound_report, state FROM allocations WHERE id = %s", (aid,)) == [
        {"bound_report": None, "state": "binding"}]
    cp.drain()
    assert sql(gateway.conninfo, "SELECT state FROM allocations WHERE id = %s", (aid,)) == [{"state": "failed"}]
    cp.check_invariants()
    session.close()


# Connectivity -------------------------------------------------------------------------------

def test_the_unreachable_sweeper_flips_connectivity_and_wakes_reservations_once(database: str) -> None:
    # The test sweeps with no grace, on demand, from both gateways at once. The gateways' own
    # sweepers do not run meanwhile (an hour's grace, one round at start): the holding gateway
    # heard the node within its grace, so its next round would make it connected again and wake
    # the reservation a second time before the test looked.
    settings = GatewaySettings(node_grace_seconds=3600, sweep_seconds=3600)
    first, second = GatewayThread(database, settings), GatewayThread(database, settings)
    cp = ControlPlane(database)
    try:
        node, session = connected(first, cp.pool_id, "gpu-01")
        rid, aid = binding(cp)
        cp.drain()

        def sweep_from_both(grace: float) -> list[str]:
            calls = [asyncio.run_coroutine_threadsafe(connectivity.sweep(gw.gateway.pool, grace), gw.loop)
                     for gw in (first, second) for _ in range(3)]
            return [node_id for call in calls for node_id in call.result(30)]

        assert sweep_from_both(3600) == []  # heard from within the grace: left alone
        assert node_row(database, node.node_id)["connectivity"] == "connected"
        assert sweep_from_both(0) == [node.node_id]  # six sweeps, one change
        assert node_row(database, node.node_id)["connectivity"] == "unreachable"
        assert wakes(database, rid) == 1
        session.send(heartbeat(generation=3))
        eventually(lambda: node_row(database, node.node_id)["connectivity"] == "connected", what="connected")
        assert node_row(database, node.node_id)["applied_generation"] == 3
        assert wakes(database, rid) == 2
        cp.drain()
        cp.check_invariants()
        session.close()
    finally:
        cp.stop()
        first.stop()
        second.stop()


def test_a_short_lived_certificate_gets_a_renewal_hint_and_its_session_ends_at_expiry(
        database: str, pool_id: str) -> None:
    # Ten seconds of life: enrolment and the session's start have that long on a busy machine.
    gw = GatewayThread(database, GatewaySettings(pki=PkiSettings(node_cert_hours=10 / 3600)))
    try:
        node = enrolled(gw, pool_id, "gpu-01")
        session = node.session()
        hint = session.recv("renew_hint")
        assert hint.not_after == x509.load_pem_x509_certificate(node.cert_pem).not_valid_after_utc.timestamp() * 1000
        ended = session.ended(timeout=60)
        assert ended is not None and ended.code() == grpc.StatusCode.UNAUTHENTICATED
        assert time.time() * 1000 >= hint.not_after  # not before the certificate ran out
    finally:
        gw.stop()


def test_the_gateway_renews_its_server_certificate_in_place(database: str, pool_id: str) -> None:
    gw = GatewayThread(database, GatewaySettings(pki=PkiSettings(gateway_cert_hours=3 / 3600)))
    try:
        # Renewed at half of 3 s; then, once the first has expired, handshakes get the renewed one.
        first = sql(database, "SELECT not_after FROM node_certs WHERE usage = 'server' ORDER BY not_after")[0]
        eventually(lambda: len(sql(database, "SELECT 1 FROM node_certs WHERE usage = 'server'")) >= 2, timeout=60,
                   what="a renewed server certificate")
        eventually(lambda: sql(database, "SELECT now() > %s AS past", (first["not_after"],))[0]["past"], timeout=60,
                   what="the first certificate's end")
        enrolled(gw, pool_id, "gpu-01")
    finally:
        gw.stop()


# Logs ---------------------------------------------------------------------------------------

def test_one_log_line_per_rpc_and_per_session_start_and_end(gateway: GatewayThread, pool_id: str) -> None:
    token = join_token(gateway.conninfo, pool_id, "gpu-01")
    with capture_logs() as logs:
        node = Node(gateway)
        node.enrol(token)
        session = node.session()
        session.recv()
        session.close()
        eventually(lambda: any(e["event"] == "session ended" for e in logs), what="session end")
    rpc = [e for e in logs if e["event"] == "rpc"]
    assert [(e["method"], e["code"]) for e in rpc] == [("/bettercompute.node.v1.NodeGateway/Enrol", "OK")]
    started = [e for e in logs if e["event"] == "session started"]
    assert len(started) == 1 and [e["event"] for e in logs].count("session ended") == 1


# The real process ---------------------------------------------------------------------------

def gateway_process(database: str, tmp_path: pathlib.Path, **env: str) -> tuple[subprocess.Popen, Any]:
    """`python -m gateway` on free ports, once it serves: the process, and what Node needs of it."""
    ca_file = tmp_path / "ca.pem"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--listen", "127.0.0.1:0", "--enrol-listen", "127.0.0.1:0",
         "--write-ca", str(ca_file)], cwd=REPO, env={**os.environ, "DATABASE_URL": database, "BC_LOG_FORMAT": "json",
                                                    **env},
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("gateway listening on "), line
    ports = [int(p.split()[0]) for p in line.split("127.0.0.1:")[1:]]

    class Remote:  # what Node needs of a gateway
        conninfo = database
        endpoint = f"127.0.0.1:{ports[0]}"
        enrol_endpoint = f"127.0.0.1:{ports[1]}"
        ca_pem = ca_file.read_bytes()

    return proc, Remote


def test_python_m_gateway_serves_nodes_as_a_real_process(database: str, pool_id: str, tmp_path: pathlib.Path) -> None:
    proc, remote = gateway_process(database, tmp_path)
    try:
        node = Node(remote)
        node.enrol(join_token(database, pool_id, "gpu-01"))
        session = node.session()
        assert session.recv() is not None
        session.send(hello())
        eventually(lambda: node_row(database, node.node_id)["connectivity"] == "connected", what="hello")
        assert len(sql(database, "SELECT 1 FROM atoms WHERE node_id = %s", (node.node_id,))) == 4
        session.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_real_gateway_stops_on_sigterm_while_its_database_does_not_answer(
        database: str, pool_id: str, tmp_path: pathlib.Path) -> None:
    """A gateway holding a node's session stops on SIGTERM even when its database has gone away:
    the sessions' release waits BC_GATEWAY_STOP_DB_SECONDS for it, then leaves them (the node is
    judged by its grace, as after a crash). It waited for the pool, 30 seconds per statement and
    again on every retry, for minutes."""
    proc, remote = gateway_process(database, tmp_path, BC_GATEWAY_STOP_DB_SECONDS="2")
    dbname = conninfo_to_dict(database)["dbname"]
    with psycopg.connect(make_conninfo(database, dbname="postgres"), autocommit=True) as admin:
        try:
            node = Node(remote)
            node.enrol(join_token(database, pool_id, "gpu-01"))
            session = node.session()
            session.recv()
            session.send(hello())
            eventually(lambda: node_row(database, node.node_id)["connectivity"] == "connected", what="hello")
            # The database goes away for the gateway: no new connection, and every one it has ends.
            admin.execute(SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(Identifier(dbname)))
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (dbname,))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=45) == 0
            session.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            admin.execute(SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(Identifier(dbname)))
    # Left as a crash leaves it: the node's session still names the stopped gateway.
    assert sql(database, "SELECT session_gateway IS NOT NULL AS registered FROM nodes WHERE id = %s",
               (node.node_id,)) == [{"registered": True}]


# Per-connection costs (docs/benchmarks-fleet.md) --------------------------------------------

class RecordRelay:
    """A TCP relay in front of the enrolment port that reads the TLS record headers the gateway
    sends (5 bytes: type, version, length), as they go by."""

    def __init__(self, target: str) -> None:
        import socket
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.records: list[tuple[int, int]] = []  # (content type, length) from the gateway
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: Any, sink: Any, from_gateway: bool) -> None:
        pending = b""
        try:
            while data := source.recv(65536):
                if from_gateway:  # recorded before it is passed on: the client never sees more than `records`
                    pending += data
                    while len(pending) >= 5 and len(pending) >= 5 + int.from_bytes(pending[3:5], "big"):
                        length = int.from_bytes(pending[3:5], "big")
                        self.records.append((pending[0], length))
                        pending = pending[5 + length:]
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                sock.close()

    def close(self) -> None:
        self.listener.close()


def test_the_gateway_writes_tls_records_no_larger_than_its_frame_size(database: str, pool_id: str) -> None:
    # Every connection keeps a buffer of the largest record it may write, for its whole life.
    gw = GatewayThread(database, GatewaySettings(tls_frame_bytes=1024))
    relay = RecordRelay(gw.enrol_endpoint)
    try:
        node = Node(gw)
        with grpc.secure_channel(relay.endpoint, grpc.ssl_channel_credentials(gw.ca_pem),
                                 options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
            response = node_pb2_grpc.NodeGatewayStub(ch).Enrol(
                pb.EnrolRequest(join_token=join_token(database, pool_id, "gpu-frames"), csr_pem=node.keys.csr()),
                timeout=10)
        node.node_id = response.node_id
        node.certified(response.certificate_pem)
        application = [length for kind, length in relay.records if kind == 23]  # TLS application data
        # The answer (two certificates and the CA's, well over 1 KiB) came whole, in several records.
        assert len(response.certificate_pem) + len(response.ca_certificate_pem) > 2048
        assert sum(application) > 2048 and max(application) <= 1024
        # A session over such a connection works as ever.
        session = node.session()
        assert session.recv().generation >= 0
    finally:
        relay.close()
        gw.stop()


def test_the_gateways_grpc_options_follow_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.server import server_options

    assert dict(server_options(GatewaySettings())) == {
        "grpc.tsi.max_frame_size": 4096, "grpc.http2.bdp_probe": 0, "grpc.enable_channelz": 0}
    monkeypatch.setenv("BC_GATEWAY_TLS_FRAME_BYTES", "16384")
    monkeypatch.setenv("BC_GATEWAY_HTTP2_BDP_PROBE", "1")
    assert dict(server_options(GatewaySettings())) == {
        "grpc.tsi.max_frame_size": 16384, "grpc.http2.bdp_probe": 1, "grpc.enable_channelz": 0}
