"""Freed capacity wakes the pool's pending reservations at once (DESIGN.md section 9): after a
BookingRepair and after a binding failure, as after a release or a cancel; new capacity too (a
node registered).

This module's server retries pending reservations only every hour, so a pending reservation that
is placed within seconds was woken, not retried. Two models in one pool keep the moved
reservation from taking its old node back: it may go anywhere (it was created without a model in
a pool of both), the waiting one only where it was.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from bettercompute.v1 import admin_pb2 as apb
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, eventually, gpus, make_world

MIN = 60_000
HOUR = 3_600_000
WANTED = "H100-SXM5-80GB"
OTHER = "A100-SXM4-80GB"


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True, pending_retry_seconds=3600)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> World:
    server, root = stack
    return make_world(server.endpoint, root, server.conninfo, nodes=0)


@pytest.fixture
def two_models(stack: tuple[ServerThread, Client], world: World) -> tuple[apb.Node, apb.Node]:
    """A node of each model, the second cordoned, both in the server's capacity index before the
    test's first create: a create that comes before the index heard of the second model is stored
    with the pool's single model, and could then never move to the other node."""
    server, _ = stack
    wanted, other = add_node(world, WANTED), add_node(world, OTHER)
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=other.id, state="cordoned"))
    server.call(server.app.runtime.capacity.barrier())
    return wanted, other


def add_node(world: World, model: str) -> apb.Node:
    name = f"w{uuid.uuid4().hex[:8]}"
    return world.add_node(gpus(name, model=model), name=name)


def advance(world: World, ms: int) -> None:
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=ms))


def now(world: World) -> int:
    return world.root.admin("GetClock", apb.GetClockRequest()).now


def event_types(world: World, rid: str) -> list[str]:
    return [t for (t,) in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id", (f"reservation/{rid}",))]


def live_nodes(r) -> list[str]:
    return [a.node_id for a in r.allocations if a.state in ("placed", "binding", "bound")]


def test_a_booking_repair_wakes_the_pools_pending_reservations(
    world: World, two_models: tuple[apb.Node, apb.Node]
) -> None:
    wanted, other = two_models  # the other cordoned while the two fill the first node
    start = now(world) + HOUR
    moved = world.create(count=4, start=start, duration="1h")
    world.create(count=4, start=start, duration="1h")  # the other half of the node, same window
    assert live_nodes(moved) == [wanted.id] and moved.request.devices[0].model == ""
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=other.id, state="ready"))
    waiting = world.create(count=2, model=WANTED, start=start, duration="1h")
    assert waiting.state == "pending"
    # One of the moved reservation's GPUs goes bad: the repair moves it to the other model's node
    # and leaves three healthy GPUs free on the first one, enough for the waiting reservation.
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(
        node_id=wanted.id, device_uuid=moved.allocations[0].device_ids[0], health="unhealthy"))
    advance(world, 45 * MIN + 1000)
    repaired = eventually(world, moved.id, lambda r: "reservation.repaired" in event_types(world, moved.id))
    assert live_nodes(repaired) == [other.id]
    placed = eventually(world, waiting.id, lambda r: r.state == "placed")
    assert live_nodes(placed) == [wanted.id]
    assert event_types(world, waiting.id)[-2:] == ["reservation.pending", "reservation.placed"]


def test_a_binding_failure_wakes_the_pools_pending_reservations(
    world: World, two_models: tuple[apb.Node, apb.Node]
) -> None:
    wanted, other = two_models  # the other cordoned while the failing one is placed on the first node
    failing = world.create(count=8, duration="1h")
    assert live_nodes(failing) == [wanted.id] and failing.request.devices[0].model == ""
    eventually(world, failing.id, lambda r: r.state == "binding")
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=other.id, state="ready"))
    waiting = world.create(count=8, model=WANTED, duration="1h")
    assert waiting.state == "pending"
    # No node reports the binding: at the bind deadline it is placed again on the other node,
    # which frees the whole first node.
    advance(world, 5 * MIN + 1000)
    moved = eventually(world, failing.id, lambda r: other.id in live_nodes(r))
    assert live_nodes(moved) == [other.id]
    placed = eventually(world, waiting.id, lambda r: r.state in ("placed", "binding"))
    assert live_nodes(placed) == [wanted.id]


def test_a_node_registered_wakes_the_pools_pending_reservations(world: World) -> None:
    add_node(world, WANTED)
    start = now(world) + HOUR
    assert world.create(count=8, start=start, duration="1h").state == "placed"
    waiting = world.create(count=8, start=start, duration="1h")
    assert waiting.state == "pending"
    added = add_node(world, WANTED)
    placed = eventually(world, waiting.id, lambda r: r.state == "placed")
    assert live_nodes(placed) == [added.id]
