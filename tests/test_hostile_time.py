"""A hostile tenant against time: starts, ends, leases, extend, renew and release at their
boundaries, and clock moves that skip several of a reservation's moments at once, through the real
gRPC API with the controllable clock (DESIGN.md sections 4, 7a and 10; spec "Start, lease, extend
and release", "Delegated confirmation", "Calendar reservations"). Each test here was an attack
that broke a promise before its fix, or pins a boundary the attacks found kept."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, advance_and_settle, settled
from tests.support import Client, ServerThread, World, get, gpus, invalid, make_world, refused
from tests.support import clock_now as now
from tests.test_hostile_input import unhandled  # noqa: F401  (a fixture: a world with no workers)
from tests.test_time import advance, eventually, state_is

SECOND, MIN, HOUR, DAY = 1000, 60_000, 3_600_000, 86_400_000


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def lock_waited(world: World, event: str, seconds: float = 30) -> None:
    """Until a backend waits for a lock of that kind (a positive signal that a step is held)."""
    deadline = time.monotonic() + seconds
    while world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND wait_event = %s", (event,)) == [(0,)]:
        assert time.monotonic() < deadline, f"nothing ever waited for a lock ({event})"
        time.sleep(0.02)


def poll_until(check, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def released_reasons(world: World, rid: str) -> list[str]:
    return [r for (r,) in world.sql("SELECT data->>'reason' FROM events WHERE subject = %s"
                                    " AND type = 'reservation.released' ORDER BY id", (f"reservation/{rid}",))]


def booked_until(world: World, rid: str) -> int | None:
    return world.sql("SELECT max(epoch_ms(upper(b.during))) FROM bookings b JOIN allocations a"
                     " ON a.id = b.allocation_id WHERE a.reservation_id = %s", (rid,))[0][0]


def used(world: World) -> int:
    return world.sql("SELECT coalesce(sum(amount), 0) FROM quota_charges WHERE tenant_id = %s"
                     " AND resource = 'gpu' AND refunded_at IS NULL", (world.tenant,))[0][0]


def renew(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Renew", pb.RenewReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def release(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=rid))


# Starts and durations at their bounds -----------------------------------------------------------

@pytest.mark.parametrize("ago", [1, HOUR, None])
def test_a_start_in_the_past_books_from_placement_for_the_full_duration(world: World, ago: int | None) -> None:
    before = now(world)
    start = 0 if ago is None else before - ago
    r = world.create(count=1, start=start, duration="2h")
    assert r.state in ("placed", "binding")
    assert r.during.start >= before and r.during.end - r.during.start == 2 * HOUR
    assert booked_until(world, r.id) == r.during.end


def test_a_start_at_the_horizon_is_taken_and_past_it_refused(world: World) -> None:
    details = invalid("start", world.create, start=now(world) + 365 * DAY + MIN)
    horizon = int(details["maxMs"])
    r = world.create(count=1, start=horizon, duration="1h")  # the horizon itself (time moved on since)
    assert r.state == "placed" and r.during.start == horizon


def test_durations_at_their_bounds(world: World) -> None:
    invalid("duration", world.create, duration="0ms")
    invalid("duration", world.create, duration_ms=366 * DAY + 1)
    longest = world.create(count=1, duration_ms=366 * DAY, start=world.later(1))
    assert longest.during.end - longest.during.start == 366 * DAY
    shortest = world.create(count=1, duration_ms=1)
    assert shortest.during.end - shortest.during.start == 1
    done = eventually(world, shortest.id, state_is("released"))
    assert released_reasons(world, shortest.id) == ["expired"] and done.during == shortest.during
    settled(world, shortest.id)
    check_invariants(world.conninfo, world.tenant)


# Moments the reconciler reaches late ------------------------------------------------------------

def test_a_lapse_the_reconciler_reaches_late_ends_the_window_at_the_lease_deadline(world: World) -> None:
    r = world.create(count=2, duration="8h", lease_seconds=60)
    active = SigningNodes(world).activate(r.id)
    deadline = active.lease_deadline
    advance_and_settle(world, r.id, 30 * MIN)  # one jump: the lapse is handled half an hour late
    done = get(world, r.id)
    assert done.state == "released" and released_reasons(world, r.id) == ["lease-lapsed"]
    # Billing runs [active, release): the release is the lapse, not the moment it was handled.
    assert done.during.end == deadline, (done.during.end - deadline)
    assert booked_until(world, r.id) == deadline
    assert used(world) == 0
    check_invariants(world.conninfo, world.tenant)


def test_a_lease_that_lapses_exactly_at_the_start_keeps_the_window(world: World) -> None:
    r = world.create(count=1, duration="1h", lease_seconds=60, start=world.later(1))
    # The test moves the deadline onto the start (a placement leaseSeconds before its start does it).
    world.sql("UPDATE reservations SET lease_deadline = lower(during) WHERE id = %s", (r.id,))
    advance_and_settle(world, r.id, HOUR + MIN)
    done = get(world, r.id)
    assert done.state == "released" and released_reasons(world, r.id) == ["lease-lapsed"]
    assert done.during == r.during  # never an empty window: it never began
    assert booked_until(world, r.id) is None and used(world) == 0
    check_invariants(world.conninfo, world.tenant)


def test_a_window_that_ended_before_its_lease_lapsed_is_expired_when_both_are_handled_at_once(
        world: World) -> None:
    r = world.create(count=1, duration="1h", lease_seconds=2 * 3600, start=world.later(1))
    assert r.during.end < r.lease_deadline
    advance_and_settle(world, r.id, 4 * HOUR)  # start - 15 min, start, end and lease deadline at once
    done = get(world, r.id)
    assert done.state == "released"
    assert released_reasons(world, r.id) == ["expired"]  # the end came first
    assert done.during == r.during and booked_until(world, r.id) == r.during.end
    check_invariants(world.conninfo, world.tenant)


def test_a_reservation_past_its_end_cannot_be_renewed(unhandled: World) -> None:
    w = unhandled
    r = w.create(count=1, duration="1h", lease_seconds=2 * 3600)
    advance(w, HOUR + SECOND)  # the window ended, the lease lives; the reconciler has not released it
    code, reason, details = refused(renew, w, r.id)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE"), details
    assert details["reason"] == "window-ended" and details["reservationId"] == r.id, details
    assert get(w, r.id).lease_deadline == r.lease_deadline
    check_invariants(w.conninfo, w.tenant)


@pytest.mark.parametrize("passed", ["lease-lapsed", "expired"])
def test_a_release_after_a_moment_that_passed_ends_it_as_that_moment(unhandled: World, passed: str) -> None:
    w = unhandled
    r = w.create(count=2, duration="1h", lease_seconds=60 if passed == "lease-lapsed" else 2 * 3600)
    ended_at = r.lease_deadline if passed == "lease-lapsed" else r.during.end
    advance(w, HOUR + 10 * MIN)  # passed; the reconciler has not released it yet
    done = release(w, r.id)
    assert done.state == "released" and released_reasons(w, r.id) == [passed]
    assert done.during.end == ended_at and booked_until(w, r.id) == ended_at
    assert used(w) == 0
    check_invariants(w.conninfo, w.tenant)


def cancel(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=rid))


@pytest.mark.parametrize("passed", ["started", "lease-lapsed"])
def test_a_placed_reservation_whose_start_or_lapse_passed_cannot_be_cancelled(unhandled: World, passed: str) -> None:
    w = unhandled
    lease = {"lease_seconds": 60} if passed == "lease-lapsed" else {}
    r = w.create(count=2, duration="2h", start=w.later(1), **lease)
    advance(w, HOUR + SECOND if passed == "started" else 2 * MIN)  # the reconciler has not been there yet
    code, reason, details = refused(cancel, w, r.id)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE"), details
    assert details["reason"] == passed and details["reservationId"] == r.id, details
    assert get(w, r.id).state == "placed" and used(w) == 2
    check_invariants(w.conninfo, w.tenant)


@pytest.fixture
def metered(pg_uri: str) -> Iterator[World]:
    """A control plane of the test's own that moves the clock and meters every 0.2 s, each hour as
    soon as it has ended."""
    stack = module_stack(pg_uri, clock_control=True, metering_seconds=0.2, metering_settle_seconds=0)
    server, root = next(stack)
    w = make_world(server.endpoint, root, server.conninfo)
    try:
        yield w
    finally:
        w.close()
        stack.close()


def gpu_hours(world: World, rid: str) -> float:
    return world.sql("SELECT coalesce(sum(quantity), 0)::float8 FROM usage_records WHERE meter = 'gpu.hours'"
                     " AND subject = %s", (f"reservation/{rid}",))[0][0]


def test_hours_metered_before_a_late_lapse_is_handled_stop_at_the_lease_deadline(metered: World) -> None:
    """The meter bills hours that have ended; a lapse the reconciler has not reached yet (a backlog,
    here a row the test holds) must not let it bill the hours after the lease deadline."""
    w = metered
    r = w.create(count=2, duration="8h", lease_seconds=60)
    active = SigningNodes(w).activate(r.id)
    activated = w.sql("SELECT epoch_ms(time) FROM events WHERE subject = %s AND type = 'reservation.active'",
                      (f"reservation/{r.id}",))[0][0]
    deadline = active.lease_deadline
    with psycopg.connect(w.conninfo) as holder:
        holder.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (r.id,))
        advance(w, 3 * HOUR)
        lock_waited(w, "transactionid")  # the reconciler waits for the row
        metered_past = deadline - deadline % HOUR + 3 * HOUR
        poll_until(lambda: w.sql("SELECT metered_until >= from_epoch_ms(%s) FROM metering_progress"
                                 " WHERE source = 'gpu'", (metered_past,)) == [(True,)])
        holder.rollback()
    assert eventually(w, r.id, state_is("released")).during.end == deadline
    assert gpu_hours(w, r.id) == pytest.approx(2 * (deadline - activated) / HOUR, abs=2e-5)
    check_invariants(w.conninfo, w.tenant)


# Confirmation deadlines ---------------------------------------------------------------------------

AGENT_POLICY = "permit(principal, action, resource) unless { context.delegated };"


@pytest.mark.parametrize("placer", ["inline", "lease"])
def test_an_approved_retry_whose_deadline_passes_while_it_waits_to_place_is_expired(unhandled: World,
                                                                                  placer: str) -> None:
    """The approval is for a retry before the deadline; one whose placement comes after it (its
    transaction 2 waited) must end as the reconciler would have ended it: expired, never placed."""
    w = unhandled
    w.policy(AGENT_POLICY)
    _, agent = w.identity(kind="agent", person_identity_id=w.user_id,
                          confirm_actions=["compute:reservations:create"])
    pool_id = w.pool_id
    if placer == "lease":
        pool_id = w.root.admin("CreatePool", apb.CreatePoolRequest(
            owner_tenant_id=w.tenant, name="leased", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
        w.root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=pool_id, name=f"leased-{w.tenant}",
                                                            gpus=gpus(f"leased-{w.tenant}")))
    request = w.create_request(count=1, pool_id=pool_id)
    code, reason, details = refused(agent.res, "Create", request)
    assert reason == "CONFIRMATION_REQUIRED", details
    w.user.conf("Approve", pb.DecideConfirmationRequest(tenant_id=w.tenant, confirmation_id=details["confirmationId"]))
    rid, deadline = details["reservationId"], int(details["expiresAt"])
    with ThreadPoolExecutor(1) as pool, psycopg.connect(w.conninfo) as holder:
        holder.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (rid,))
        retry = pool.submit(agent.res, "Create", request)
        lock_waited(w, "transactionid")  # its transaction 2 waits for the row the test holds
        advance(w, deadline - now(w) + SECOND)
        holder.commit()
    late = retry.result(timeout=30)
    assert (late.id, late.state) == (rid, "expired")
    assert w.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (rid,)) == [(0,)]
    assert w.sql("SELECT state FROM confirmations WHERE id = %s", (details["confirmationId"],)) == [("expired",)]
    assert used(w) == 0
    check_invariants(w.conninfo, w.tenant)


def test_a_request_whose_confirmation_deadline_passed_is_expired_not_cancelled_by_a_release(unhandled: World) -> None:
    """After the deadline the request is expired (by the reconciler, or whoever meets it first):
    a release (here by the person) that finds it past the deadline does not make it cancelled."""
    w = unhandled
    w.policy(AGENT_POLICY)
    _, agent = w.identity(kind="agent", person_identity_id=w.user_id,
                          confirm_actions=["compute:reservations:create"])
    code, reason, details = refused(agent.res, "Create", w.create_request(count=1))
    assert reason == "CONFIRMATION_REQUIRED", details
    rid, deadline = details["reservationId"], int(details["expiresAt"])
    advance(w, deadline - now(w) + SECOND)  # the reconciler has not been there yet
    assert release(w, rid).state == "expired"
    assert w.sql("SELECT data->>'reason' FROM events WHERE subject = %s AND type = 'reservation.expired'",
                 (f"reservation/{rid}",)) == [("confirmation-expired",)]
    assert w.sql("SELECT state FROM confirmations WHERE reservation_id = %s", (rid,)) == [("expired",)]
    assert not w.sql("SELECT 1 FROM events WHERE subject = %s AND type = 'reservation.cancelled'",
                     (f"reservation/{rid}",))
    check_invariants(w.conninfo, w.tenant)
