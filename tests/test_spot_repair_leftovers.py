"""Leftovers of spot and preemption around BookingRepair and a victim's end, through the real API
(real servers on loopback, real TLS, the embedded PostgreSQL): a victim that BookingRepair leaves
pending keeps its notice, so no later placement books past the cut its preemptor owns, and a
preemptor withdrawn meanwhile gives it its window back; a victim's end takes its notices with it;
a tenant under notice cannot keep its GPUs past the cut; an end that takes notices keeps the lock
order (the pool lock before the reservation's row)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import pool_locked
from tests.support import World, clock_now, eventually, get
from tests.test_hostile_spot import (  # noqa: F401 - long_notice is a fixture
    advance, booking_ends, end_it, events_of, long_notice, mk, node, spot_world,
)

MIN = 60_000


@pytest.fixture
def clocked(pg_uri: str) -> Iterator[World]:
    """A spot pool of its own control plane (and database) whose clock the test moves (notice:
    2 s). Pending reservations retry only when woken (an hour between timed retries): what ends
    or places one is the change the test makes, not the safety net."""
    for server, root in module_stack(pg_uri, clock_control=True, pending_retry_seconds=3600):
        w = spot_world(server, root)
        yield w
        w.close()


def notices(world: World, rid: str) -> list[tuple[str, str, int, int]]:
    """The preemption_notices rows `rid` gave or is under: (victim, preemptor, cut, until)."""
    return world.sql("SELECT victim_id, preemptor_id, epoch_ms(cut), epoch_ms(until) FROM preemption_notices"
                     " WHERE victim_id = %s OR preemptor_id = %s ORDER BY 1, 2", (rid, rid))


def preempting(r: pb.Reservation) -> pb.Condition | None:
    return next((c for c in r.conditions if c.type == "Preempting"), None)


def charged(world: World, rid: str) -> int:
    return world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL"
                     " AND resource = 'gpu'", (rid,))[0][0]


def ready_node(w: World) -> str:
    """A new node, made ready: that wakes the pool's pending retry (registering alone does not)."""
    new = node(w)
    w.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=new, state="ready"))
    return new


def repaired_to_pending(w: World) -> tuple[pb.Reservation, pb.Reservation, str]:
    """Spot work booked from in 30 minutes for 8 h on the pool's one node, cut at 2 h by a calendar
    preemptor there; the node is cordoned and BookingRepair, 15 minutes before the spot's start,
    finds no room: (the spot as booked, the preemptor, the cordoned node)."""
    first = node(w)
    spot = mk(w, count=8, spot=True, start=w.later(0.5), duration="8h")
    preemptor = mk(w, count=8, start=w.later(2), duration="1h")
    cut = preemptor.during.start
    assert get(w, spot.id).during.end == cut and booking_ends(w, spot.id) == {cut}
    w.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=first, state="cordoned"))
    advance(w, 16 * MIN)  # past the spot's repair check (start - 15 min), long before the cut
    pending = eventually(w, spot.id, lambda r: r.state == "pending", seconds=30)
    assert [c.reason for c in pending.conditions if c.type == "Unschedulable"] == ["BookingRepairFailed"]
    return spot, preemptor, first


# -- A victim that BookingRepair leaves pending --------------------------------------------------


def test_a_victim_repaired_to_pending_keeps_its_notice_and_is_placed_again_only_to_the_cut(clocked: World) -> None:
    """It used to go pending without its notice (its condition and its notice's row) and be placed
    again for the request's whole length: 6 h past the cut, the time its preemptor took. It keeps
    both; the retry books its window to the cut, keeping the notice; withdrawn then, the preemptor
    gives it the rest of its window on the new node."""
    w = clocked
    spot, preemptor, _ = repaired_to_pending(w)
    cut = preemptor.during.start
    pending = get(w, spot.id)
    held = preempting(pending)
    assert held is not None and held.reason == "Preempted" and pending.during.end == cut
    assert notices(w, spot.id) == [(spot.id, preemptor.id, cut, spot.during.end)]
    other = ready_node(w)
    again = eventually(w, spot.id, lambda r: r.state == "placed", seconds=30)
    assert [a.node_id for a in again.allocations if a.state == "placed"] == [other]
    assert (again.during.start, again.during.end) == (spot.during.start, cut)
    assert booking_ends(w, spot.id) == {cut}
    assert preempting(again) is not None
    (placed,) = [e for e in events_of(w, spot.id, "reservation.placed") if e["nodeIds"] == [other]]
    assert placed["end"] == cut
    end_it(w, "cancel", preemptor.id)  # the preemptor goes away: the victim gets its time back
    back = get(w, spot.id)
    assert back.during.end == spot.during.end and booking_ends(w, spot.id) == {spot.during.end}
    assert preempting(back) is None and notices(w, spot.id) == []
    assert [(e["from"], e["to"]) for e in events_of(w, spot.id, "reservation.extended")] == [(cut, spot.during.end)]
    check_invariants(w.conninfo, w.tenant)


def test_a_pending_victim_whose_preemptor_goes_away_gets_its_window_back(clocked: World) -> None:
    """The preemptor is cancelled while its victim waits pending after BookingRepair: the victim
    used to stay cut (had it kept its notice); it gets its window back, no longer under notice,
    and is placed for all of it."""
    w = clocked
    spot, preemptor, _ = repaired_to_pending(w)
    cut = preemptor.during.start
    end_it(w, "cancel", preemptor.id)
    back = get(w, spot.id)
    assert back.state == "pending" and back.during.end == spot.during.end and preempting(back) is None
    assert [c.reason for c in back.conditions] == ["BookingRepairFailed"]
    assert [(e["from"], e["to"]) for e in events_of(w, spot.id, "reservation.extended")] == [(cut, spot.during.end)]
    assert notices(w, spot.id) == []
    ready_node(w)
    again = eventually(w, spot.id, lambda r: r.state == "placed", seconds=30)
    assert again.during == spot.during and booking_ends(w, spot.id) == {spot.during.end}
    check_invariants(w.conninfo, w.tenant)


def assert_ended_preempted_at(w: World, spot_id: str, cut: int) -> None:
    """The victim ended as a booked victim does at the cut: released, reason preempted, its notice
    ending at the cut, no booking left, quota refunded, its notice's row gone."""
    ended = eventually(w, spot_id, lambda r: r.state == "released", seconds=30)
    assert [e["reason"] for e in events_of(w, spot_id, "reservation.released")] == ["preempted"]
    (preempted,) = events_of(w, spot_id, "reservation.preempted")
    assert preempted["noticeUntil"] == cut
    assert ended.during.end == cut and not booking_ends(w, spot_id)
    assert charged(w, spot_id) == 0 and notices(w, spot_id) == []
    check_invariants(w.conninfo, w.tenant)


@pytest.mark.parametrize("by", ["reconciler", "retry"])
def test_a_pending_victim_whose_notice_ends_is_released_preempted(clocked: World, by: str) -> None:
    """Nothing had room for the victim before its cut: once the notice's end comes there is
    nothing of its window left, so it ends as a booked victim does at the cut (released, reason
    preempted, quota refunded, its notice's row gone): woken at the cut, or by a retry that finds
    room after it (its wake-up lost), which must not place it for the request's whole length."""
    w = clocked
    spot, preemptor, _ = repaired_to_pending(w)
    cut = preemptor.during.start
    # Only one way to end it each time: the victim's wake-ups gone (lost), or the preemptor's (its
    # own repair on the cordoned node would wake the pending retry).
    w.sql("DELETE FROM work_items WHERE subject = %s", (spot.id if by == "retry" else preemptor.id,))
    advance(w, cut - clock_now(w) + 1_000)
    if by == "retry":
        ready_node(w)
    assert_ended_preempted_at(w, spot.id, cut)


# -- A victim's end takes its notices -------------------------------------------------------------


@pytest.mark.parametrize("how", ["release", "cancel"])
def test_a_victim_that_ends_during_its_notice_takes_its_notice_with_it(long_notice: World, how: str) -> None:
    """A victim released (running) or cancelled (not begun) before its cut left its notice's row
    behind, read by every later end of its preemptor. The row goes with the victim's end; the
    preemptor's later withdrawal gives nothing back to it, and a later preemption records its own."""
    w = long_notice
    node(w)
    start = {"start": w.later(0.5)} if how == "cancel" else {}
    spot = mk(w, count=8, spot=True, duration="8h", **start)
    preemptor = mk(w, count=8, duration="1h", start=w.later(2))
    assert notices(w, spot.id) == [(spot.id, preemptor.id, preemptor.during.start, spot.during.end)]
    end_it(w, how, spot.id)
    assert notices(w, spot.id) == [] and notices(w, preemptor.id) == []
    end_it(w, "cancel", preemptor.id)
    assert not events_of(w, spot.id, "reservation.extended")
    second = mk(w, count=8, spot=True, duration="8h")
    third = mk(w, count=8, duration="1h")
    assert third.state == "placed"
    assert notices(w, third.id) == [(second.id, third.id, third.during.start, second.during.end)]
    check_invariants(w.conninfo, w.tenant)


def test_a_victim_whose_lease_lapses_during_its_notice_takes_its_notice_with_it(clock_stack) -> None:
    """The reconciler's end (here a lapsed lease) takes the victim's notices too, under the pool
    lock."""
    server, root = clock_stack
    w = spot_world(server, root, notice_s=600)
    try:
        node(w)
        spot = mk(w, count=8, spot=True, duration="8h", lease_seconds=60)
        preemptor = mk(w, count=8, duration="1h")
        assert notices(w, spot.id) and preemptor.state == "placed"
        advance(w, 61_000)
        eventually(w, spot.id, lambda r: r.state == "released", seconds=30)
        assert [e["reason"] for e in events_of(w, spot.id, "reservation.released")] == ["lease-lapsed"]
        assert notices(w, spot.id) == []
        check_invariants(w.conninfo, w.tenant)
    finally:
        w.close()


# -- A tenant under notice --------------------------------------------------------------------------


def test_a_victim_cannot_keep_its_gpus_past_the_cut_by_extending_or_renewing(clocked: World) -> None:
    """The spot tenant extends and renews during its notice: the extend is refused at the cut
    (extended: false, availableUntil the cut), the renew moves only its lease, and at the cut it
    is released, preempted, all the same."""
    w = clocked
    node(w)
    spot = mk(w, count=8, spot=True, duration="8h", lease_seconds=3600)
    preemptor = mk(w, count=8, duration="1h", start=w.later(1))
    cut = preemptor.during.start
    got = w.user.res("Extend", pb.ExtendReservationRequest(tenant_id=w.tenant, reservation_id=spot.id,
                                                           idempotency_key="keep-it", until=spot.during.end))
    assert not got.extended and got.available_until == cut
    renewed = w.user.res("Renew", pb.RenewReservationRequest(tenant_id=w.tenant, reservation_id=spot.id))
    assert renewed.lease_deadline > cut > clock_now(w) and renewed.during.end == cut
    assert booking_ends(w, spot.id) == {cut} and preempting(get(w, spot.id)) is not None
    advance(w, cut - clock_now(w) + 1_000)
    eventually(w, spot.id, lambda r: r.state == "released", seconds=30)
    assert [e["reason"] for e in events_of(w, spot.id, "reservation.released")] == ["preempted"]
    assert get(w, preemptor.id).during.start == cut
    check_invariants(w.conninfo, w.tenant)


# -- The lock order of an end that takes notices ---------------------------------------------------


def waiting_for_the_pool_lock(world: World) -> None:
    """Until a session of the world's database waits for an advisory lock (the pool lock)."""
    deadline = time.monotonic() + 30
    while not world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND wait_event = 'advisory' AND datname = current_database()")[0][0]:
        assert time.monotonic() < deadline, "nothing queued behind the pool lock"
        time.sleep(0.02)


def row_locked(world: World, rid: str) -> bool:
    """Whether another transaction holds `rid`'s row lock."""
    with psycopg.connect(world.conninfo, autocommit=True) as conn:
        try:
            conn.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE NOWAIT", (rid,))
        except psycopg.errors.LockNotAvailable:
            return True
    return False


def test_a_preemptor_whose_lease_lapses_waits_for_the_pool_lock_before_its_row(clock_stack) -> None:
    """The reconciler released a preemptor whose lease lapsed holding its row, then took the pool
    lock to give its victim the time back: the other way round from capacity's lock order (an
    extend of it, which takes the pool lock and then the row, deadlocked with it). It takes the
    pool lock first now."""
    server, root = clock_stack
    w = spot_world(server, root, notice_s=300)
    try:
        node(w)
        spot = mk(w, count=8, spot=True, duration="8h")
        preemptor = mk(w, count=8, duration="1h", lease_seconds=60)
        with pool_locked(w):
            advance(w, 61_000)
            waiting_for_the_pool_lock(w)  # the reconciler's pass, behind the pool lock
            assert not row_locked(w, preemptor.id)
        eventually(w, preemptor.id, lambda r: r.state == "released", seconds=30)
        assert get(w, spot.id).during == spot.during
        check_invariants(w.conninfo, w.tenant)
    finally:
        w.close()


def test_a_retry_that_waited_past_the_cut_ends_the_victim_instead_of_placing_it(clocked: World) -> None:
    """A pending retry read the clock before the victim's cut, then waited for the victim's row
    while the cut came. It planned the window again at the clock it read under the locks, which past
    the cut is the request's whole length (the window is capped at the cut only when it begins
    before it): the victim was placed for 8 h on a free node, and later preempted again with its
    notice ending at that moment (a CI run saw noticeUntil 4 s after the cut). It checks the notice
    again at that clock and ends the victim, preempted at the cut."""
    w = clocked
    spot, preemptor, _ = repaired_to_pending(w)
    cut = preemptor.during.start
    w.sql("DELETE FROM work_items WHERE subject = %s", (spot.id,))  # nothing but the retry ends it
    readied: list[BaseException | str] = []

    def make_room() -> None:  # may wait for the pool lock the retry holds while it waits for the row
        try:
            readied.append(ready_node(w))
        except BaseException as exc:  # noqa: BLE001 - reported below
            readied.append(exc)

    with psycopg.connect(w.conninfo) as holder, holder.transaction():
        holder.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (spot.id,))
        room = threading.Thread(target=make_room, daemon=True)
        room.start()  # wakes the retry: it reads the clock (before the cut), plans, waits for the row
        deadline = time.monotonic() + 30
        while w.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE %s", ("%FOR UPDATE%",)) == [(0,)]:
            assert time.monotonic() < deadline, "the retry never waited for the victim's row"
            time.sleep(0.02)
        advance(w, cut - clock_now(w) + 1_000)
    room.join(60)
    assert len(readied) == 1 and isinstance(readied[0], str), readied
    assert_ended_preempted_at(w, spot.id, cut)
