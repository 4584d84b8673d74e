"""Hardware and node trouble against live reservations, as a hostile or unlucky fleet produces it
(spec "States and conditions", "Bindings", "BookingRepair"): GPU quarantines, cordons, unreachable
nodes and failing binds around the moments the reconciler acts on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bettercompute.v1 import admin_pb2 as apb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, settled
from tests.support import Client, ServerThread, World, eventually, get

MIN = 60_000


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def conditions(world: World, rid: str, type_: str) -> list:
    return [c for c in get(world, rid).conditions if c.type == type_]


def test_a_gpu_quarantined_while_binding_is_a_condition_as_soon_as_it_is_active(world: World) -> None:
    r = world.create(count=2, duration="8h")
    binding = eventually(world, r.id, lambda x: x.state == "binding")
    [alloc] = [a for a in binding.allocations if a.state == "binding"]
    gpu = alloc.device_ids[0]
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=alloc.node_id, device_uuid=gpu,
                                                              health="unhealthy"))
    settled(world, r.id)
    assert get(world, r.id).state == "binding"  # binding goes on: the node may still bind it
    SigningNodes(world).activate(r.id)
    settled(world, r.id)  # the clock has not moved: no 15-minute recheck ran
    [sick] = conditions(world, r.id, "DeviceUnhealthy")
    assert gpu in sick.message
    assert get(world, r.id).state == "active"
    check_invariants(world.conninfo, world.tenant)
