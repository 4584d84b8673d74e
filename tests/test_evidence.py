"""Evidence is written once, by the judge: node reports through a real gateway (real mutual TLS,
real keys) into a real control plane whose reservation worker judges them.

- allocations.bound_report / bound_sig_kid / bound_sig are written only by the worker, after the
  check passed: a forged re-report of a bound allocation leaves those bytes as they were;
- a node's old genuine report replays neither through the gateway (acked REPLAYED, not stored)
  nor when stored behind the gateway's back (rejected as a replay; nothing else changes);
- every report is acknowledged; nodesim sends what was never acknowledged again after a
  reconnect, in order (through a relay that swallows what the node sends, then cuts the line);
- re-enrolling a node name revokes the node's earlier certificates, and a node an operator
  revoked enrols again only after ReadmitNode.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from psycopg.types.json import Jsonb

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import nodes_pb2_grpc
from controlplane.ids import new_id
from controlplane.pki import attest, certs
from nodesim.config import parse_args
from nodesim.fleet import Fleet
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, eventually, get, make_world, rpc_error
from tests.test_gateway import GatewayThread, Session, hello, join_token
from tests.test_gateway import Node as GatewayNode
from tests.test_gateway import eventually as eventually_
from tests.test_pki import seed_pool, sql





# A real gateway and a minimal node client --------------------------------------------------

class Node(GatewayNode):
    """The gateway tests' node, whose reports are numbered and dated like a daemon's, and signed
    by its own key or, for a forgery, by another."""

    def __init__(self, gateway: GatewayThread) -> None:
        super().__init__(gateway)
        self.sequence = 0

    def body(self, **event: Any) -> bytes:
        self.sequence += 1
        return pb.Report(node_id=self.node_id, sequence=self.sequence, time=int(time.time() * 1000),
                         **event).SerializeToString()

    def signed(self, body: bytes, key: ed25519.Ed25519PrivateKey | None = None) -> pb.NodeMessage:
        signature = (key or self.keys.signing).sign(attest.signed_message(body))
        return pb.NodeMessage(report=pb.AttestedReport(body=body, key_id=self.key_id, signature=signature))



@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client, GatewayThread]]:
    control_plane = module_stack(pg_uri)
    server, root = next(control_plane)
    gateway = GatewayThread(server.conninfo)
    try:
        yield server, root, gateway
    finally:
        gateway.stop()
        next(control_plane, None)  # stops the control plane


@pytest.fixture
def world(stack: tuple[ServerThread, Client, GatewayThread]) -> World:
    server, root, _ = stack
    return make_world(server.endpoint, root, server.conninfo, nodes=0)


@pytest.fixture
def node(stack: tuple[ServerThread, Client, GatewayThread], world: World) -> Iterator[tuple[Node, Session]]:
    """The pool's one node, enrolled through the gateway, in session, said hello."""
    gateway = stack[2]
    node = Node(gateway)
    node.enrol(join_token(world.conninfo, world.pool_id, "gpu-01"))
    session = node.session()
    session.send(hello(uuid=f"GPU-{node.node_id}"))  # a GPU uuid is one node's: the module's nodes each their own
    eventually_(lambda: world.sql("SELECT connectivity = 'connected' FROM nodes WHERE id = %s", (node.node_id,))[0][0],
             what="hello")
    yield node, session
    session.close()


def assignment(session: Session) -> pb.DeviceAssignment:
    """The first assignment a desired state pushed to the session names."""
    while True:
        state = session.recv("desired_state")
        assert state is not None, "the session ended"
        if state.assignments:
            return state.assignments[0]


def bound(node: Node, a: pb.DeviceAssignment, cdi: list[str] | None = None) -> bytes:
    devices = cdi if cdi is not None else [f"bcd.dev/gpu={d}" for d in a.device_ids]
    return node.body(bound=pb.AllocationBound(allocation_id=a.allocation_id, cdi_devices=devices))


def active(world: World, node: Node, session: Session) -> tuple[str, pb.DeviceAssignment, bytes, pb.NodeMessage]:
    """A reservation made active by the node's genuine bind report through the gateway."""
    r = world.create(count=2, duration="8h")
    a = assignment(session)
    message = node.signed(bound(node, a))
    session.send(message)
    assert session.recv("report_ack").outcome == pb.REPORT_STORED
    eventually(world, r.id, lambda x: x.state == "active")
    return r.id, a, message.report.body, message


def evidence(world: World, allocation_id: str) -> tuple[bytes, str, bytes]:
    [(body, kid, sig)] = world.sql("SELECT bound_report, bound_sig_kid, bound_sig FROM allocations WHERE id = %s",
                                   (allocation_id,))
    return bytes(body), kid, bytes(sig)


def rejections(world: World, rid: str) -> list[str]:
    return [r[0] for r in world.sql("SELECT data->>'reason' FROM events WHERE subject = %s"
                                    " AND type = 'reservation.binding-rejected' ORDER BY id", (f"reservation/{rid}",))]


def lost(r: Any) -> bool:
    return any(c.reason == "BindingLost" for c in r.conditions)


# Evidence is written once, by the judge -------------------------------------------------------

def test_a_forged_re_report_of_a_bound_allocation_leaves_the_evidence_bytes_unchanged(
        world: World, node: tuple[Node, Session]) -> None:
    n, session = node
    rid, a, genuine, message = active(world, n, session)
    assert evidence(world, a.allocation_id) == (genuine, n.key_id, message.report.signature)

    # The node's key id over another binding, signed by a key that is not the node's.
    forged = bound(n, a, cdi=["bcd.dev/gpu=GPU-elsewhere"])
    session.send(n.signed(forged, ed25519.Ed25519PrivateKey.generate()))
    assert session.recv("report_ack").outcome == pb.REPORT_STORED  # kept for the judge, as received
    judged = eventually(world, rid, lambda x: lost(x))
    assert rejections(world, rid) == [attest.BAD_SIGNATURE] and judged.state == "active"
    assert evidence(world, a.allocation_id) == (genuine, n.key_id, message.report.signature)


# Replays ------------------------------------------------------------------------------------

def test_a_replayed_genuine_report_through_the_gateway_is_dropped(world: World, node: tuple[Node, Session]) -> None:
    n, session = node
    rid, a, genuine, message = active(world, n, session)
    released = n.signed(n.body(released=pb.AllocationReleased(allocation_id=a.allocation_id, reason="unassigned")))
    session.send(released)
    assert session.recv("report_ack").outcome == pb.REPORT_STORED
    eventually(world, rid, lambda x: lost(x))
    stored = world.sql("SELECT count(*) FROM node_reports")[0][0]

    session.send(message)  # the genuine bind, byte for byte, again
    ack = session.recv("report_ack")
    assert (ack.outcome, ack.sequence, ack.key_id) == (pb.REPORT_REPLAYED, 1, n.key_id)
    assert world.sql("SELECT count(*) FROM node_reports")[0][0] == stored
    signing_key = certs.raw_ed25519(n.keys.signing.public_key())
    assert world.sql("SELECT sequence FROM report_sequences WHERE signing_key = %s", (signing_key,)) == [(2,)]
    current = get(world, rid)
    assert lost(current) and [x.state for x in current.allocations] == ["binding"]

    session.send(n.signed(bound(n, a)))  # a new report (sequence 3) binds again
    assert session.recv("report_ack").outcome == pb.REPORT_STORED
    eventually(world, rid, lambda x: not lost(x))


def test_a_replay_stored_behind_the_gateways_back_is_rejected_and_changes_nothing(
        world: World, node: tuple[Node, Session]) -> None:
    n, session = node
    rid, a, genuine, message = active(world, n, session)
    released = n.signed(n.body(released=pb.AllocationReleased(allocation_id=a.allocation_id, reason="unassigned")))
    session.send(released)
    assert session.recv("report_ack").outcome == pb.REPORT_STORED
    before = eventually(world, rid, lambda x: lost(x))

    # A compromised gateway stores the node's old genuine bind again.
    world.sql("INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)"
              " SELECT node_id, allocation_id, kind, body, key_id, signature FROM node_reports"
              " WHERE allocation_id = %s AND kind = 'bound'", (a.allocation_id,))
    world.sql("SELECT wake_reservation(%s)", (rid,))
    eventually(world, rid, lambda x: attest.REPLAYED in rejections(world, rid))
    after = get(world, rid)
    assert lost(after) and [x.state for x in after.allocations] == ["binding"]
    assert (after.state, after.version, list(after.conditions)) == (before.state, before.version, list(before.conditions))
    assert evidence(world, a.allocation_id) == (genuine, n.key_id, message.report.signature)


def test_a_genuine_report_dated_in_the_future_never_counts(world: World, node: tuple[Node, Session]) -> None:
    n, session = node
    r = world.create(count=2, duration="8h")
    a = assignment(session)
    n.sequence += 1
    body = pb.Report(node_id=n.node_id, sequence=n.sequence, time=int(time.time() * 1000) + 3_600_000,
                     bound=pb.AllocationBound(allocation_id=a.allocation_id, cdi_devices=["bcd.dev/gpu=GPU-0"]))
    session.send(n.signed(body.SerializeToString()))
    assert session.recv("report_ack").outcome == pb.REPORT_STORED
    eventually(world, r.id, lambda x: attest.FROM_THE_FUTURE in rejections(world, r.id))
    assert get(world, r.id).state == "binding"


# Enrolment: one live identity per node name; a revoked node needs an operator ------------------

def test_re_enrolling_a_node_name_revokes_its_earlier_certificates(
        stack: tuple[ServerThread, Client, GatewayThread], world: World, node: tuple[Node, Session]) -> None:
    gateway = stack[2]
    old, old_session = node
    again = Node(gateway)
    again.enrol(join_token(world.conninfo, world.pool_id, "gpu-01"))
    assert again.node_id == old.node_id

    ended = old_session.ended()  # the old identity's session closes
    assert ended is not None and ended.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in ended.details()
    refused = old.session().ended()
    assert refused is not None and refused.code() == grpc.StatusCode.UNAUTHENTICATED
    rows = sql(world.conninfo, "SELECT c.key_id, r.reason FROM node_certs c LEFT JOIN revocations r USING (serial)"
                               " WHERE c.node_id = %s AND c.usage = 'signing'", (old.node_id,))
    assert {r["key_id"]: r["reason"] for r in rows} == {old.key_id: "superseded by a new enrolment",
                                                        again.key_id: None}

    fresh = again.session()  # the new identity works
    fresh.send(hello(uuid=f"GPU-{again.node_id}"))
    assert fresh.recv("desired_state") is not None
    fresh.close()


def test_a_revoked_node_enrols_again_only_after_an_operator_readmits_it(
        stack: tuple[ServerThread, Client, GatewayThread], world: World, node: tuple[Node, Session]) -> None:
    _, root, gateway = stack
    n, session = node
    stub = nodes_pb2_grpc.NodeAdminStub(root.channel)
    stub.RevokeCertificates(npb.RevokeCertificatesRequest(node_id=n.node_id, reason="stolen"), metadata=root.metadata)
    assert session.ended() is not None

    token = join_token(world.conninfo, world.pool_id, "gpu-01")
    with pytest.raises(grpc.RpcError) as refused:
        Node(gateway).enrol(token)
    code, reason, details = rpc_error(refused)
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    assert details["nodeId"] == n.node_id and "ReadmitNode" in refused.value.details()
    assert world.sql("SELECT used_at FROM join_tokens WHERE pool_id = %s AND node_id IS NULL",
                     (world.pool_id,)) == [(None,)]  # the refusal spent no token

    readmitted = stub.ReadmitNode(npb.ReadmitNodeRequest(node_id=n.node_id), metadata=root.metadata)
    assert readmitted.readmitted
    back = Node(gateway)
    back.enrol(token)  # the same token, now that an operator said so
    assert back.node_id == n.node_id
    assert not stub.ReadmitNode(npb.ReadmitNodeRequest(node_id=n.node_id), metadata=root.metadata).readmitted


# Acknowledged reports: nodesim sends again what was never acknowledged ---------------------

class Relay:
    """A TCP relay between nodes and a gateway. While `swallowing`, what nodes send is read and
    dropped (the gateway never hears it, the node's writes succeed); `cut` closes every connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.swallowing = False
        self.swallowed = 0
        self._transports: set[asyncio.WriteTransport] = set()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(10)
        self.endpoint = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._transports |= {writer.transport, up_writer.transport}  # type: ignore[arg-type]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, from_node: bool) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    if from_node and self.swallowing:
                        self.swallowed += len(data)
                        continue
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    def cut(self) -> None:
        def abort() -> None:
            for transport in self._transports:
                transport.abort()
            self._transports.clear()

        self.loop.call_soon_threadsafe(abort)

    def close(self) -> None:
        self.cut()
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


def book(conninfo: str, node_id: str, device_ids: list[str], atom_uuid: str) -> tuple[str, str]:
    """A binding reservation with one allocation on the node holding `device_ids`, booked on one atom."""
    rid, aid = "rsv_" + new_id("x")[2:], new_id("alloc")
    node = sql(conninfo, "SELECT pool_id FROM nodes WHERE id = %s", (node_id,))[0]
    tenant = sql(conninfo, "SELECT owner_tenant_id FROM pools WHERE id = %s", (node["pool_id"],))[0]["owner_tenant_id"]
    sql(conninfo, "INSERT INTO identities (id, kind, name) VALUES ('u', 'user', 'u') ON CONFLICT DO NOTHING")
    sql(conninfo, "INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,"
                  " request_hash, state, during) VALUES (%s, %s, %s, 'u', %s, %s, 'h', 'binding',"
                  " tstzrange(compute_now() - interval '1 minute', compute_now() + interval '1 hour'))",
        (rid, tenant, node["pool_id"], rid, Jsonb({"binding": "hold"})))
    sql(conninfo, "INSERT INTO allocations (id, reservation_id, node_id, state, device_ids, limits)"
                  " VALUES (%s, %s, %s, 'binding', %s, '{}')", (aid, rid, node_id, device_ids))
    sql(conninfo, "INSERT INTO bookings (atom_id, allocation_id, during) SELECT a.id, %s, r.during"
                  " FROM atoms a, reservations r WHERE a.node_id = %s AND a.device_uuid = %s AND r.id = %s",
        (aid, node_id, atom_uuid, rid))
    return rid, aid


def kinds(conninfo: str, allocation_ids: list[str]) -> list[tuple[str, str]]:
    return [(r["allocation_id"], r["kind"]) for r in sql(
        conninfo, "SELECT allocation_id, kind FROM node_reports WHERE allocation_id = ANY(%s) ORDER BY id",
        (allocation_ids,))]


def test_reports_the_gateway_never_heard_are_sent_again_after_a_reconnect_in_order(
        database: str, tmp_path: Path) -> None:
    pool_id = seed_pool(database)
    gateway = GatewayThread(database)
    relay = Relay(gateway.gateway.port)
    (tmp_path / "ca.pem").write_bytes(gateway.ca_pem)
    (tmp_path / "tokens.json").write_text(f'[{{"name": "sim-000", "joinToken": "{join_token(database, pool_id, "sim-000")}"}}]')
    config = parse_args(["--sim", "1", "--gateway", relay.endpoint, "--enrol-gateway", gateway.enrol_endpoint,
                         "--sandbox", str(tmp_path / "sandbox"), "--tokens", str(tmp_path / "tokens.json"),
                         "--ca", str(tmp_path / "ca.pem"), "--heartbeat", "0.5", "--gpus", "2"])
    cdi = tmp_path / "sandbox" / "sim-000" / "etc" / "cdi"

    async def scenario() -> None:
        fleet = Fleet(config)
        await fleet.start()
        try:
            await fleet.wait_connected(timeout=20)
            sim = fleet.node("sim-000")
            await until(lambda: sql(database, "SELECT 1 FROM atoms WHERE node_id = %s", (sim.node_id,)))
            gpus = [g.uuid for g in sim.hardware.inventory.gpus]
            _, held = book(database, sim.node_id, [gpus[0]], gpus[0])
            sql(database, "SELECT bump_desired(%s)", (sim.node_id,))
            await until(lambda: kinds(database, [held]) == [(held, "bound")])

            # The gateway goes deaf: the node's writes succeed but nothing arrives. Meanwhile the
            # hold is released and a new assignment fails (its device is not on this node).
            relay.swallowing = True
            _, failing = book(database, sim.node_id, ["GPU-not-here"], gpus[1])
            sql(database, "UPDATE allocations SET state = 'released' WHERE id = %s", (held,))
            sql(database, "SELECT bump_desired(%s)", (sim.node_id,))
            await until(lambda: not (cdi / f"bcd-{held}.json").exists())
            # Both reports and the heartbeat queued after them have left the node's outbox.
            await until(lambda: sim._outbox is not None and sim._outbox.empty() and relay.swallowed > 0)
            assert kinds(database, [held, failing]) == [(held, "bound")]

            relay.swallowing = False
            relay.cut()
            await until(lambda: len(kinds(database, [held, failing])) == 3, timeout=20)
            assert kinds(database, [held, failing]) == [(held, "bound"), (held, "released"), (failing, "failed")]
            sequences = [pb.Report.FromString(bytes(r["body"])).sequence for r in sql(
                database, "SELECT body FROM node_reports WHERE allocation_id = ANY(%s) ORDER BY id",
                ([held, failing],))]
            assert sequences == sorted(sequences)
            await until(lambda: not sim._unacked)
        finally:
            await fleet.stop()

    try:
        asyncio.run(scenario())
    finally:
        relay.close()
        gateway.stop()


async def until(check: Callable[[], Any], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {check}"
        await asyncio.sleep(0.02)
