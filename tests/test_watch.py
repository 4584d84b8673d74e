"""Events.Watch: stored then live events, filters, resumption without gaps or repeats, an id
committed late, tenancy and IAM, the stream caps, the end of a stream whose token is revoked or
expires, a safety net that wakes no idle watcher, and a hub that takes no snapshot while no one
watches yet loses nothing for the watcher that comes next. Events come from real reservation calls."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import event_hub
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world, rpc_error


class Stream:
    """One Watch call, read by a background thread into a queue."""

    def __init__(self, client: Client, timeout: float = 60, **request: Any) -> None:
        stub = events_pb2_grpc.EventsStub(client.channel)
        self.call = stub.Watch(epb.WatchRequest(**request), metadata=client.metadata, timeout=timeout)
        if request.get("from_now"):
            # "Now" is fixed when the server sends the headers: an event committed before them may
            # be in the start snapshot, and so never streamed. Callers act after it.
            self.call.initial_metadata()
        self.items: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for item in self.call:
                self.items.put(item)
        except grpc.RpcError as exc:
            self.items.put(exc)

    def take(self, n: int, timeout: float = 10) -> list[epb.Event]:
        got: list[epb.Event] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            item = self.items.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(item, grpc.RpcError):
                raise item
            got.append(item)
        return got

    def quiet(self, seconds: float = 0.4) -> None:
        """Nothing (more) arrives for a while."""
        try:
            item = self.items.get(timeout=seconds)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected {item}")

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.call.cancel()


def reserve(world: World, client: Client | None = None) -> pb.Reservation:
    """A reservation that stays placed: it starts a day from now, so no binding events follow."""
    start = world.sql("SELECT epoch_ms(compute_now())")[0][0] + 86_400_000
    return world.create(client, start=start)


def release(world: World, rid: str) -> None:
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def kinds(events: list[epb.Event]) -> list[tuple[str, str]]:
    return [(e.type, e.subject) for e in events]


def test_watch_streams_stored_events_then_live_ones_as_they_commit(world: World) -> None:
    r1 = reserve(world)
    release(world, r1.id)
    with Stream(world.user, tenant_id=world.tenant) as stream:
        stored = stream.take(2)
        assert kinds(stored) == [("reservation.placed", f"reservation/{r1.id}"),
                                 ("reservation.released", f"reservation/{r1.id}")]
        placed = stored[0]
        assert placed.tenant_id == world.tenant and placed.id < stored[1].id
        assert placed.data["state"] == "placed" and placed.data["poolId"] == world.pool_id
        assert placed.time > 1_700_000_000_000
        r2 = reserve(world)
        assert kinds(stream.take(1)) == [("reservation.placed", f"reservation/{r2.id}")]
        stream.quiet()


def test_watch_filters_by_exact_type_prefix_and_subject(world: World) -> None:
    r1, r2 = reserve(world), reserve(world)
    release(world, r1.id)
    with Stream(world.user, tenant_id=world.tenant, types=["reservation.released"]) as stream:
        assert kinds(stream.take(1)) == [("reservation.released", f"reservation/{r1.id}")]
        stream.quiet(0.2)
    with Stream(world.user, tenant_id=world.tenant, types=["reservation."]) as stream:
        assert len(stream.take(3)) == 3
    with Stream(world.user, tenant_id=world.tenant, subject=f"reservation/{r2.id}") as stream:
        assert kinds(stream.take(1)) == [("reservation.placed", f"reservation/{r2.id}")]
        release(world, r2.id)
        assert kinds(stream.take(1)) == [("reservation.released", f"reservation/{r2.id}")]
        reserve(world)  # another subject
        stream.quiet()
    with Stream(world.user, tenant_id=world.tenant, types=["reservation-grant."]) as stream:
        stream.quiet(0.2)


def test_watch_resumes_after_the_last_id_seen_with_no_gaps_or_repeats(world: World) -> None:
    for _ in range(3):
        reserve(world)
    with Stream(world.user, tenant_id=world.tenant) as stream:
        first = stream.take(2)
    # Disconnected: more events commit meanwhile.
    r = reserve(world)
    release(world, r.id)
    with Stream(world.user, tenant_id=world.tenant, after_id=first[-1].id) as stream:
        rest = stream.take(3)
        stream.quiet(0.2)
    with Stream(world.user, tenant_id=world.tenant) as stream:
        everything = stream.take(5)
    assert [e.id for e in first + rest] == [e.id for e in everything]
    assert len({e.id for e in everything}) == 5


def test_watch_from_now_skips_the_stored_events(world: World) -> None:
    reserve(world)
    with Stream(world.user, tenant_id=world.tenant, from_now=True) as stream:
        stream.quiet(0.2)
        r = reserve(world)
        assert kinds(stream.take(1)) == [("reservation.placed", f"reservation/{r.id}")]


def _begin_event(world: World, subject: str) -> psycopg.Connection:
    """An open transaction that has taken an event id and not committed (as a slow writer would)."""
    conn = psycopg.connect(world.conninfo)
    conn.execute("INSERT INTO events (tenant_id, type, subject, data) VALUES (%s, 'test.late', %s, '{}')",
                 (world.tenant, subject))
    conn.execute("SELECT pg_notify('bc_events', %s)", (world.tenant,))
    return conn


def test_an_event_id_committed_late_is_streamed_before_later_ids_never_skipped(world: World) -> None:
    with Stream(world.user, tenant_id=world.tenant) as stream:
        slow = _begin_event(world, "test/slow")
        try:
            r = reserve(world)  # a larger id, committed first
            stream.quiet(0.5)  # not streamed while a smaller id may still commit
        finally:
            slow.commit()
            slow.close()
        assert kinds(stream.take(2)) == [("test.late", "test/slow"), ("reservation.placed", f"reservation/{r.id}")]
        # A transaction that rolls back leaves a gap for good: the stream goes on without it.
        gone = _begin_event(world, "test/gone")
        r2 = reserve(world)
        stream.quiet(0.3)
        gone.rollback()
        gone.close()
        assert kinds(stream.take(1)) == [("reservation.placed", f"reservation/{r2.id}")]


def test_watch_needs_membership_and_never_shows_another_tenants_events(world: World, stack: Any) -> None:
    server, root = stack
    other = make_world(server.endpoint, root, server.conninfo, nodes=0)
    with Stream(other.user, tenant_id=world.tenant) as stream:
        with pytest.raises(grpc.RpcError) as exc:
            stream.take(1)
    assert rpc_error(exc)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    with Stream(other.user, tenant_id=other.tenant) as theirs:
        reserve(world)
        theirs.quiet()
        mine = other.create()  # no nodes: pending
        assert kinds(theirs.take(1)) == [("reservation.pending", f"reservation/{mine.id}")]


def test_watch_needs_iam_to_allow_compute_events_read(world: World) -> None:
    world.policy('permit(principal, action == Action::"compute:reservations:create", resource);')
    with Stream(world.user, tenant_id=world.tenant) as stream:
        with pytest.raises(grpc.RpcError) as exc:
            stream.take(1)
    assert rpc_error(exc)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")


@pytest.mark.parametrize("request_fields, field", [
    ({"types": ["Reservation Placed"]}, "types"),
    ({"after_id": 5, "from_now": True}, "fromNow"),
    ({"after_id": -1}, "afterId"),
])
def test_watch_rejects_bad_requests(world: World, request_fields: dict[str, Any], field: str) -> None:
    with Stream(world.user, tenant_id=world.tenant, **request_fields) as stream:
        with pytest.raises(grpc.RpcError) as exc:
            stream.take(1)
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", field)


# Caps, ends, and the safety net -------------------------------------------------------------

PER_IDENTITY, PER_TENANT = 3, 5


@pytest.fixture(scope="module")
def capped(pg_uri: str) -> Any:
    yield from module_stack(pg_uri, watch_streams_per_identity=PER_IDENTITY, watch_streams_per_tenant=PER_TENANT)


@pytest.fixture
def small(capped: tuple[ServerThread, Client]) -> World:
    """A world on a server with small stream caps, holding one stored event."""
    server, root = capped
    w = make_world(server.endpoint, root, server.conninfo)
    reserve(w)
    return w


def open_stream(client: Client, world: World, **request: Any) -> Stream:
    """A Watch stream that is open for sure: it has streamed the world's first stored event."""
    stream = Stream(client, tenant_id=world.tenant, **request)
    stream.take(1)
    return stream


def refused(client: Client, world: World) -> dict[str, str]:
    with Stream(client, tenant_id=world.tenant) as stream:
        with pytest.raises(grpc.RpcError) as exc:
            stream.take(1)
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
    assert details["resource"] == "watchStreams"
    return details


def reopens(client: Client, world: World, seconds: float = 10) -> Stream:
    """Open a stream as soon as a slot is free again (the positive signal that one was released)."""
    deadline = time.monotonic() + seconds
    while True:
        stream = Stream(client, tenant_id=world.tenant)
        try:
            stream.take(1)
            return stream
        except grpc.RpcError as exc:
            stream.call.cancel()
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
            time.sleep(0.05)


def test_watch_streams_are_capped_per_identity_and_per_tenant(small: World, capped: Any) -> None:
    server, root = capped
    assert small.user is not None
    mine = [open_stream(small.user, small) for _ in range(PER_IDENTITY)]
    details = refused(small.user, small)
    assert (details["scope"], details["limit"]) == ("identity", str(PER_IDENTITY))
    _, colleague = small.identity()
    theirs = [open_stream(colleague, small) for _ in range(PER_TENANT - PER_IDENTITY)]
    details = refused(colleague, small)  # under its own cap, but the tenant is full
    assert (details["scope"], details["limit"], details["tenantId"]) == ("tenant", str(PER_TENANT), small.tenant)
    other = make_world(server.endpoint, root, server.conninfo)  # another tenant is not affected
    reserve(other)
    with open_stream(other.user, other):
        pass
    # A stream that ends gives its slot back.
    mine.pop().call.cancel()
    reopens(small.user, small).call.cancel()
    for stream in mine + theirs:
        stream.call.cancel()


def test_a_slot_is_released_however_the_stream_ends(small: World) -> None:
    assert small.user is not None
    # A deadline.
    for _ in range(PER_IDENTITY):
        Stream(small.user, timeout=1.0, tenant_id=small.tenant).take(1)
    reopens(small.user, small).call.cancel()
    # A cancel while the server is streaming a backlog (suspended in a send, not in a wait).
    for _ in range(60):
        reserve(small)
    for _ in range(PER_IDENTITY * 2):
        with Stream(small.user, tenant_id=small.tenant) as stream:
            stream.take(1)
    reopens(small.user, small).call.cancel()
    # Refused by IAM after the slot was taken: more refusals than slots, then streams still open.
    small.policy('permit(principal, action == Action::"compute:reservations:create", resource);')
    for _ in range(PER_IDENTITY + 1):
        with Stream(small.user, tenant_id=small.tenant) as stream:
            with pytest.raises(grpc.RpcError) as exc:
                stream.take(1)
        assert rpc_error(exc)[1] == "ACCESS_DENIED"
    small.policy("permit(principal, action, resource);")
    streams = [open_stream(small.user, small) for _ in range(PER_IDENTITY)]
    for stream in streams:
        stream.call.cancel()


def test_a_revoked_token_ends_its_open_streams_and_frees_their_slots(small: World) -> None:
    ident, client = small.identity()
    streams = [open_stream(client, small) for _ in range(PER_IDENTITY)]
    small.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident))
    for stream in streams:
        with pytest.raises(grpc.RpcError) as exc:
            stream.take(1)
        code, reason, details = rpc_error(exc)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        assert "revoked" in exc.value.details()
    fresh = Client(small.endpoint, small.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident)).secret)
    try:
        reopens(fresh, small).call.cancel()
    finally:
        fresh.close()
        client.close()


def test_a_stream_ends_when_its_token_expires(small: World) -> None:
    ident, _ = small.identity()
    token = small.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="2s"))
    client = Client(small.endpoint, token.secret)
    try:
        stream = open_stream(client, small)
        with pytest.raises(grpc.RpcError) as exc:
            stream.take(1, timeout=30)
        code, reason, details = rpc_error(exc)
        assert (code, reason, details["tokenId"]) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", token.id)
        assert small.sql("SELECT epoch_ms(now())")[0][0] >= token.expires_at
    finally:
        client.close()


def test_the_safety_net_wakes_only_tenants_with_unseen_events(world: World, stack: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An event whose NOTIFY was lost still reaches its watcher; an idle watcher is never woken."""
    server, root = stack
    hub = server.app.hub
    quiet = make_world(server.endpoint, root, server.conninfo, nodes=0)
    with Stream(quiet.user, tenant_id=quiet.tenant) as idle, Stream(world.user, tenant_id=world.tenant) as busy:
        # Both subscribed (the watcher subscribes before its first read).
        _until(lambda: hub.subscriptions(quiet.tenant) and hub.subscriptions(world.tenant))
        [idle_sub] = hub.subscriptions(quiet.tenant)
        monkeypatch.setattr(event_hub, "POLL_SECONDS", 0.05)
        world.sql("SELECT pg_notify('bc_events', 'nobody')")  # ends the hub's current (long) wait
        runs = hub.safety_net_runs
        _until(lambda: hub.safety_net_runs >= runs + 5)
        wakes = idle_sub.wakes
        # An event committed without its notification, as if the NOTIFY were lost.
        world.sql("INSERT INTO events (tenant_id, type, subject, data) VALUES (%s, 'test.lost', 'test/lost', '{}')",
                  (world.tenant,))
        assert kinds(busy.take(1)) == [("test.lost", "test/lost")]
        runs = hub.safety_net_runs
        _until(lambda: hub.safety_net_runs >= runs + 5)
        assert idle_sub.wakes == wakes
        idle.quiet(0.1)


# A hub that nobody watches ------------------------------------------------------------------

BURST = 12


def idle_hub(world: World, stack: Any) -> event_hub.EventHub:
    """The module server's hub, once no stream of an earlier test is subscribed any more."""
    server, _ = stack
    hub = server.app.hub
    _until(lambda: hub.watching == 0)
    return hub


def heard(hub: event_hub.EventHub, since: int, count: int) -> None:
    """Until the hub has heard `count` more bc_events notifications (read or not)."""
    _until(lambda: hub.notifications >= since + count)


def test_an_idle_hub_takes_no_snapshot_and_a_watch_opened_later_gets_the_burst_then_new_events(
        world: World, stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = idle_hub(world, stack)
    monkeypatch.setattr(event_hub, "POLL_SECONDS", 3600.0)  # neither the net nor a tick can stand in
    snapshots, notifications = hub.snapshots, hub.notifications
    burst = [reserve(world) for _ in range(BURST)]
    heard(hub, notifications, BURST)  # each create committed and notified on its own
    assert hub.snapshots == snapshots and hub.stale
    # No notification comes after this: the subscriber itself gets the frontier computed.
    with Stream(world.user, tenant_id=world.tenant) as stream:
        got = stream.take(BURST)
        assert kinds(got) == [("reservation.placed", f"reservation/{r.id}") for r in burst]
        assert [e.id for e in got] == sorted({e.id for e in got})
        assert hub.snapshots > snapshots and not hub.stale
        r = reserve(world)
        assert kinds(stream.take(1)) == [("reservation.placed", f"reservation/{r.id}")]


def test_from_now_on_an_idle_hub_skips_what_committed_before_the_call(world: World, stack: Any) -> None:
    hub = idle_hub(world, stack)
    notifications = hub.notifications
    for _ in range(3):
        reserve(world)
    heard(hub, notifications, 3)
    assert hub.stale
    with Stream(world.user, tenant_id=world.tenant, from_now=True) as stream:
        _until(lambda: not hub.stale)
        r = reserve(world)
        assert kinds(stream.take(1)) == [("reservation.placed", f"reservation/{r.id}")]


def test_a_watch_opened_on_an_idle_hub_while_an_earlier_id_is_uncommitted_streams_it_first(
        world: World, stack: Any) -> None:
    hub = idle_hub(world, stack)
    notifications = hub.notifications
    slow = _begin_event(world, "test/slow")  # holds a smaller id, open across the Watch's start
    try:
        r = reserve(world)  # a larger id, committed first
        heard(hub, notifications, 1)
        assert hub.stale
        [(placed_id,)] = world.sql("SELECT id FROM events WHERE subject = %s", (f"reservation/{r.id}",))
        snapshots = hub.snapshots
        stream = Stream(world.user, tenant_id=world.tenant)
        _until(lambda: hub.snapshots > snapshots)
        assert hub.safe_id < placed_id  # the open writer holds the frontier back
    finally:
        slow.commit()
        slow.close()
    with stream:
        assert kinds(stream.take(2)) == [("test.late", "test/slow"), ("reservation.placed", f"reservation/{r.id}")]
        r2 = reserve(world)
        assert kinds(stream.take(1)) == [("reservation.placed", f"reservation/{r2.id}")]


def _until(check: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
