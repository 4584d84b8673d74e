"""Quota and placement: charges, topology, pending with Unschedulable, wake-up on freed capacity."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from structlog.testing import capture_logs

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, gpus, make_world, rpc_error


@pytest.fixture(scope="module", params=["inline", "lease"])
def stack(request: pytest.FixtureRequest, pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Every test of the module runs with either placer (the pools' default placer)."""
    yield from module_stack(pg_uri, default_placer=request.param)


@pytest.fixture
def world(world: World, stack: tuple[ServerThread, Client]) -> World:
    """A lease pool's create answers queued: these tests wait for the placer's answer."""
    if stack[0].settings.default_placer == "lease":
        world.wait_ms = 20_000
    return world


def used(world: World, resource: str = "gpu") -> int:
    usage = world.root.admin("GetQuotaUsage", apb.GetQuotaUsageRequest(tenant_id=world.tenant))
    return next((line.used for line in usage.lines if line.resource == resource), 0)


def get(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def test_a_missing_quota_row_grants_zero(world: World) -> None:
    world.sql("DELETE FROM quotas WHERE tenant_id = %s", (world.tenant,))
    with pytest.raises(grpc.RpcError) as exc:
        world.create(count=1)
    code, reason, details = rpc_error(exc)
    assert reason == "QUOTA_EXCEEDED" and details["limit"] == "0"


def test_quota_is_charged_before_placement_and_refunded_on_release(world: World) -> None:
    world.quota(6)
    a = world.create(count=4)
    assert used(world) == 4
    with pytest.raises(grpc.RpcError) as exc:
        world.create(count=4)  # all or nothing: 4 + 4 > 6 charges nothing
    assert rpc_error(exc)[1] == "QUOTA_EXCEEDED"
    assert used(world) == 4
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=a.id))
    assert used(world) == 0
    assert world.create(count=4).state in ("placed", "binding")  # starts now: the binding worker may be first


def test_nvlink_all_books_gpus_of_one_nvlink_domain(world: World) -> None:
    split = world.add_node(gpus("split", 8, domains=2))  # two NVLink domains of four
    world.sql("UPDATE nodes SET state = 'cordoned' WHERE pool_id = %s AND id <> %s", (world.pool_id, split.id))
    r = world.create(count=4, topology="nvlink-all")
    domains = world.sql(
        "SELECT DISTINCT a.nvlink_domain FROM bookings b JOIN atoms a ON a.id = b.atom_id"
        " JOIN allocations al ON al.id = b.allocation_id WHERE al.reservation_id = %s", (r.id,))
    assert len(domains) == 1 and domains[0][0]
    pending = world.create(count=5, topology="nvlink-all")
    assert pending.state == "pending"
    assert "one NVLink domain" in pending.conditions[0].message
    assert world.create(count=4, topology="any").state in ("placed", "binding")  # the other domain


def test_a_request_one_numa_node_can_hold_lands_on_one(world: World) -> None:
    r = world.create(count=3)
    numa = world.sql(
        "SELECT DISTINCT a.numa_node FROM bookings b JOIN atoms a ON a.id = b.atom_id"
        " JOIN allocations al ON al.id = b.allocation_id WHERE al.reservation_id = %s", (r.id,))
    assert len(numa) == 1


@pytest.fixture(scope="module")
def top1_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Placement picks the single best node (BC_PLACEMENT_TOP_N=1): no random spread."""
    yield from module_stack(pg_uri, placement_top_n=1)


def node_of(world: World, rid: str) -> str:
    (node_id,) = {a.node_id for a in get(world, rid).allocations}
    return node_id


def test_bin_pack_keeps_whole_nodes_free_for_large_requests(top1_stack: tuple[ServerThread, Client]) -> None:
    server, root = top1_stack
    world = make_world(server.endpoint, root, server.conninfo, nodes=3)  # three nodes of eight GPUs
    small = [world.create(count=2) for _ in range(4)]
    assert all(r.state in ("placed", "binding") for r in small), small
    # Bin-packing fills the fullest node that fits: the four 2-GPU holds share one node (spread
    # over the three, they would leave no whole node)...
    assert len({node_of(world, r.id) for r in small}) == 1
    # ...so both other nodes stay whole, and two 8-GPU requests are placed at once.
    large = [world.create(count=8) for _ in range(2)]
    assert [r.state in ("placed", "binding") for r in large] == [True, True], large
    nodes = {node_of(world, r.id) for r in small + large}
    assert nodes == {n.id for n in world.nodes}
    assert world.create(count=1).state == "pending"  # all 24 GPUs are booked
    check_invariants(world.conninfo, world.tenant)


def test_nothing_fits_is_pending_unschedulable_and_keeps_its_charge(world: World) -> None:
    r = world.create(count=8, model="B200")
    assert r.state == "pending"
    cond = r.conditions[0]
    assert cond.type == "Unschedulable" and cond.reason == "NoFit"
    assert "model B200" in cond.message and "2 nodes in the pool" in cond.message
    assert r.operation.state == "succeeded"
    assert used(world) == 8


def test_cordoned_nodes_are_filtered_and_named_in_the_reason(world: World) -> None:
    for node in world.nodes:
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node.id, state="cordoned"))
    r = world.create(count=1)
    assert r.state == "pending" and "2 cordoned" in r.conditions[0].message
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=world.nodes[0].id, state="ready"))
    placed = wait_for_state(world, r.id, "placed", "binding")  # placed, then binding at its start
    assert placed.allocations[-1].node_id == world.nodes[0].id


def wait_for_state(world: World, rid: str, *states: str, seconds: float = 10) -> pb.Reservation:
    deadline = time.monotonic() + seconds
    while True:
        r = get(world, rid)
        if r.state in states or time.monotonic() > deadline:
            assert r.state in states, r
            return r
        time.sleep(0.05)


def test_freed_capacity_wakes_pending_reservations_at_once(world: World) -> None:
    holders = [world.create(count=8) for _ in range(2)]
    # They start now: the binding worker may be first (a lease pool's answer is read after its batch).
    assert [h.state in ("placed", "binding") for h in holders] == [True, True], holders
    waiting = world.create(count=8)
    assert waiting.state == "pending"
    started = time.monotonic()
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=holders[0].id))
    placed = wait_for_state(world, waiting.id, "placed", "binding")
    # The retry timer is 30 s in tests: placing well before it proves the wake-up.
    assert time.monotonic() - started < 10
    assert placed.allocations[0].node_id == holders[0].allocations[0].node_id
    events = [t for (t,) in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id",
                                      (f"reservation/{waiting.id}",))]
    assert [e for e in events if e != "reservation.queued"][:2] == ["reservation.pending", "reservation.placed"]


def test_a_race_lost_to_bookings_the_index_missed_is_planned_again_on_the_same_node(
    world: World, stack: tuple[ServerThread, Client]
) -> None:
    """The pool's one ready node has GPUs booked behind the capacity index's back (written without
    their notifications): the plan picks them, the commit refuses them, the node is read again
    under the lock and the create lands on its other GPUs instead of going pending."""
    if stack[0].app.runtime.capacity is None:
        pytest.skip("planned from the tables: there is no index to miss a booking")
    node = world.nodes[-1]
    world.sql("UPDATE nodes SET state = 'cordoned' WHERE pool_id = %s AND id <> %s", (world.pool_id, node.id))
    start = world.sql("SELECT epoch_ms(compute_now())")[0][0] + 3 * 3600 * 1000
    probe = world.create(count=4, start=start, duration="2h")  # which GPUs the plan picks for this
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=probe.id))
    picked = list(probe.allocations[0].device_ids)
    hidden = "rsv_hidden" + world.tenant
    world.sql("""
        WITH r AS (INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,
                                             request_hash, state, operation_state, during)
                   SELECT %(id)s, tenant_id, pool_id, owner_identity_id, 'hidden', request, 'x', 'placed', 'succeeded',
                          tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(start)s + 7200000), '[)')
                   FROM reservations WHERE id = %(probe)s RETURNING id)
        INSERT INTO allocations (id, reservation_id, node_id, device_ids)
        SELECT 'alloc_' || %(id)s, id, %(node)s, '{}' FROM r""", {"id": hidden, "start": start, "probe": probe.id,
                                                                 "node": node.id})
    with world._conn.transaction():  # the bookings without their triggers: the index never hears of them
        world._conn.execute("SET LOCAL session_replication_role = replica")
        world._conn.execute(
            "INSERT INTO bookings (atom_id, allocation_id, during) SELECT a.id, %s, "
            "tstzrange(from_epoch_ms(%s), from_epoch_ms(%s), '[)') FROM atoms a WHERE a.node_id = %s "
            "AND a.device_uuid = ANY(%s)", ("alloc_" + hidden, start, start + 7_200_000, node.id, picked))
    with capture_logs() as logs:
        again = world.create(count=4, start=start, duration="2h")
    assert again.state == "placed" and again.allocations[0].node_id == node.id
    assert not set(again.allocations[0].device_ids) & set(picked)
    assert any(e["event"] in ("placement race lost", "batch placement races lost") for e in logs), \
        "the plan did not pick the hidden GPUs: the test did not play the race"
    world.sql("UPDATE nodes SET state = 'ready' WHERE pool_id = %s", (world.pool_id,))


def test_placed_event_carries_node_ids_start_end_state_and_pool(world: World) -> None:
    r = world.create(count=2)
    (data,) = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.placed'",
                        (f"reservation/{r.id}",))[0]
    assert data == {"state": "placed", "poolId": world.pool_id, "nodeIds": [r.allocations[0].node_id],
                    "start": r.during.start, "end": r.during.end}


def test_a_future_start_books_that_window(world: World) -> None:
    now_ms = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    start = now_ms + 3 * 3600 * 1000
    r = world.create(count=8, start=start, duration="2h")
    assert r.state == "placed" and (r.during.start, r.during.end) == (start, start + 2 * 3600 * 1000)
    # The same GPUs still serve a booking that ends before the start (these start now: the binding
    # worker may have taken them on by the time the answer is read).
    assert world.create(count=8, duration="2h").state in ("placed", "binding")
    assert world.create(count=8, duration="2h").state in ("placed", "binding")
    assert world.create(count=8, duration="2h").state == "pending"


def test_nothing_planned_before_the_pool_lock_is_planned_again_under_it(world: World) -> None:
    """A create plans before it takes the pool lock. When that plan found nothing and capacity was
    freed before the lock (a release between the two, whose wake-up of the pending worker came
    before this create was pending), the create went pending on the stale plan and waited for the
    30-second retry. Planned again under the lock, it takes what was freed. (The race itself is a
    window of microseconds: here capacity is freed without a wake-up, and the locked step is handed
    a plan that found nothing.)"""
    import asyncio

    from controlplane import db
    from controlplane.common.locks import pool_lock
    from controlplane.config import Settings
    from controlplane.placement import placer
    from controlplane.reservations import placing
    from controlplane.reservations import queries as rq
    from controlplane.runtime import Runtime

    start = world.later(2)
    blockers = [world.create(count=8, start=start, duration="1h") for _ in world.nodes]
    assert [b.state for b in blockers] == ["placed"] * len(world.nodes)
    waiting = world.create(count=1, start=start, duration="1h")
    assert waiting.state == "pending"

    async def place_on_a_stale_plan() -> dict | None:
        pool = await db.open_pool(world.conninfo, size=1)
        try:
            rt = Runtime(pool, Settings(database_url=world.conninfo))
            async with pool.connection() as conn, conn.transaction():
                await pool_lock(conn, world.pool_id)
                # Freed with no wake-up of its own, while the lock holds off any pending retry (a
                # wake-up still due from the nodes' registration, paced, may come at any time).
                world.sql("DELETE FROM bookings WHERE allocation_id = %s", (blockers[0].allocations[0].id,))
                row = await (await conn.execute(rq.BY_ID_FOR_UPDATE, {"id": waiting.id})).fetchone()
                assert row["state"] == "pending"
                now_ms = await db.now_ms(conn)
                stale = placing.Prepared(placing.ask_for(row, now_ms), placer.Planned(None))
                return await placing.place_locked(conn, rt, row, stale, now_ms)
        finally:
            await pool.close()

    placed = asyncio.run(place_on_a_stale_plan())
    assert placed is not None and placed["state"] == "placed"
    assert get(world, waiting.id).allocations[0].node_id == blockers[0].allocations[0].node_id
    for r in blockers:
        world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
