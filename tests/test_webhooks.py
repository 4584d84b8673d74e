"""Webhooks against a real HTTP receiver on loopback that checks every signature: delivered once,
retried with back-off, in order per subject, dead after the last attempt; management and tenancy.
The receivers listen on 127.0.0.1, which this module's control plane allowlists (a local address
is refused otherwise: tests/test_webhook_ssrf.py)."""

from __future__ import annotations

import base64
import ipaddress
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import psycopg
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import admin_pb2 as apb
from controlplane.webhooks import delivery
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world, rpc_error

SECRET = "whsec_" + base64.b64encode(b"s3cret-s3cret-s3cret-s3cret-").decode()
LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)


@dataclass
class Hit:
    event: dict[str, Any]
    headers: dict[str, str]
    status: int  # what the receiver answered
    at: float
    signed: bool


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that verifies every request with the Standard Webhooks library
    (keyed with `secret`) and records it. `answer(event, attempt)` picks the status; attempt counts
    from 1 per event id."""

    def __init__(self, answer: Callable[[dict[str, Any], int], int] = lambda e, n: 200,
                 secret: str = SECRET) -> None:
        self.answer = answer
        self.verifier = Webhook(secret)
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver._record({k.lower(): v for k, v in self.headers.items()}, body, self)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def _record(self, headers: dict[str, str], body: bytes, handler: BaseHTTPRequestHandler) -> None:
        event = json.loads(body)
        try:
            signed = self.verifier.verify(body, headers) == event
        except WebhookVerificationError:
            signed = False
        with self.lock:
            attempt = 1 + sum(1 for h in self.hits if h.event["id"] == event["id"])
            status = self.answer(event, attempt)
            self.hits.append(Hit(event, headers, status, time.monotonic(), signed))
        handler.send_response(status)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def of(self, subject: str | None = None, type_: str | None = None) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if (subject is None or h.event["subject"] == subject)
                    and (type_ is None or h.event["type"] == type_)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """The loopback receivers allowlisted; clock control to trigger a retry on demand."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=5, clock_control=True)


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small back-off for tests; the worker runs in this process and reads the policy at each use."""
    monkeypatch.setattr(delivery, "POLICY", delivery.RetryPolicy(
        max_attempts=3, base_seconds=0.2, cap_seconds=0.4, poll_seconds=1))


def hooks(client: Client, method: str, request: Any) -> Any:
    return getattr(events_pb2_grpc.WebhooksStub(client.channel), method)(
        request, metadata=client.metadata, timeout=30)


def create_hook(world: World, url: str, **kw: Any) -> epb.Webhook:
    return hooks(world.user, "Create", epb.CreateWebhookRequest(tenant_id=world.tenant, url=url, secret=SECRET, **kw))


def deliveries(world: World, hook: epb.Webhook) -> dict[int, epb.Delivery]:
    listed = hooks(world.user, "ListDeliveries", epb.ListDeliveriesRequest(tenant_id=world.tenant, webhook_id=hook.id))
    return {d.event_id: d for d in listed.items}


def reserve(world: World) -> str:
    """A reservation that stays placed (it starts a day from now); its subject."""
    start = world.sql("SELECT epoch_ms(compute_now())")[0][0] + 86_400_000
    return f"reservation/{world.create(start=start).id}"


def release(world: World, subject: str) -> None:
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant,
                                                           reservation_id=subject.split("/", 1)[1]))


def eventually(check: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            assert result, "condition not met in time"
            return result
        time.sleep(0.02)


def test_an_event_is_delivered_once_signed_with_the_webhook_secret(world: World, receiver: Receiver) -> None:
    hook = create_hook(world, receiver.url)
    subject = reserve(world)
    hit = eventually(lambda: receiver.of(subject))[0]
    assert hit.signed and hit.status == 200
    event = hit.event
    assert set(event) == {"id", "type", "subject", "tenantId", "time", "data"}
    assert (event["type"], event["tenantId"], event["data"]["state"]) == ("reservation.placed", world.tenant, "placed")
    assert hit.headers["webhook-id"] == str(event["id"])
    assert abs(int(hit.headers["webhook-timestamp"]) - time.time()) < 60
    assert hit.headers["webhook-signature"].startswith("v1,")
    assert hit.headers["content-type"] == "application/json"
    d = eventually(lambda: next((d for d in deliveries(world, hook).values()
                                 if d.event_id == event["id"] and d.state == "delivered"), None))
    assert (d.attempts, d.last_status, d.subject, d.event_type) == (1, 200, subject, "reservation.placed")
    assert d.HasField("last_attempt_at") and not d.HasField("next_attempt_at")
    # Delivered after one claim: no other attempt is in flight (the receiver records before answering).
    assert len(receiver.of(subject)) == 1


def test_failed_attempts_are_retried_with_back_off_until_delivered(world: World) -> None:
    receiver = Receiver(lambda event, attempt: 503 if attempt <= 2 else 204)
    try:
        hook = create_hook(world, receiver.url)
        subject = reserve(world)
        hits = eventually(lambda: [h for h in receiver.of(subject) if h.status == 204] and receiver.of(subject))
        assert [h.status for h in hits] == [503, 503, 204] and all(h.signed for h in hits)
        # Back-off: at least half the base delay after the first failure, half of double after the second.
        assert hits[1].at - hits[0].at >= 0.1 and hits[2].at - hits[1].at >= 0.2
        d = eventually(lambda: next((d for d in deliveries(world, hook).values() if d.state == "delivered"), None))
        assert (d.attempts, d.last_status, d.last_error) == (3, 204, "")
    finally:
        receiver.close()


def test_later_events_of_a_subject_wait_while_an_earlier_one_is_failing(world: World,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Enough attempts that the failing placement outlasts any delay of the other subject's delivery.
    monkeypatch.setattr(delivery, "POLICY", delivery.RetryPolicy(
        max_attempts=100, base_seconds=0.1, cap_seconds=0.2, poll_seconds=1))
    first_start, other_start = world.later(24), world.later(48)  # tells the two placements apart
    other_seen = threading.Event()

    def answer(event: dict[str, Any], attempt: int) -> int:
        start = event["data"].get("start") if event["type"] == "reservation.placed" else None
        if start == other_start:
            other_seen.set()
        # The first placement fails at least twice, and until the other subject's event has come:
        # if that one waited behind it, the placement would die after its last attempt.
        return 500 if start == first_start and (attempt <= 2 or not other_seen.is_set()) else 200

    receiver = Receiver(answer)
    try:
        create_hook(world, receiver.url)
        first = f"reservation/{world.create(start=first_start).id}"
        release(world, first)
        other = f"reservation/{world.create(start=other_start).id}"
        eventually(lambda: receiver.of(first, "reservation.released"))
        order = [(h.event["type"], h.status) for h in receiver.of(first)]
        failures = len(order) - 2
        assert failures >= 2
        assert order == [("reservation.placed", 500)] * failures + [("reservation.placed", 200),
                                                                    ("reservation.released", 200)]
        # Another subject did not wait for the failing one.
        placed_ok = receiver.of(first, "reservation.placed")[-1]
        assert receiver.of(other)[0].at < placed_ok.at
    finally:
        receiver.close()


def test_a_delivery_is_dead_after_the_last_attempt_and_its_subject_moves_on(world: World,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A back-off of about an hour: each retry comes only when the test moves compute_now() on.
    monkeypatch.setattr(delivery, "POLICY", delivery.RetryPolicy(
        max_attempts=3, base_seconds=3600, cap_seconds=3600, poll_seconds=1))
    receiver = Receiver(lambda event, attempt: 500 if event["type"] == "reservation.placed" else 200)
    try:
        hook = create_hook(world, receiver.url)
        subject = f"reservation/{world.create(start=world.later(72)).id}"  # still ahead after the moves
        release(world, subject)
        for attempt in (1, 2):
            # Between attempts the delivery is pending, with the last status and the next attempt at
            # least half the back-off ahead (while an attempt runs, it is its lease's end: seconds).
            waiting = eventually(lambda: next((d for d in deliveries(world, hook).values()  # noqa: B023
                                               if d.state == "pending" and d.attempts == attempt
                                               and d.next_attempt_at - d.last_attempt_at >= 1_800_000), None))
            assert waiting.last_status == 500 and waiting.last_error == "HTTP 500"
            assert len(receiver.of(subject)) == attempt  # the released event waits behind it
            world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=3_600_001))
        eventually(lambda: receiver.of(subject, "reservation.released"))
        assert [h.status for h in receiver.of(subject)] == [500, 500, 500, 200]
        def recorded() -> dict | None:  # the receiver answers before the delivery's row records it
            found = {d.event_type: d for d in deliveries(world, hook).values()}
            return found if found["reservation.released"].state == "delivered" else None

        by_type = eventually(recorded)
        dead, sent = by_type["reservation.placed"], by_type["reservation.released"]
        assert (dead.state, dead.attempts, dead.last_status) == ("dead", 3, 500)
        assert not dead.HasField("next_attempt_at")
        assert (sent.state, sent.attempts) == ("delivered", 1)
    finally:
        receiver.close()


def test_two_replicas_deliver_each_event_once_in_order_per_subject(world: World, receiver: Receiver,
                                                                   stack: Any) -> None:
    server, _ = stack
    replica = ServerThread(server.conninfo, server.settings)  # a second control plane and delivery worker
    try:
        create_hook(world, receiver.url)
        subjects = [reserve(world) for _ in range(6)]
        for subject in subjects[:3]:
            release(world, subject)
        hook = hooks(world.user, "List", epb.ListWebhooksRequest(tenant_id=world.tenant)).items[0]
        # Every delivery recorded delivered after one claim: no attempt is left in flight anywhere.
        eventually(lambda: [(d.state, d.attempts) for d in deliveries(world, hook).values()] == [("delivered", 1)] * 9)
    finally:
        replica.stop()
    ids = [h.event["id"] for h in receiver.of()]
    assert len(ids) == len(set(ids)) == 9
    for subject in subjects[:3]:
        assert [h.event["type"] for h in receiver.of(subject)] == ["reservation.placed", "reservation.released"]


def test_event_type_filter_and_deletion(world: World, receiver: Receiver) -> None:
    hook = create_hook(world, receiver.url, event_types=["reservation.released"])
    subject = reserve(world)
    release(world, subject)
    hit = eventually(lambda: receiver.of(subject))[0]
    assert hit.event["type"] == "reservation.released"
    hooks(world.user, "Delete", epb.DeleteWebhookRequest(tenant_id=world.tenant, webhook_id=hook.id))
    control = Receiver()  # a webhook that stays: its delivery shows the later events were worked on
    try:
        create_hook(world, control.url, event_types=["reservation.released"])
        later = reserve(world)
        release(world, later)
        eventually(lambda: control.of(later, "reservation.released"))
        assert receiver.of(subject) == [hit] and receiver.of(later) == []
    finally:
        control.close()


def test_webhook_management_validates_and_keeps_tenants_apart(world: World, receiver: Receiver, stack: Any) -> None:
    bad = [
        ({"url": "ftp://127.0.0.1/x"}, "url"),
        ({"url": "http:///nohost"}, "url"),
        ({"secret": "short"}, "secret"),
        ({"event_types": ["Not A Type"]}, "eventTypes"),
    ]
    for fields, field in bad:
        request = epb.CreateWebhookRequest(tenant_id=world.tenant, url=receiver.url, secret=SECRET)
        for key, value in fields.items():
            if isinstance(value, list):
                getattr(request, key).extend(value)
            else:
                setattr(request, key, value)
        with pytest.raises(grpc.RpcError) as exc:
            hooks(world.user, "Create", request)
        assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": field}), field
    hook = create_hook(world, receiver.url, event_types=["reservation."])
    assert hook.id.startswith("whk_") and list(hook.event_types) == ["reservation."]
    assert hook.created_by == world.user_id
    got = hooks(world.user, "Get", epb.GetWebhookRequest(tenant_id=world.tenant, webhook_id=hook.id))
    assert got == hook and SECRET not in str(got)
    listed = hooks(world.user, "List", epb.ListWebhooksRequest(tenant_id=world.tenant))
    assert [h.id for h in listed.items] == [hook.id]

    server, root = stack
    other = make_world(server.endpoint, root, server.conninfo, nodes=0)
    with pytest.raises(grpc.RpcError) as exc:
        hooks(other.user, "Get", epb.GetWebhookRequest(tenant_id=other.tenant, webhook_id=hook.id))
    assert rpc_error(exc)[1] == "NOT_FOUND"
    with pytest.raises(grpc.RpcError) as exc:
        hooks(other.user, "List", epb.ListWebhooksRequest(tenant_id=world.tenant))
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    with pytest.raises(grpc.RpcError) as exc:
        hooks(other.user, "Delete", epb.DeleteWebhookRequest(tenant_id=other.tenant, webhook_id=hook.id))
    assert rpc_error(exc)[1] == "NOT_FOUND"

    world.policy('permit(principal, action == Action::"compute:events:read", resource);')
    with pytest.raises(grpc.RpcError) as exc:
        create_hook(world, receiver.url)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"


def test_a_webhook_without_a_secret_gets_one_generated_and_shown_once(world: World) -> None:
    """The generated secret comes back in Create's answer only, and a stock Standard Webhooks
    receiver keyed with it verifies the deliveries."""
    receiver = Receiver(secret="whsec_" + base64.b64encode(b"\0" * 24).decode())  # not the generated one
    try:
        hook = hooks(world.user, "Create", epb.CreateWebhookRequest(tenant_id=world.tenant, url=receiver.url))
        assert hook.secret.startswith("whsec_") and len(base64.b64decode(hook.secret[6:])) == 32
        got = hooks(world.user, "Get", epb.GetWebhookRequest(tenant_id=world.tenant, webhook_id=hook.id))
        assert got.secret == "" and hook.secret not in str(got)
        subject = reserve(world)
        assert not eventually(lambda: receiver.of(subject))[0].signed  # a wrong key does not verify
        receiver.verifier = Webhook(hook.secret)
        later = reserve(world)
        assert eventually(lambda: receiver.of(later))[0].signed
    finally:
        receiver.close()


@pytest.mark.parametrize("secret", [
    "s3cret-s3cret-s3cret-s3cret",  # not whsec_
    "whsec_" + base64.b64encode(b"k" * 23).decode(),  # too short a key
    "whsec_" + base64.b64encode(b"k" * 65).decode(),  # too long a key
    "whsec_not*base64",
    "whsec_" + base64.urlsafe_b64encode(b"\xfb" * 24).decode(),  # url-safe alphabet: not what receivers decode
])
def test_a_given_secret_must_be_a_standard_webhooks_secret(world: World, receiver: Receiver, secret: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        hooks(world.user, "Create", epb.CreateWebhookRequest(tenant_id=world.tenant, url=receiver.url, secret=secret))
    assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": "secret"})
    for length in (24, 64):
        ok = "whsec_" + base64.b64encode(b"k" * length).decode()
        hook = hooks(world.user, "Create", epb.CreateWebhookRequest(tenant_id=world.tenant, url=receiver.url, secret=ok))
        assert hook.secret == ""  # a given secret is never returned
        hooks(world.user, "Delete", epb.DeleteWebhookRequest(tenant_id=world.tenant, webhook_id=hook.id))


def test_migration_keeps_an_old_secret_as_the_same_key(pg_uri: str) -> None:
    """A secret stored before migration 0012 was the HMAC key itself; after it, "whsec_" and its
    base64: the key bytes are unchanged, and the old secret cannot be read as anything else."""
    from controlplane import db
    from controlplane.ids import new_id

    name = f"t_mig_{new_id('x')[-12:]}"
    with psycopg.connect(pg_uri, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        conninfo = db.with_database(pg_uri, name)
        before = sorted(p for p in db.MIGRATIONS.glob("*.sql") if p.name < "0012")
        with psycopg.connect(conninfo, autocommit=True) as conn:
            for path in before:
                conn.execute(path.read_text())
            conn.execute("CREATE TABLE schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL"
                         " DEFAULT now())")
            conn.cursor().executemany("INSERT INTO schema_migrations (name) VALUES (%s)", [(p.name,) for p in before])
            conn.execute("INSERT INTO tenants (id, name) VALUES ('ta', 'a')")
            old = "an old secret, ünïcode and long " * 8  # 256 characters, more bytes
            conn.execute("INSERT INTO webhooks (id, tenant_id, url, secret, created_by)"
                         " VALUES ('whk_old', 'ta', 'https://example.com/h', %s, 't')", (old[:256],))
        assert db.migrate(conninfo)[0] == "0012_standard_webhooks.sql"
        with psycopg.connect(conninfo, autocommit=True) as conn:
            secret = conn.execute("SELECT secret FROM webhooks WHERE id = 'whk_old'").fetchone()[0]
            assert secret == "whsec_" + base64.b64encode(old[:256].encode()).decode()
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute("UPDATE webhooks SET secret = 'not-whsec-anything-at-all'")
    finally:
        with psycopg.connect(pg_uri, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
