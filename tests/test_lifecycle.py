"""Release, cancel, renew, extend (not yet served), list, and async-with-wait."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import structlog

from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World, rpc_error


def call(world: World, method: str, rid: str, client=None) -> pb.Reservation:
    request = getattr(pb, f"{method}ReservationRequest")(tenant_id=world.tenant, reservation_id=rid)
    return (client or world.user).res(method, request)


def bookings(world: World, rid: str) -> list[tuple]:
    return world.sql(
        "SELECT epoch_ms(lower(b.during)), epoch_ms(upper(b.during)) FROM bookings b"
        " JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = %s", (rid,))


def test_release_truncates_the_booking_at_compute_now_and_refunds(world: World) -> None:
    r = world.create(count=2, duration="8h")
    before = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    released = call(world, "Release", r.id)
    after = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    assert released.state == "released"
    assert before <= released.during.end <= after
    assert all(before <= end <= after for _, end in bookings(world, r.id))
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL",
                     (r.id,))[0][0] == 0
    assert [a.state for a in released.allocations] == ["released"]
    (data,) = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.released'",
                        (f"reservation/{r.id}",))[0]
    assert data == {"state": "released", "poolId": world.pool_id, "reason": "release"}


def test_release_deletes_future_bookings(world: World) -> None:
    now_ms = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    r = world.create(count=1, start=now_ms + 86_400_000)
    call(world, "Release", r.id)
    assert bookings(world, r.id) == []


def test_releasing_a_pending_reservation_cancels_it(world: World) -> None:
    r = world.create(count=8, model="none-such")
    assert r.state == "pending"
    out = call(world, "Release", r.id)
    assert out.state == "cancelled"
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL",
                     (r.id,))[0][0] == 0


def test_releasing_a_terminal_reservation_changes_nothing(world: World) -> None:
    r = world.create(count=1)
    first = call(world, "Release", r.id)
    again = call(world, "Release", r.id)
    assert again.state == "released" and again.version == first.version and again.during == first.during
    assert world.sql("SELECT count(*) FROM events WHERE subject = %s AND type = 'reservation.released'",
                     (f"reservation/{r.id}",))[0][0] == 1


def test_cancel_withdraws_pending_or_placed_and_refuses_anything_else(world: World) -> None:
    placed = world.create(count=1, start=world.later())
    assert call(world, "Cancel", placed.id).state == "cancelled"
    pending = world.create(count=8, model="none-such")
    assert call(world, "Cancel", pending.id).state == "cancelled"
    released = world.create(count=1)
    call(world, "Release", released.id)
    for rid in (released.id, placed.id):
        with pytest.raises(grpc.RpcError) as exc:
            call(world, "Cancel", rid)
        code, reason, details = rpc_error(exc)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
        assert details["reservationId"] == rid
    assert world.sql("SELECT count(*) FROM quota_charges WHERE refunded_at IS NULL AND tenant_id = %s",
                     (world.tenant,))[0][0] == 0


def test_renew_moves_the_lease_and_needs_lease_seconds(world: World) -> None:
    leased = world.create(count=1, lease_seconds=600)
    assert leased.HasField("lease_deadline")
    assert leased.lease_deadline - leased.during.start == pytest.approx(600_000, abs=2000)
    world.sql("UPDATE clock SET offset_ms = offset_ms + 60000")
    try:
        renewed = call(world, "Renew", leased.id)
        assert renewed.lease_deadline >= leased.lease_deadline + 59_000
        assert renewed.during == leased.during
    finally:
        world.sql("UPDATE clock SET offset_ms = offset_ms - 60000")
    plain = world.create(count=1)
    with pytest.raises(grpc.RpcError) as exc:
        call(world, "Renew", plain.id)
    assert rpc_error(exc)[1] == "INVALID_STATE"


def test_list_mine_by_default_all_on_request_newest_first_with_filters_and_paging(world: World) -> None:
    other_id, other = world.identity()
    mine = [world.create(count=1, start=world.later()) for _ in range(5)]
    theirs = world.create(other, count=1)
    call(world, "Release", mine[0].id)

    def ids(**kw) -> list[str]:
        return [r.id for r in world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, **kw)).items]

    assert ids() == [r.id for r in reversed(mine)]
    assert ids(scope="all")[0] == theirs.id and len(ids(scope="all")) == 6
    assert ids(states=["released"]) == [mine[0].id]
    assert ids(pool_id=world.pool_id, states=["placed"]) == [r.id for r in reversed(mine[1:])]
    page1 = world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, limit=2))
    assert [r.id for r in page1.items] == [mine[4].id, mine[3].id] and page1.next_cursor == mine[3].id
    page2 = ids(limit=2, cursor=page1.next_cursor)
    assert page2 == [mine[2].id, mine[1].id]
    assert ids(limit=2, cursor=page2[-1]) == [mine[0].id]
    for bad in ({"limit": 201}, {"scope": "everyone"}, {"states": ["draft"]}):
        with pytest.raises(grpc.RpcError) as exc:
            ids(**bad)
        assert rpc_error(exc)[1] == "INVALID_INPUT"


def _make_running(world: World, rid: str, running: bool) -> None:
    world.sql("UPDATE reservations SET operation_state = %s WHERE id = %s",
              ("running" if running else "succeeded", rid))


def test_wait_returns_at_once_with_the_inline_placer(world: World) -> None:
    started = time.monotonic()
    r = world.create(count=1, wait=pb.Wait(timeout_ms=20_000))
    assert r.state == "placed" and time.monotonic() - started < 5


def test_wait_timeout_is_not_an_error_and_returns_the_last_read(world: World) -> None:
    r = world.create(key="queued-op", count=1)
    _make_running(world, r.id, True)  # as if a pool-lease placer had it queued
    started = time.monotonic()
    again = world.create(key="queued-op", count=1, wait=pb.Wait(timeout_ms=1200))
    assert again.operation.state == "running"
    assert 1.1 <= time.monotonic() - started < 4


def test_wait_answers_as_soon_as_the_operation_stops_running(world: World) -> None:
    r = world.create(key="soon", count=1)
    _make_running(world, r.id, True)
    timer = threading.Timer(0.6, _make_running, (world, r.id, False))
    timer.start()
    started = time.monotonic()
    again = world.create(key="soon", count=1, wait=pb.Wait(timeout_ms=20_000))
    elapsed = time.monotonic() - started
    assert again.operation.state == "succeeded" and 0.5 <= elapsed < 3


def test_wait_is_capped_at_30_seconds(world: World, stack) -> None:
    from controlplane.reservations import validate

    raw = {"tenant_id": world.tenant, "pool_id": world.pool_id, "idempotency_key": "cap",
           "devices": [{"class": "gpu", "count": 1}], "duration": "1h", "wait_timeout_ms": 3_600_000}
    assert validate.validate_create(raw).wait_ms == 30_000


def test_a_client_that_goes_away_stops_the_wait(world: World) -> None:
    r = world.create(key="gone", count=1)
    _make_running(world, r.id, True)
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(grpc.RpcError) as exc:
            world.user.res("Create", world.create_request(key="gone", count=1, wait=pb.Wait(timeout_ms=20_000)),
                           timeout=0.7)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while not any(e.get("code") == "CANCELLED" for e in logs) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert any(e.get("event") == "rpc" and e.get("code") == "CANCELLED" for e in logs), logs
