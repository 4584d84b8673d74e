"""Leftovers of the hostile spot review, through the real API (real servers on loopback, real TLS,
the embedded PostgreSQL): start "earliest" counts preemptible spot work as free from the end of the
pool's notice, as its create then preempts it; a victim whose binding fails during its notice keeps
the notice; a create that waited for the pool lock still gets its whole lease."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from bettercompute.v1 import reservations_pb2 as pb
from tests.invariants import check_invariants
from tests.support import World, clock_now, eventually, get
from tests.test_capacity_preview import preview
from tests.promise_support import pool_locked
from tests.test_hostile_spot import NOTICE_S, advance, events_of, mk, node, spot_world, waiting_for_a_lock

HOUR = 3_600_000


@pytest.fixture
def bare(stack) -> Iterator[World]:
    server, root = stack
    w = spot_world(server, root)
    yield w
    w.close()


def booked_end(world: World, rid: str) -> int:
    return world.sql("SELECT max(epoch_ms(upper(b.during))) FROM bookings b JOIN allocations a "
                     "ON a.id = b.allocation_id WHERE a.reservation_id = %s", (rid,))[0][0]


# -- Start "earliest" over spot work -----------------------------------------------------------


def test_earliest_start_takes_spot_work_from_the_end_of_the_notice(bare: World) -> None:
    """One node runs 8 h of spot work, the other a regular booking of 3 h: a regular request with
    start "earliest" used to be given the regular booking's end (or the spot's, with no other node)
    though its create preempts spot work; it starts at the notice's end, on the spot's node, and
    preview answers the same. A spot request still waits for the spot work's end."""
    w = bare
    node(w)
    node(w)
    spot = mk(w, count=8, spot=True, duration="8h")
    (spot_node,) = [a.node_id for a in spot.allocations]
    regular = mk(w, count=8, duration="3h")
    spot_end, regular_end = booked_end(w, spot.id), booked_end(w, regular.id)

    as_spot = preview(w, count=8, duration="1h", spot=True, start_earliest=True)
    assert as_spot.fits and as_spot.start == min(spot_end, regular_end)

    before = clock_now(w)
    seen = preview(w, count=8, duration="1h", start_earliest=True)
    assert seen.fits and [m.node_id for m in seen.members] == [spot_node]
    assert before + NOTICE_S * 1000 <= seen.start < before + HOUR, (seen.start, before)
    assert seen.end == seen.start + HOUR

    before = clock_now(w)
    r = w.create(count=8, duration="1h", start_earliest=True)
    assert r.state == "placed" and r.request.start_earliest
    assert before + NOTICE_S * 1000 <= r.during.start < before + HOUR, (r.during.start, before)
    assert [a.node_id for a in r.allocations] == [spot_node]
    (notice,) = events_of(w, spot.id, "reservation.preempting")
    assert notice["noticeUntil"] == r.during.start
    assert get(w, spot.id).during.end == r.during.start == booked_end(w, spot.id)
    assert booked_end(w, regular.id) == regular_end  # a regular booking is never taken
    check_invariants(w.conninfo, w.tenant)


def test_earliest_start_takes_spot_work_that_has_not_begun(bare: World) -> None:
    """Spot work booked from in an hour for 8 h used to hold a 2 h regular request with start
    "earliest" off until its end: it starts at the notice's end, and the spot reservation, which
    would begin after it, goes back to pending as for any preemptor."""
    w = bare
    node(w)
    spot = mk(w, count=8, spot=True, duration="8h", start=w.later(1))
    before = clock_now(w)
    seen = preview(w, count=8, duration="2h", start_earliest=True)
    assert seen.fits and before + NOTICE_S * 1000 <= seen.start < before + HOUR
    r = w.create(count=8, duration="2h", start_earliest=True)
    assert r.state == "placed" and before + NOTICE_S * 1000 <= r.during.start < before + HOUR
    taken = get(w, spot.id)
    assert taken.state == "pending" and any(c.reason == "Preempted" for c in taken.conditions)
    check_invariants(w.conninfo, w.tenant)


# -- A victim whose binding fails during its notice --------------------------------------------


LONG_NOTICE_S = 600  # longer than the bind timeout (5 min): the victim's binding fails within it


@pytest.fixture
def clocked_long(clock_stack) -> Iterator[World]:
    """A pool of its own control plane whose clock the test moves, with a notice of 10 minutes."""
    server, root = clock_stack
    w = spot_world(server, root, notice_s=LONG_NOTICE_S)
    yield w
    w.close()


def preempted_spot(w: World) -> tuple[pb.Reservation, int]:
    """Spot work on the pool's one node, preempted by a regular reservation: (the spot, its cut).
    No node daemon reports a binding here, so the spot's binding times out within the notice."""
    node(w)
    spot = mk(w, count=8, spot=True, duration="8h")
    preemptor = mk(w, count=8, duration="1h")
    cut = get(w, spot.id).during.end
    assert preemptor.state == "placed" and preemptor.during.start == cut
    return spot, cut


def notice_of(r: pb.Reservation) -> pb.Condition | None:
    return next((c for c in r.conditions if c.type == "Preempting"), None)


def test_a_victim_placed_again_after_its_binding_failed_keeps_its_notice(clocked_long: World) -> None:
    """Binding failed for a spot reservation under notice, and it was placed again on another node:
    it used to lose its Preempting condition and end at the cut as expired. It keeps the notice
    and its cut, and ends there preempted."""
    w = clocked_long
    spot, cut = preempted_spot(w)
    other = node(w)
    advance(w, 6 * 60_000)  # past the spot's bind deadline, within its notice
    again = eventually(w, spot.id, lambda r: any(a.node_id == other for a in r.allocations), seconds=30)
    assert again.state in ("placed", "binding") and again.during.end == cut == booked_end(w, spot.id)
    held = notice_of(again)
    assert held is not None and held.reason == "Preempted"
    advance(w, cut - clock_now(w) + 1_000)  # past the cut, before the second bind deadline
    ended = eventually(w, spot.id, lambda r: r.state == "released", seconds=30)
    assert ended.during.end == cut
    assert [e["reason"] for e in events_of(w, spot.id, "reservation.released")] == ["preempted"]
    (preempted,) = events_of(w, spot.id, "reservation.preempted")
    assert preempted["noticeUntil"] == cut
    check_invariants(w.conninfo, w.tenant)


def test_a_victim_with_nowhere_to_go_after_its_binding_failed_ends_preempted(clocked_long: World) -> None:
    """Binding failed for a spot reservation under notice and no node has room for the rest of
    it: it used to go pending without its notice, to be placed later for its whole length (the
    time its preemptor took). It ends at once, preempted, its quota refunded."""
    w = clocked_long
    spot, cut = preempted_spot(w)
    advance(w, 6 * 60_000)  # past the spot's bind deadline, within its notice
    ended = eventually(w, spot.id, lambda r: r.state not in ("placed", "binding"), seconds=30)
    assert ended.state == "released", ended
    assert ended.during.end < cut and not booked_end(w, spot.id) > ended.during.end
    assert [e["reason"] for e in events_of(w, spot.id, "reservation.released")] == ["preempted"]
    (preempted,) = events_of(w, spot.id, "reservation.preempted")
    assert preempted["noticeUntil"] == cut
    assert not w.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL", (spot.id,))[0][0]
    check_invariants(w.conninfo, w.tenant)


# -- The lease of a create that waited for the pool lock ----------------------------------------


LEASE_S = 600


@pytest.fixture
def clocked(clock_stack) -> Iterator[World]:
    """A pool of its own control plane whose clock the test moves (the default test notice)."""
    server, root = clock_stack
    w = spot_world(server, root)
    yield w
    w.close()


def placed_after_waiting(w: World, **kw) -> tuple[pb.Reservation, int]:
    """A create with a lease whose transaction 2 waited for the pool lock while the clock moved on
    two minutes: (the reservation, the clock when the lock was let go, before its placement)."""
    with ThreadPoolExecutor(1) as pool, pool_locked(w):
        pending = pool.submit(w.create, count=8, duration="1h", lease_seconds=LEASE_S, **kw)
        waiting_for_a_lock(w)
        advance(w, 120_000)
        placed_from = clock_now(w)
    r = pending.result(timeout=30)
    assert r.state == "placed"
    return r, placed_from


@pytest.mark.parametrize("how", ["inline", "preemptor", "gang"])
def test_a_create_that_waited_for_the_pool_lock_gets_its_whole_lease(clocked: World, how: str) -> None:
    """The lease runs out leaseSeconds after placement: a create (the common one-statement create,
    one that preempts spot work, a gang) whose placement waited for the pool lock used to count it
    from its first transaction's clock, so its lease was short by the wait. Its reconciler wake-up
    is at the deadline."""
    w = clocked
    node(w)
    if how == "preemptor":
        mk(w, count=8, spot=True, duration="8h")
    if how == "gang":
        node(w)
    r, placed_from = placed_after_waiting(w, **({"gang": pb.Gang(size=2)} if how == "gang" else {}))
    assert r.lease_deadline >= placed_from + LEASE_S * 1000, (r.lease_deadline - placed_from)
    assert w.sql("SELECT count(*) FROM work_items WHERE subject = %s AND epoch_ms(run_at) = %s",
                 (r.id, r.lease_deadline))[0][0] == 1
    check_invariants(w.conninfo, w.tenant)
