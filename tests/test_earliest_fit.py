"""Earliest fit (issue 11): capacity.preview with start_earliest answers the earliest start within
the horizon at which the whole request (a gang too) fits, and create with start "earliest" books
exactly that window; a retry with the same key returns the same reservation."""

from __future__ import annotations

import grpc
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World, rpc_error
from tests.test_capacity_preview import preview

HOUR = 3_600_000


def end_of(world: World, rid: str) -> int:
    return world.sql("SELECT max(epoch_ms(upper(b.during))) FROM bookings b JOIN allocations a "
                     "ON a.id = b.allocation_id WHERE a.reservation_id = %s", (rid,))[0][0]


def window_of(world: World, rid: str) -> tuple[int, int]:
    return world.sql("SELECT min(epoch_ms(lower(b.during))), max(epoch_ms(upper(b.during))) FROM bookings b "
                     "JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = %s", (rid,))[0]


@pytest.fixture
def busy(world: World) -> dict[str, int]:
    """Node X busy now to +1h and from +1.5h to +3h; node Y busy now to +3h."""
    x = world.create(count=8, duration="1h")
    y = world.create(count=8, duration="3h")
    later = world.create(count=8, start=end_of(world, x.id) + HOUR // 2, duration="90m")
    assert {x.state, y.state, later.state} <= {"placed", "binding", "bound", "active"}
    return {"x_end": end_of(world, x.id), "y_end": end_of(world, y.id), "later_end": end_of(world, later.id)}


def test_preview_answers_the_earliest_start_between_bookings(world: World, busy: dict[str, int]) -> None:
    out = preview(world, count=8, duration="30m", start_earliest=True)
    assert out.fits and out.start == busy["x_end"] and out.end == busy["x_end"] + HOUR // 2
    out = preview(world, count=8, duration="1h", start_earliest=True)  # not between X's bookings
    assert out.fits and out.start == min(busy["y_end"], busy["later_end"])
    out = preview(world, count=8, duration="1h", gang=pb.Gang(size=2), start_earliest=True)
    assert out.fits and out.start == max(busy["y_end"], busy["later_end"]) and len(out.members) == 2


def test_create_earliest_books_that_window_and_a_retry_returns_it(world: World, busy: dict[str, int]) -> None:
    seen = preview(world, count=8, duration="30m", start_earliest=True)
    r = world.create(key="soonest", count=8, duration="30m", start_earliest=True)
    assert r.state == "placed" and r.request.start_earliest and r.request.start == seen.start
    assert r.request.horizon_ms == 14 * 24 * HOUR
    assert window_of(world, r.id) == (seen.start, seen.start + HOUR // 2)
    again = world.create(key="soonest", count=8, duration="30m", start_earliest=True)
    assert (again.id, again.request.start) == (r.id, r.request.start)
    # The next one goes after it: the same gap is taken.
    nxt = preview(world, count=8, duration="30m", start_earliest=True)
    assert nxt.start > seen.start


def test_nothing_within_the_horizon(world: World, busy: dict[str, int]) -> None:
    out = preview(world, count=8, duration="1h", start_earliest=True, horizon_ms=HOUR)
    assert not out.fits and out.reason.startswith("nothing fits within the horizon")
    r = world.create(count=8, duration="1h", start_earliest=True, horizon_ms=HOUR)
    assert r.state == "pending" and not r.request.HasField("start")
    assert any(c.type == "Unschedulable" for c in r.conditions)


@pytest.mark.parametrize("kw, field", [
    ({"start_earliest": True, "horizon_ms": 61 * 24 * HOUR}, "horizonMs"),
    ({"start_earliest": True, "horizon_ms": 0}, "horizonMs"),
    ({"horizon_ms": HOUR}, "horizonMs"),
    ({"start_earliest": True, "start": 1}, "start"),
])
def test_earliest_input_is_checked(world: World, kw: dict, field: str) -> None:
    for call in (lambda: preview(world, **kw), lambda: world.create(**kw)):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert rpc_error(exc)[1] == "INVALID_INPUT" and rpc_error(exc)[2]["field"] == field
