"""Hardware and node trouble against live reservations, as a hostile or unlucky fleet produces it
(spec "States and conditions", "Bindings", "BookingRepair"): GPU quarantines, cordons, unreachable
nodes and failing binds around the moments the reconciler acts on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import admin_pb2 as apb
from controlplane.nodes import inventory
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, settled
from tests.support import Client, ServerThread, World, eventually, get, gpus
from tests.test_pki import arun
from tests.test_shared_gpus import shared_pool

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


def test_a_quarantined_slot_stays_quarantined_when_its_node_reports_its_inventory_again(world: World) -> None:
    shared_pool(world, "time-slice", nodes=0)
    node = world.add_node(gpus("slot-node", count=1))
    gpu = gpus("slot-node", count=1)[0].uuid
    again = node_pb2.Inventory(generation=2, gpus=[node_pb2.Gpu(uuid=gpu, model="H100-SXM5-80GB", memory_mib=81559)])
    slot = f"{gpu}:1"  # an XID on one time-slice replica: the operator quarantines that slot only
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node.id, device_uuid=slot, health="unhealthy"))
    health = "SELECT device_uuid, health FROM atoms WHERE node_id = %s AND kind <> 'gpu' AND health <> 'healthy'"
    assert world.sql(health, (node.id,)) == [(slot, "unhealthy")]
    arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, again))  # the node restarted
    assert world.sql(health, (node.id,)) == [(slot, "unhealthy")]
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node.id, device_uuid=gpu, health="unhealthy"))
    arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, again))
    assert len(world.sql(health, (node.id,))) == 4  # the GPU's quarantine covers every slot
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node.id, device_uuid=gpu, health="healthy"))
    assert world.sql(health, (node.id,)) == []


def live(r) -> list:
    return [a for a in r.allocations if a.state in ("placed", "binding", "bound")]


def test_a_booked_gpu_gone_from_the_inventory_is_a_condition_of_the_active_reservation_until_it_is_back(
    world: World,
) -> None:
    r = world.create(count=2, duration="8h")
    active = SigningNodes(world).activate(r.id)
    [alloc] = live(active)
    node = next(n for n in world.nodes if n.id == alloc.node_id)
    every = gpus(node.name)
    inv = lambda kept: node_pb2.Inventory(generation=len(kept), gpus=[  # noqa: E731
        node_pb2.Gpu(uuid=g.uuid, model=g.model, memory_mib=g.memory_mib) for g in kept])
    gone = alloc.device_ids[0]
    kept = [g for g in every if g.uuid != gone]
    arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, inv(kept)))
    [sick] = eventually(world, r.id, lambda x: [c for c in x.conditions if c.type == "DeviceUnhealthy"]).conditions
    assert gone in sick.message
    assert get(world, r.id).state == "active"  # only a condition
    arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, inv(every)))
    eventually(world, r.id, lambda x: not [c for c in x.conditions if c.type == "DeviceUnhealthy"])
    assert get(world, r.id).state == "active"
    check_invariants(world.conninfo, world.tenant)




def test_a_late_repair_at_the_start_books_from_now_where_the_past_is_taken(lone: tuple[World, apb.Node]) -> None:
    world, first = lone
    other = world.add_node()
    now = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    start = now + 30 * MIN
    r = world.create(count=8, start=start, duration="1h")
    [node] = {a.node_id for a in live(r)}
    spare = other.id if node == first.id else first.id
    earlier = world.create(count=8, duration="40m")  # the spare node, until 10 minutes after the start
    assert {a.node_id for a in live(earlier)} == {spare}
    world.sql("UPDATE nodes SET state = 'cordoned' WHERE id = %s", (node,))  # its wake-up was lost
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=41 * MIN))  # the worker reaches the start late
    moved = eventually(world, r.id, lambda x: x.state != "placed" or node not in {a.node_id for a in live(x)})
    assert moved.state in ("placed", "binding") and {a.node_id for a in live(moved)} == {spare}, moved.state
    assert moved.during.end == start + 60 * MIN  # the same end: repaired, never pending
    assert moved.during.start > start  # from when the worker got there, where the spare node is free
    types = [t for (t,) in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id",
                                     (f"reservation/{r.id}",))]
    assert "reservation.repaired" in types and "reservation.pending" not in types
    check_invariants(world.conninfo, world.tenant)
