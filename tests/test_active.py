"""An active reservation (spec "States and conditions"): the reconciler only sets and clears
conditions from its nodes and atoms and never releases it; node connectivity and health changes
wake it, and it rechecks every 15 minutes without them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bettercompute.v1 import admin_pb2 as apb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, settled
from tests.support import Client, ServerThread, World, get

@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def conditions(world: World, rid: str, type_: str) -> list:
    return [c for c in get(world, rid).conditions if c.type == type_]


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
