"""DESIGN.md's promises that no other test held: tokens stored as their SHA-256 only (sections 7
and 17), the clock that only moves forward and is the same in every process (section 4), and
events that carry their tenant, increasing ids, the product clock's time and the catalog's data
(sections 13 and 18). Against the real control plane, its database and its Watch stream."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from google.protobuf.json_format import MessageToDict
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.config import Settings
from controlplane.devtools import devstack
from controlplane.common.status import error_info
from controlplane.pki import admin, attest, certs
from controlplane.pki.config import PkiSettings
from gateway.config import GatewaySettings
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, clock_now, eventually, get, invalid, make_world, refused
from tests.test_evidence import Node, assignment, bound, rejections
from tests.test_pki import seed_pool, sql
from tests.test_gateway import GatewayThread, Session, arun, connected, enrolled, hello, join_token
from tests.test_gateway import eventually as until
from tests.test_watch import Stream
from tests.test_webhooks import LOOPBACK, SECRET, create_hook, reserve

DAY_MS = 86_400_000
HOUR = 3_600_000


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def test_a_token_is_stored_as_its_sha256_and_its_secret_nowhere(world: World) -> None:
    """DESIGN 7/17: "Tokens are random secrets stored hashed"; "tokens stored as SHA-256, never in
    clear"."""
    token = world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=world.user_id))
    [(stored_hash, row)] = world.sql("SELECT token_hash, row_to_json(t)::text FROM api_tokens t WHERE id = %s",
                                     (token.id,))
    assert bytes(stored_hash) == hashlib.sha256(token.secret.encode()).digest()
    assert token.secret not in row and token.secret[len(token.prefix):] not in row
    # The secret authenticates through its hash.
    me = Client(world.endpoint, token.secret)
    assert me.res("List", pb.ListReservationsRequest(tenant_id=world.tenant)) is not None
    me.close()


def test_the_clock_only_moves_forward(world: World) -> None:
    """DESIGN 4: "an admin RPC moves the offset forward"."""
    before = world.root.admin("GetClock", apb.GetClockRequest()).offset_ms
    for by in (0, -1, -DAY_MS):
        invalid("byMs", world.root.admin, "AdvanceClock", apb.AdvanceClockRequest(by_ms=by))
    assert world.root.admin("GetClock", apb.GetClockRequest()).offset_ms == before
    moved = world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=HOUR))
    assert moved.offset_ms == before + HOUR


def test_a_clock_moved_through_one_process_is_every_processs_and_stamps_its_events(world: World) -> None:
    """DESIGN 4: "All lifecycle time is the database's ... Replicas' clocks may disagree; the
    database's does not" and the offset moves "across processes"; DESIGN 13/18: events carry
    tenantId, a monotonically increasing id, time, and reservation.placed nodeIds, start, end."""
    other = ServerThread(world.conninfo, Settings(database_url=world.conninfo), workers=False)
    try:
        world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=3 * DAY_MS))
        moved = clock_now(world)
        token = world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=world.user_id)).secret
        there = Client(other.endpoint, token)
        root_there = Client(other.endpoint, world.root.metadata[0][1].removeprefix("Bearer "))
        seen = root_there.admin("GetClock", apb.GetClockRequest())
        assert seen.offset_ms >= 3 * DAY_MS and seen.now >= moved
        # A create through the process that never moved the clock books from the moved "now".
        created = [there.res("Create", world.create_request(key=f"k{i}", count=1, duration="1h"))
                   for i in range(2)]
        assert all(r.state == "placed" and r.during.start >= moved for r in created)
        with Stream(there, tenant_id=world.tenant, after_id=0, types=["reservation.placed"]) as stream:
            events = stream.take(2)
        assert [e.id for e in events] == sorted({e.id for e in events})  # increasing, no repeat
        assert all(e.tenant_id == world.tenant and e.type == "reservation.placed" for e in events)
        for event, r in zip(events, created):
            assert event.subject == f"reservation/{r.id}"
            assert moved <= event.time <= clock_now(world), (event.time, moved)
            data = MessageToDict(event.data)
            nodes = {a.node_id for a in r.allocations}
            assert (sorted(data["nodeIds"]), int(data["start"]), int(data["end"])) == (
                sorted(nodes), r.during.start, r.during.end), data
        there.close()
        root_there.close()
    finally:
        other.stop()


@pytest.fixture
def fleet(pg_uri: str) -> Iterator[tuple[World, GatewayThread]]:
    """A control plane (no clock control) and a real gateway on a database of this test's own."""
    control_plane = module_stack(pg_uri)
    server, root = next(control_plane)
    gateway = GatewayThread(server.conninfo)
    try:
        yield make_world(server.endpoint, root, server.conninfo, nodes=0), gateway
    finally:
        gateway.stop()
        next(control_plane, None)


def _in_session(world: World, gateway: GatewayThread, name: str) -> tuple[Node, Session]:
    node = Node(gateway)
    node.enrol(join_token(world.conninfo, world.pool_id, name))
    session = node.session()
    session.send(hello(gpus=1, uuid=f"GPU-{node.node_id}"))
    until(lambda: world.sql("SELECT connectivity = 'connected' FROM nodes WHERE id = %s", (node.node_id,))[0][0],
          what="hello")
    return node, session


def test_a_foreign_nodes_report_stored_behind_the_gateways_back_never_binds(
        fleet: tuple[World, GatewayThread]) -> None:
    """DESIGN 12: "The reservation worker accepts a report only when the spec's three checks pass;
    each rejection emits reservation.binding-rejected" (signed by the node holding the allocation),
    whoever stored it: a genuine report of another node about this allocation never counts."""
    world, gateway = fleet
    a, b = _in_session(world, gateway, "gpu-a"), _in_session(world, gateway, "gpu-b")
    r = world.create(count=1, duration="8h")
    [alloc] = get(world, r.id).allocations
    (owner, owner_session), (foreign, _) = (a, b) if alloc.node_id == a[0].node_id else (b, a)
    given = assignment(owner_session)
    assert given.allocation_id == alloc.id
    # The other node signs, with its own genuine key, that it bound this allocation's devices; a
    # compromised gateway stores it as that node's report.
    message = foreign.signed(bound(foreign, given))
    world.sql("INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)"
              " VALUES (%s, %s, 'bound', %s, %s, %s)",
              (foreign.node_id, alloc.id, message.report.body, message.report.key_id, message.report.signature))
    world.sql("SELECT wake_reservation(%s)", (r.id,))
    eventually(world, r.id, lambda x: rejections(world, r.id) == [attest.OTHER_NODE])
    seen = get(world, r.id)
    assert seen.state == "binding" and [x.state for x in seen.allocations] == ["binding"]
    assert world.sql("SELECT bound_report IS NULL FROM allocations WHERE id = %s", (alloc.id,)) == [(True,)]
    # The owner's own report still binds it.
    owner_session.send(owner.signed(bound(owner, given)))
    eventually(world, r.id, lambda x: x.state == "active")
    a[1].close()
    b[1].close()


def _with_unknown_field(message: bytes, number: int = 99) -> bytes:
    tag = (number << 3) | 0  # a varint field no message of the API declares
    return message + bytes([tag & 0x7F | 0x80, tag >> 7]) + b"\x01"


@pytest.mark.parametrize("method, request_", [
    ("/bettercompute.v1.Events/Watch", lambda w: epb.WatchRequest(tenant_id=w.tenant, after_id=0)),
    ("/bettercompute.v1.Webhooks/List", lambda w: epb.ListWebhooksRequest(tenant_id=w.tenant)),
    ("/bettercompute.v1.Reservations/Get", lambda w: pb.GetReservationRequest(
        tenant_id=w.tenant, reservation_id="rsv_" + "0" * 52)),
    ("/bettercompute.v1.Admin/GetClock", lambda w: apb.GetClockRequest()),
])
def test_an_unknown_field_is_invalid_input_on_every_kind_of_call(world: World, method: str, request_: Any) -> None:
    """DESIGN 6: INVALID_INPUT for an "unknown field (unknown protobuf fields are detected, not
    silently dropped)", on a server stream as on unary calls, whatever the service."""
    payload = _with_unknown_field(request_(world).SerializeToString())
    client = world.root if "/Admin/" in method else world.user
    if method.endswith("/Watch"):
        call = client.channel.unary_stream(method)
        attempt = lambda: next(iter(call(payload, metadata=client.metadata, timeout=30)))  # noqa: E731
    else:
        call = client.channel.unary_unary(method)
        attempt = lambda: call(payload, metadata=client.metadata, timeout=30)  # noqa: E731
    code, reason, details = refused(attempt)
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "#99")


class HangingFirst:
    """An HTTP receiver on 127.0.0.1 that verifies each request with the Standard Webhooks library;
    the first request is left unanswered until `release`, every later one answered 200."""

    def __init__(self) -> None:
        self.verifier = Webhook(SECRET)
        self.hits: list[tuple[dict[str, str], dict[str, Any], bool]] = []
        self.first, self.release, self.lock = threading.Event(), threading.Event(), threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    signed = outer.verifier.verify(body, headers) == json.loads(body)
                except WebhookVerificationError:
                    signed = False
                with outer.lock:
                    outer.hits.append((headers, json.loads(body), signed))
                    first = len(outer.hits) == 1
                if first:
                    outer.first.set()
                    outer.release.wait(60)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_delivery_whose_process_died_mid_attempt_is_delivered_by_another(database: str, tmp_path: Path) -> None:
    """DESIGN 13: "Webhooks deliver each event at least once ... a receiver can verify and
    de-duplicate by event id"; DESIGN 2: "Killing any process at any moment loses nothing". A
    replica killed (SIGKILL) while its attempt waits on the receiver leaves the delivery to the next
    replica once the attempt's lease has run out; both requests are signed with the same id."""
    api = ServerThread(database, Settings(database_url=database, webhook_allow=LOOPBACK), workers=False)
    root = Client(api.endpoint, bootstrap.ensure_root(database))
    receiver = HangingFirst()
    env = {"BC_WEBHOOK_ALLOW": "127.0.0.1/32", "BC_WEBHOOK_ATTEMPT_SECONDS": "2"}
    replicas = []
    try:
        world = make_world(api.endpoint, root, database, nodes=1)
        create_hook(world, receiver.url)
        replicas.append(devstack.controlplane(database, tmp_path / "a.log", env=env)[0])
        reserve(world)
        assert receiver.first.wait(30), "the first replica never attempted the delivery"
        replicas[0].kill()
        replicas.append(devstack.controlplane(database, tmp_path / "b.log", env=env)[0])
        [(state, attempts, event_id)] = until(lambda: world.sql(
            "SELECT state, attempts, event_id FROM webhook_deliveries WHERE state = 'delivered'"), what="delivered")
        assert attempts == 2
        with receiver.lock:
            hits = list(receiver.hits)
        assert len(hits) == 2 and all(signed for _, _, signed in hits)
        assert [h["webhook-id"] for h, _, _ in hits] == [str(event_id)] * 2
        assert hits[0][1] == hits[1][1]  # the same event, to de-duplicate by its id
        world.close()
    finally:
        for replica in replicas:
            replica.stop()
        receiver.close()
        root.close()
        api.stop()


def _ended_with(session: Session) -> tuple[grpc.StatusCode, str, str]:
    ended = session.ended()
    assert ended is not None, "the session did not end"
    info = error_info(ended)
    assert info is not None, f"no ErrorInfo on {ended.code()} {ended.details()!r}"
    return ended.code(), info.reason, ended.details()


def test_a_session_the_gateway_ends_says_why_with_error_info(database: str) -> None:
    """DESIGN 6: "Every failure is a gRPC status whose details carry a google.rpc.ErrorInfo with
    reason set to the spec's code", with CONFLICT as ABORTED and UNAUTHENTICATED for a bad
    credential: a node session ended by a newer one, by its certificate's revocation or by its
    expiry says so in ErrorInfo, as a session refused at its start does."""
    pool_id = seed_pool(database)
    gateway = GatewayThread(database)
    short = GatewayThread(database, GatewaySettings(pki=PkiSettings(node_cert_hours=10 / 3600)))
    try:
        node, first = connected(gateway, pool_id, "gpu-01")
        second = node.session()
        assert second.recv() is not None
        assert _ended_with(first)[:2] == (grpc.StatusCode.ABORTED, "CONFLICT")

        arun(database, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "stolen"))
        code, reason, message = _ended_with(second)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED") and "revoked" in message
        assert _ended_with(node.session())[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")

        brief = enrolled(short, pool_id, "gpu-02")
        session = brief.session()
        session.recv("renew_hint")
        code, reason, message = _ended_with(session)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED") and "expired" in message
    finally:
        short.stop()
        gateway.stop()


def test_a_clock_jump_through_the_api_wakes_the_workers_of_another_process(database: str) -> None:
    """DESIGN 4: "an admin RPC moves the offset forward, so a test can jump to ... and watch the
    workers react, across processes": the API process (no workers) moves the clock past a placed
    reservation's start, and the worker process (which never moved it) starts the binding."""
    api = ServerThread(database, Settings(database_url=database, clock_control=True), workers=False)
    worker = ServerThread(database, Settings(database_url=database), workers=True)
    root = Client(api.endpoint, bootstrap.ensure_root(database))
    try:
        world = make_world(api.endpoint, root, database)
        start = world.later(2)
        r = world.create(start=start, duration="1h")
        assert r.state == "placed"
        root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=2 * HOUR))
        seen = eventually(world, r.id, lambda x: x.state == "binding")
        assert seen.during.start == start
        world.close()
    finally:
        root.close()
        worker.stop()
        api.stop()


def test_a_reservation_that_failed_says_why_in_its_event(world: World) -> None:
    """DESIGN 18: "reservation.cancelled, .failed, .expired, .awaiting-confirmation | reason", and
    "Data always carries state and poolId": three binding timeouts fail it, and its event says so."""
    world.add_node()  # three nodes: placed again twice, each time avoiding the node that failed
    r = world.create(count=8, duration="8h")
    for attempt in range(1, 4):
        current = eventually(world, r.id, lambda x: x.state in ("binding", "failed"))
        if current.state == "failed":
            break
        world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=5 * 60_000 + 1000))
        eventually(world, r.id, lambda x, n=attempt: x.state == "failed" or world.sql(  # type: ignore[misc]
            "SELECT bind_failures FROM reservations WHERE id = %s", (r.id,))[0][0] >= n)
    eventually(world, r.id, lambda x: x.state == "failed")
    with Stream(world.user, tenant_id=world.tenant, after_id=0, subject=f"reservation/{r.id}",
                types=["reservation.failed"]) as stream:
        [failed] = stream.take(1)
    data = MessageToDict(failed.data)
    assert (data["state"], data["poolId"]) == ("failed", world.pool_id)
    assert isinstance(data.get("reason"), str) and data["reason"], data


def test_revoking_the_sessions_own_certificate_by_serial_ends_it_and_only_it(database: str) -> None:
    """DESIGN 12: "revocation is a table the check reads": revoking the one TLS certificate an open
    session runs on (by its serial, not the node) ends that session at once, UNAUTHENTICATED; the
    node's other certificates and the node itself stay good (another node's session is untouched)."""
    pool_id = seed_pool(database)
    gateway = GatewayThread(database)
    try:
        node, session = connected(gateway, pool_id, "gpu-01")
        other, other_session = connected(gateway, pool_id, "gpu-02", uuid="GPU-OTHER")
        serial = certs.serial_hex(x509.load_pem_x509_certificate(node.cert_pem))
        assert arun(database, lambda pool: admin.revoke_certificates(pool, "", serial, "key lost")) == [serial]
        code, reason, message = _ended_with(session)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED") and "revoked" in message
        assert sql(database, "SELECT revoked_at IS NULL AS good FROM nodes WHERE id = %s", (node.node_id,)) == [{"good": True}]
        signing = certs.serial_hex(x509.load_pem_x509_certificate(node.signing_pem))
        assert sql(database, "SELECT count(*) AS n FROM revocations WHERE serial = %s", (signing,)) == [{"n": 0}]
        sql(database, "SELECT bump_desired(%s)", (other.node_id,))
        assert other_session.recv("desired_state") is not None  # the other node's session lives on
        other_session.close()
    finally:
        gateway.stop()
