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
    # Pending reservations retry only when woken (an hour between timed retries): a test that
    # waits for one to be placed proves the change that freed capacity woke it.
    yield from module_stack(pg_uri, clock_control=True, pending_retry_seconds=3600)


@pytest.fixture
def lone(world: World) -> tuple[World, apb.Node]:
    """The world's pool with one schedulable node of 8 GPUs (its default nodes cordoned)."""
    world.sql("UPDATE nodes SET state = 'cordoned' WHERE pool_id = %s", (world.pool_id,))
    return world, world.add_node()


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


def test_a_gpu_restored_to_health_wakes_the_pending_reservations_it_fits(lone: tuple[World, apb.Node]) -> None:
    world, node = lone
    gpu = f"GPU-{node.name}-0"
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node.id, device_uuid=gpu, health="unhealthy"))
    r = world.create(count=8, duration="1h")
    assert r.state == "pending"  # seven healthy GPUs
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node.id, device_uuid=gpu, health="healthy"))
    placed = eventually(world, r.id, lambda x: x.state in ("placed", "binding"))
    assert {a.node_id for a in placed.allocations} == {node.id}
    check_invariants(world.conninfo, world.tenant)


def test_a_node_an_operator_marks_connected_wakes_the_pending_reservations_it_fits(
    lone: tuple[World, apb.Node],
) -> None:
    world, node = lone
    world.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(node_id=node.id, connectivity="unreachable"))
    r = world.create(count=8, duration="1h")
    assert r.state == "pending"
    world.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(node_id=node.id, connectivity="connected"))
    placed = eventually(world, r.id, lambda x: x.state in ("placed", "binding"))
    assert {a.node_id for a in placed.allocations} == {node.id}
    check_invariants(world.conninfo, world.tenant)
