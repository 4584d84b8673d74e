"""Events.Watch: stored then live events, filters, resumption without gaps or repeats, an id
committed late, tenancy and IAM. Events come from real reservation calls."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import Client, World, make_world, rpc_error


class Stream:
    """One Watch call, read by a background thread into a queue."""

    def __init__(self, client: Client, **request: Any) -> None:
        stub = events_pb2_grpc.EventsStub(client.channel)
        self.call = stub.Watch(epb.WatchRequest(**request), metadata=client.metadata, timeout=60)
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
