"""Gang reservations (spec "Gang reservations", "How a gang is placed", "What a gang counts as"):
`size` nodes sharing one value of a label, each taking all of the per-node request, placed all
together or not at all; quota and IAM count the whole gang; release, cancel and extend move every
member."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import db
from controlplane.config import Settings
from controlplane.placement import gang, placer
from controlplane.placement.index import Atom, Node, PoolIndex, Window
from controlplane.placement.index_sync import read_pool
from tests.invariants import check_invariants
from tests.support import World, eventually, get, gpus, make_world, rpc_error

FABRIC = "fabric.domain"


def fleet(world: World, layout: dict[str, int], key: str = FABRIC, count: int = 8) -> dict[str, list[str]]:
    """Nodes of `count` GPUs: `layout` maps a label value ("" for no label) to how many nodes carry it."""
    out: dict[str, list[str]] = {}
    for value, n in layout.items():
        for _ in range(n):
            labels = {key: value} if value else {}
            kw = {"system_labels": labels} if key == FABRIC else {"labels": labels}
            node = world.add_node(gpus(f"g{random.randrange(10**9)}", count), **kw)
            out.setdefault(value, []).append(node.id)
    return out


@pytest.fixture
def bare(stack) -> World:
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=256)
    yield w
    w.close()


def gang_create(world: World, size: int, key: str = FABRIC, count: int = 8, **kw) -> pb.Reservation:
    return world.create(count=count, gang=pb.Gang(size=size, topology_key=key), **kw)


def live(r: pb.Reservation) -> list[pb.Allocation]:
    return [a for a in r.allocations if a.state in ("placed", "binding", "bound")]


def labels_of(world: World, node_ids: list[str], key: str = FABRIC) -> set[str | None]:
    rows = world.sql("SELECT labels -> %s ->> 'value' FROM nodes WHERE id = ANY(%s)", (key, node_ids))
    return {v for (v,) in rows}


def used(world: World) -> int:
    return world.sql("SELECT coalesce(sum(amount), 0) FROM quota_charges WHERE tenant_id = %s"
                     " AND refunded_at IS NULL AND resource = 'gpu'", (world.tenant,))[0][0]


def test_a_gang_books_size_nodes_of_one_label_value_each_with_all_devices(bare: World) -> None:
    nodes = fleet(bare, {"fab-a": 3, "fab-b": 2, "": 4})
    r = gang_create(bare, 3)
    assert r.state == "placed"
    members = live(r)
    assert len(members) == 3 and len({a.node_id for a in members}) == 3  # one allocation per node
    assert all(len(a.device_ids) == 8 for a in members)
    assert sorted(a.node_id for a in members) == sorted(nodes["fab-a"])  # the only value with room
    assert r.request.gang.size == 3 and r.request.gang.topology_key == FABRIC
    placed = bare.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.placed'",
                      (f"reservation/{r.id}",))[0][0]
    assert sorted(placed["nodeIds"]) == sorted(nodes["fab-a"])
    groups = bare.sql("SELECT DISTINCT gang_group FROM allocations WHERE reservation_id = %s", (r.id,))
    assert groups == [("fab-a",)]
    check_invariants(bare.conninfo, bare.tenant)


def test_a_gang_that_fits_nowhere_is_pending_with_the_largest_group_in_the_reason(bare: World) -> None:
    fleet(bare, {"fab-a": 3, "fab-b": 2, "": 5})  # five unlabelled nodes never join
    r = gang_create(bare, 4)
    assert r.state == "pending" and not r.allocations
    assert r.conditions[0].type == "Unschedulable" and r.conditions[0].reason == "NoFit"
    assert r.conditions[0].message == "no gang of 4 nodes fits in one fabric.domain (at most 3 nodes fit together)"
    assert used(bare) == 32  # the charge is held while pending, as for any reservation


def test_busy_nodes_do_not_count_towards_a_group(bare: World) -> None:
    nodes = fleet(bare, {"fab-a": 2, "fab-b": 2})
    single = bare.create(count=1)  # takes a GPU of one node: that node no longer fits 8 GPUs
    busy_value = labels_of(bare, [live(single)[0].node_id]).pop()
    other = "fab-b" if busy_value == "fab-a" else "fab-a"
    r = gang_create(bare, 2)
    assert r.state == "placed" and sorted(a.node_id for a in live(r)) == sorted(nodes[other])
    second = gang_create(bare, 2)
    assert second.state == "pending"
    assert second.conditions[0].message == "no gang of 2 nodes fits in one fabric.domain (at most 1 node fits together)"


def test_without_a_topology_key_any_nodes_of_the_pool_form_a_gang(bare: World) -> None:
    fleet(bare, {"fab-a": 1, "fab-b": 1, "": 1})
    r = gang_create(bare, 3, key="")
    assert r.state == "placed" and len({a.node_id for a in live(r)}) == 3
    again = gang_create(bare, 2, key="")
    assert again.conditions[0].message == "no gang of 2 nodes fits in the pool (at most 0 nodes fit together)"


def test_an_operator_label_works_as_a_topology_key(bare: World) -> None:
    nodes = fleet(bare, {"r1": 2, "r2": 1}, key="rack")
    r = gang_create(bare, 2, key="rack", count=4, topology="nvlink-all")
    assert r.state == "placed" and sorted(a.node_id for a in live(r)) == sorted(nodes["r1"])
    assert all(len(a.device_ids) == 4 for a in live(r))


def test_quota_charges_size_times_the_per_node_devices_all_or_nothing(bare: World) -> None:
    fleet(bare, {"fab-a": 4})
    bare.quota(23)
    with pytest.raises(grpc.RpcError) as exc:
        gang_create(bare, 3)  # 3 x 8 = 24 > 23
    code, reason, details = rpc_error(exc)
    assert reason == "QUOTA_EXCEEDED" and details["requested"] == "24" and details["resource"] == "gpu"
    assert used(bare) == 0 and not bare.sql(
        "SELECT 1 FROM allocations a JOIN nodes n ON n.id = a.node_id WHERE n.pool_id = %s", (bare.pool_id,))
    r = gang_create(bare, 2)
    assert r.state == "placed" and used(bare) == 16


def test_iam_sees_the_whole_gang_so_an_8_gpu_cap_refuses_two_8_gpu_nodes(bare: World) -> None:
    fleet(bare, {"fab-a": 2})
    bare.policy('permit(principal, action, resource);\n'
                'forbid(principal, action == Action::"compute:reservations:create", resource)'
                ' when { resource has gpuCount && resource.gpuCount > 8 };')
    with pytest.raises(grpc.RpcError) as exc:
        gang_create(bare, 2)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    attributes = bare.sql("SELECT p.attributes FROM authz_projection p JOIN reservations r ON r.id = p.reservation_id"
                          " WHERE r.tenant_id = %s", (bare.tenant,))[0][0]
    assert attributes["gpuCount"] == 16 and attributes["gangSize"] == 2 and attributes["gpuEquivalent"] == 16
    assert gang_create(bare, 2, count=4).state == "placed"  # 2 x 4 = 8 is within the cap


@pytest.mark.parametrize("gang_msg, field", [
    (pb.Gang(size=1, topology_key=FABRIC), "gang.size"),
    (pb.Gang(size=65, topology_key=FABRIC), "gang.size"),
    (pb.Gang(size=2, topology_key="bad key!"), "gang.topologyKey"),
])
def test_a_bad_gang_is_invalid_input_naming_the_field(bare: World, gang_msg: pb.Gang, field: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        bare.create(count=8, gang=gang_msg)
    code, reason, details = rpc_error(exc)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and reason == "INVALID_INPUT" and details["field"] == field


def test_release_and_cancel_free_every_member(bare: World) -> None:
    fleet(bare, {"fab-a": 4})
    r = gang_create(bare, 2)
    released = bare.user.res("Release", pb.ReleaseReservationRequest(tenant_id=bare.tenant, reservation_id=r.id))
    assert released.state == "released" and not live(released) and len(released.allocations) == 2
    assert used(bare) == 0
    later = gang_create(bare, 4, start=bare.later(2))
    assert later.state == "placed" and len(live(later)) == 4
    cancelled = bare.user.res("Cancel", pb.CancelReservationRequest(tenant_id=bare.tenant, reservation_id=later.id))
    assert cancelled.state == "cancelled" and not live(cancelled)
    assert not bare.sql("SELECT 1 FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
                        " WHERE a.reservation_id = %s AND upper(b.during) > compute_now()", (later.id,))
    check_invariants(bare.conninfo, bare.tenant)


def test_extend_moves_every_member_or_none(bare: World) -> None:
    fleet(bare, {"fab-a": 2})
    start = bare.later(2)
    r = gang_create(bare, 2, start=start, duration="1h")
    extended = bare.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=bare.tenant, reservation_id=r.id, idempotency_key="e1", by="1h"))
    assert extended.extended
    ends = bare.sql("SELECT DISTINCT epoch_ms(upper(b.during)) FROM bookings b JOIN allocations a"
                    " ON a.id = b.allocation_id WHERE a.reservation_id = %s", (r.id,))
    assert ends == [(start + 2 * 3_600_000,)]
    # One member's node is booked right after the new end: the next extend moves no member.
    blocker = bare.create(count=1, start=start + 2 * 3_600_000, duration="1h")
    assert blocker.state == "placed"
    refused = bare.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=bare.tenant, reservation_id=r.id, idempotency_key="e2", by="1h"))
    assert not refused.extended and refused.available_until == start + 2 * 3_600_000
    ends = bare.sql("SELECT DISTINCT epoch_ms(upper(b.during)) FROM bookings b JOIN allocations a"
                    " ON a.id = b.allocation_id WHERE a.reservation_id = %s", (r.id,))
    assert ends == [(start + 2 * 3_600_000,)]


def test_get_lists_every_member_and_a_request_without_a_gang_has_none(bare: World) -> None:
    fleet(bare, {"fab-a": 3})
    r = gang_create(bare, 3)
    seen = get(bare, r.id)
    assert sorted(a.id for a in seen.allocations) == sorted(a.id for a in r.allocations) and len(seen.allocations) == 3
    plain = bare.create(count=1, start=bare.later(3))
    assert not plain.request.HasField("gang")


# The commit, driven directly: a lost race rolls the whole gang back and plans again ------------

def _settings() -> Settings:
    return Settings(database_url="", placement_top_n=1)


@pytest.mark.parametrize("race", ["booked", "cordoned"])
def test_a_member_that_loses_its_race_rolls_back_the_whole_gang_and_the_gang_is_planned_again(
    bare: World, race: str
) -> None:
    """`booked`: another booking on a planned atom (found by the probe before the insert);
    `cordoned`: the node left service (found by the insert, whose savepoint rolls back)."""
    nodes = fleet(bare, {"fab-a": 3, "fab-b": 2})
    r = gang_create(bare, 2, start=bare.later(5))  # a reservation row to hang the allocations on
    bare.user.res("Cancel", pb.CancelReservationRequest(tenant_id=bare.tenant, reservation_id=r.id))

    async def scenario() -> tuple[gang.Committed, list[str], str]:
        pool = await db.open_pool(bare.conninfo, size=2)
        try:
            async with pool.connection() as conn:
                start = (await (await conn.execute("SELECT epoch_ms(compute_now()) + 3600000 AS s")).fetchone())["s"]
                ask = placer.Ask(bare.pool_id, 8, "any", "", {}, start, start + 3_600_000)
                members = gang.Gang(3, FABRIC)
                planned = await gang.plan(conn, ask, members, _settings())
                assert planned.plan is not None and planned.plan.group == "fab-a"
                first = planned.plan.node_ids
                taken = planned.plan.members[1]
                if race == "booked":  # someone takes one GPU of a planned member before the commit
                    await conn.execute(
                        "INSERT INTO allocations (id, reservation_id, node_id, device_ids, state)"
                        " VALUES ('alloc_x', %s, %s, '{}', 'released')",
                        (r.id, taken.node_id))
                    await conn.execute(
                        "INSERT INTO bookings (atom_id, allocation_id, during)"
                        " VALUES (%s, 'alloc_x', tstzrange(from_epoch_ms(%s), from_epoch_ms(%s), '[)'))",
                        (taken.atom_ids[0], start, start + 60_000))
                else:
                    await conn.execute("UPDATE nodes SET state = 'cordoned' WHERE id = %s", (taken.node_id,))
                committed = await gang.commit(conn, ask, members, r.id, planned, _settings())
                kept = (await (await conn.execute(
                    "SELECT count(*) AS n FROM allocations WHERE reservation_id = %s AND state = 'placed'",
                    (r.id,))).fetchone())["n"]
                await conn.rollback()
                assert kept == 0, "a partial gang was left behind"
                return committed, first, taken.node_id
        finally:
            await pool.close()

    committed, first, lost = asyncio.run(scenario())
    # fab-a has only two nodes left with room: re-planned, nothing fits, and nothing was kept.
    assert committed.placements is None
    assert committed.reason == "no gang of 3 nodes fits in one fabric.domain (at most 2 nodes fit together)"
    assert sorted(first) == sorted(nodes["fab-a"]) and lost in first


def test_plan_in_ranks_by_score_sum_then_group_name() -> None:
    pool = PoolIndex("p")
    for name, value, free in (("a1", "x", 8), ("a2", "x", 8), ("b1", "w", 8), ("b2", "w", 8), ("c1", "v", 8)):
        node = Node(name, "p", name, {FABRIC: {"value": value, "source": "system"}}, frozenset(), "ready", "connected")
        for g in range(free):
            node.atoms[f"{name}-{g}"] = Atom(f"{name}-{g}", name, "gpu", f"GPU-{name}-{g}", "H100", g // 4, "d", True, True)
        pool.put(node)
    window = Window(8, "any", "", {}, 0, 1000)
    planned = gang.plan_in(pool, window, gang.Gang(2, FABRIC), top_n=1, rng=random.Random(1))
    assert planned.plan is not None and planned.plan.group == "w"  # equal sums: the group name decides
    pool.nodes["b1"].atoms["b1-0"].intervals.append((0, 1000))  # b1 no longer fits 8
    pool.put(pool.nodes["b1"])  # as a refresh would: the index learns of the booking
    planned = gang.plan_in(pool, window, gang.Gang(2, FABRIC), top_n=1, rng=random.Random(1))
    assert planned.plan is not None and planned.plan.group == "x"
    seven = gang.plan_in(pool, Window(7, "any", "", {}, 0, 1000), gang.Gang(2, FABRIC), top_n=1, rng=random.Random(1))
    assert seven.plan is not None and seven.plan.group == "w"  # b1 left with nothing free scores best
    assert sorted(seven.plan.node_ids) == ["b1", "b2"]


def test_read_pool_sees_the_transactions_own_writes(bare: World) -> None:
    nodes = fleet(bare, {"fab-a": 1})

    async def scenario() -> int:
        pool = await db.open_pool(bare.conninfo, size=1)
        try:
            async with pool.connection() as conn:
                await conn.execute("UPDATE nodes SET state = 'cordoned' WHERE id = %s", (nodes["fab-a"][0],))
                snapshot = await read_pool(conn, bare.pool_id)
                await conn.rollback()
                return sum(1 for n in snapshot.nodes.values() if n.schedulable)
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == 0


def test_a_pending_gang_is_placed_as_soon_as_a_release_frees_its_room(bare: World) -> None:
    nodes = fleet(bare, {"fab-a": 2})
    blocker = bare.create(count=1)
    waiting = gang_create(bare, 2)
    assert waiting.state == "pending"
    bare.user.res("Release", pb.ReleaseReservationRequest(tenant_id=bare.tenant, reservation_id=blocker.id))
    placed = eventually(bare, waiting.id, lambda x: x.state in ("placed", "binding", "active"))
    assert sorted(a.node_id for a in live(placed)) == sorted(nodes["fab-a"])
    check_invariants(bare.conninfo, bare.tenant)


def test_each_member_books_its_host_resources_and_a_node_that_cannot_give_them_is_left_out(
        stack, bare: World) -> None:
    """A gang's `resources` are per member: every member books them on its node in the gang's
    commit, and a node of the right label value that cannot give them never joins; IAM and quota
    count them over the whole gang."""
    server, _ = stack
    nodes = fleet(bare, {"fab-a": 3})["fab-a"]
    give = dict(zip(nodes, (64, 64, 8)))  # the third node cannot give 30 vCPUs beside its reserve
    for node_id, vcpu in give.items():
        bare.sql("INSERT INTO host_resources (node_id, resource, allocatable) VALUES"
                 " (%(n)s, 'vcpu', %(v)s), (%(n)s, 'memoryGiB', 512)", {"n": node_id, "v": vcpu})
        bare.sql("UPDATE nodes SET labels = labels || jsonb_build_object('bc.dev/cap.devices.limits',"
                 " jsonb_build_object('value', 'true', 'source', 'system')) WHERE id = %s", (node_id,))
    server.call(server.app.runtime.capacity.barrier())
    bare.quota(1000, "vcpu")
    bare.quota(10_000, "memoryGiB")
    r = gang_create(bare, 2, resources=pb.HostResources(vcpu=30), start=bare.later(1))
    assert r.state == "placed" and {a.node_id for a in live(r)} == set(nodes[:2])
    booked = bare.sql("SELECT a.node_id, h.amount FROM host_bookings h JOIN allocations a ON a.id = h.allocation_id"
                      " WHERE a.reservation_id = %s AND h.resource = 'vcpu'", (r.id,))
    assert sorted(n for n, _ in booked) == sorted(nodes[:2]) and {int(v) for _, v in booked} == {30}
    attributes = bare.sql("SELECT attributes FROM authz_projection WHERE reservation_id = %s", (r.id,))[0][0]
    assert attributes["vcpu"] == 60 and attributes["gangSize"] == 2
    vcpu_charged = bare.sql("SELECT coalesce(sum(amount), 0) FROM quota_charges WHERE reservation_id = %s"
                            " AND resource = 'vcpu' AND refunded_at IS NULL", (r.id,))[0][0]
    share = int(r.host_share.vcpu) if r.HasField("host_share") and r.host_share.HasField("vcpu") else 0
    assert vcpu_charged == 2 * (30 - share)
    check_invariants(bare.conninfo, bare.tenant)
