"""Leftovers of the hostile spot review, through the real API (real servers on loopback, real TLS,
the embedded PostgreSQL): start "earliest" counts preemptible spot work as free from the end of the
pool's notice, as its create then preempts it; a victim whose binding fails during its notice keeps
the notice; a create that waited for the pool lock still gets its whole lease."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.invariants import check_invariants
from tests.support import World, clock_now, get
from tests.test_capacity_preview import preview
from tests.test_hostile_spot import NOTICE_S, events_of, mk, node, spot_world

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
