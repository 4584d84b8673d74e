"""An active reservation (spec "States and conditions"): the reconciler only sets and clears
conditions from its nodes and atoms and never releases it; node connectivity and health changes
wake it, and it rechecks every 15 minutes without them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bettercompute.v1 import admin_pb2 as apb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, advance_and_settle, settled, wake_up_times
from tests.support import clock_now as now
from tests.support import Client, ServerThread, World, get

MIN = 60_000


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def conditions(world: World, rid: str, type_: str) -> list:
    return [c for c in get(world, rid).conditions if c.type == type_]


def test_an_active_reservation_is_rechecked_every_15_minutes_without_a_wake_up(world: World) -> None:
    r = world.create(count=2, duration="8h")
    active = SigningNodes(world).activate(r.id)
    settled(world, r.id)
    activated = now(world)
    # Its wake-ups: the 15-minute recheck, the (spent) bind deadline and the end.
    advance_and_settle(world, r.id, 6 * MIN)  # the bind deadline's wake-up passes: still active
    assert get(world, r.id).state == "active"
    # One pending recheck, 15 minutes after the activation (the bind deadline's pass added none).
    rechecks = [t for t in wake_up_times(world, r.id) if t < r.during.end]
    assert len(rechecks) == 1 and r.during.start <= rechecks[0] - 15 * MIN <= activated
    # A node change whose wake-up was lost (an older gateway wrote it without one): only the
    # recheck can see it.
    node = active.allocations[0].node_id
    world.sql("UPDATE nodes SET connectivity = 'unreachable' WHERE id = %s", (node,))
    advance_and_settle(world, r.id, rechecks[0] - now(world) + 1000)
    [unreachable] = conditions(world, r.id, "NodeUnreachable")
    assert unreachable.last_transition_time >= rechecks[0]  # raised by the recheck itself
    assert get(world, r.id).state == "active"
    later = [t for t in wake_up_times(world, r.id) if t < r.during.end]
    assert len(later) == 1 and later[0] >= rechecks[0] + 15 * MIN  # and the next recheck is set
    for _ in range(3):  # wake-ups from node changes add no second recheck chain
        world.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(node_id=node, connectivity="unreachable"))
        settled(world, r.id)
    assert [t for t in wake_up_times(world, r.id) if t < r.during.end] == later
    check_invariants(world.conninfo, world.tenant)


def test_a_gpu_health_change_wakes_an_active_reservation_for_a_condition(world: World) -> None:
    r = world.create(count=2, duration="8h")
    active = SigningNodes(world).activate(r.id)
    alloc = active.allocations[0]
    gpu = alloc.device_ids[0]
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=alloc.node_id, device_uuid=gpu,
                                                              health="unhealthy"))
    settled(world, r.id)  # woken by the change, not by the clock (which has not moved)
    [sick] = conditions(world, r.id, "DeviceUnhealthy")
    assert gpu in sick.message and sick.status == "True"
    assert get(world, r.id).state == "active"  # never released for node trouble
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=alloc.node_id, device_uuid=gpu,
                                                              health="healthy"))
    settled(world, r.id)
    assert conditions(world, r.id, "DeviceUnhealthy") == [] and get(world, r.id).state == "active"
    check_invariants(world.conninfo, world.tenant)
