"""Spot and preemption (spec "Spot and preemption"; DESIGN.md section 9): a spot reservation is
placed like any other and marked; a regular one that fits nowhere takes the fewest spot
reservations' devices from the end of the pool's notice; the victims get `reservation.preempting`,
a `Preempting` condition and an earlier end, and at the end are released with reason `preempted`
and `reservation.preempted`, their quota refunded. Spot never preempts spot, nor regular regular;
a calendar reservation takes only the part of a spot booking its window overlaps."""

from __future__ import annotations

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.placement import preempt
from controlplane.reservations import preemption
from controlplane.placement.index import Atom, Node, PoolIndex, Window
from tests.invariants import check_invariants
from tests.support import World, clock_now, eventually, get, gpus, make_world, rpc_error
from tests.test_cli import cli  # noqa: F401 (fixture)

FABRIC = "fabric.domain"
NOTICE_S = 2


@pytest.fixture
def bare(stack) -> World:
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=256)
    w.sql("UPDATE pools SET policy = policy || %s::jsonb WHERE id = %s",
          ('{"spot": {"noticeSeconds": %d}}' % NOTICE_S, w.pool_id))
    w.server = server
    yield w
    w.close()


def mk(world: World, **kw) -> pb.Reservation:
    """Create, then wait until the capacity index heard of it: the next create plans on the index,
    and a plan on a stale index loses its race and leaves the node out (a one-node pool: pending)."""
    r = world.create(**kw)
    world.server.call(world.server.app.runtime.capacity.barrier())
    return r


def node(world: World, fabric: str = "") -> str:
    kw = {"system_labels": {FABRIC: fabric}} if fabric else {}
    return world.add_node(gpus(f"s{len(world.nodes)}-{world.tenant}", 8), **kw).id


def events_of(world: World, rid: str, type_: str) -> list[dict]:
    return [d for (d,) in world.sql("SELECT data FROM events WHERE subject = %s AND type = %s ORDER BY id",
                                    (f"reservation/{rid}", type_))]


def charged(world: World, rid: str) -> bool:
    """The reservation's gpu charge is live (not refunded)."""
    return bool(world.sql("SELECT 1 FROM quota_charges WHERE reservation_id = %s AND resource = 'gpu'"
                          " AND refunded_at IS NULL", (rid,)))


def booked_atoms(world: World, rid: str) -> set[str]:
    return {a for (a,) in world.sql(
        "SELECT b.atom_id FROM bookings b JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = %s",
        (rid,))}


def test_spot_is_stored_shown_and_seen_by_iam(bare: World) -> None:
    node(bare)
    r = mk(bare, count=2, spot=True)
    assert r.state == "placed" and r.spot and r.request.spot
    regular = mk(bare, count=2)
    assert not regular.spot and not regular.request.spot
    attrs = dict(bare.sql("SELECT reservation_id, attributes FROM authz_projection WHERE reservation_id = ANY(%s)",
                          ([r.id, regular.id],)))
    assert attrs[r.id]["spot"] is True and attrs[regular.id]["spot"] is False
    stored = bare.sql("SELECT request FROM reservations WHERE id = %s", (r.id,))[0][0]
    assert stored["spot"] is True


def test_a_policy_can_forbid_spot(bare: World) -> None:
    node(bare)
    bare.policy('permit(principal, action, resource);\n'
                'forbid(principal, action == Action::"compute:reservations:create", resource)'
                ' when { resource has spot && resource.spot };')
    with pytest.raises(grpc.RpcError) as exc:
        mk(bare, count=1, spot=True)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    assert mk(bare, count=1).state == "placed"


def test_a_node_lease_cannot_be_spot(bare: World) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        mk(bare, count=8, binding="node", node=pb.NodeLease(profile_id="ubuntu"), spot=True)
    code, reason, details = rpc_error(exc)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and reason == "INVALID_INPUT" and details["field"] == "spot"


def test_the_pool_policy_carries_the_notice(stack) -> None:
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=0)
    try:
        pool = root.admin("CreatePool", apb.CreatePoolRequest(
            owner_tenant_id=w.tenant, name="spot", region="eu-1", policy=apb.PoolPolicy(spot_notice_seconds=90)))
        assert pool.policy.spot_notice_seconds == 90
        assert w.sql("SELECT policy -> 'spot' FROM pools WHERE id = %s", (pool.id,))[0][0] == {"noticeSeconds": 90}
        plain = root.admin("CreatePool", apb.CreatePoolRequest(owner_tenant_id=w.tenant, name="p2", region="eu-1"))
        assert plain.policy.spot_notice_seconds == 0  # unset: the default notice, 30 s
        for bad in (-1, 86_401):  # BC_MAX_SPOT_NOTICE_SECONDS, a day by default
            with pytest.raises(grpc.RpcError) as exc:
                root.admin("CreatePool", apb.CreatePoolRequest(
                    owner_tenant_id=w.tenant, name="p3", region="eu-1", policy=apb.PoolPolicy(spot_notice_seconds=bad)))
            _, reason, details = rpc_error(exc)
            assert reason == "INVALID_INPUT" and details["field"] == "policy.spotNoticeSeconds"
    finally:
        w.close()


def test_a_regular_reservation_preempts_the_fewest_spot_reservations(bare: World) -> None:
    node(bare)
    small_a = mk(bare, count=2, spot=True, duration="8h")
    small_b = mk(bare, count=2, spot=True, duration="8h")
    big = mk(bare, count=4, spot=True, duration="8h")
    before = clock_now(bare)
    r = mk(bare, count=4, duration="1h")
    assert r.state == "placed"
    # One victim (the 4-GPU one) rather than the two 2-GPU ones; the preemptor takes its atoms.
    assert booked_atoms(bare, r.id) == booked_atoms(bare, big.id)
    cut = r.during.start
    assert before + NOTICE_S * 1000 <= cut and r.during.end - cut == 3_600_000
    victim = get(bare, big.id)
    (cond,) = [c for c in victim.conditions if c.type == "Preempting"]
    assert cond.reason == "Preempted" and r.id in cond.message
    assert victim.during.end == cut
    assert events_of(bare, big.id, "reservation.preempting") == [
        {"state": victim.state, "poolId": bare.pool_id, "by": r.id, "noticeUntil": cut}]
    for other in (small_a, small_b):
        assert not events_of(bare, other.id, "reservation.preempting") and get(bare, other.id).during.end > cut
    ends = bare.sql("SELECT DISTINCT epoch_ms(upper(b.during)) FROM bookings b JOIN allocations a"
                    " ON a.id = b.allocation_id WHERE a.reservation_id = %s", (big.id,))
    assert ends == [(cut,)]  # its bookings end at the notice's end: the preemptor's start
    assert charged(bare, big.id)

    released = eventually(bare, big.id, lambda x: x.state == "released", seconds=30)
    assert released.state == "released"
    (rel,) = events_of(bare, big.id, "reservation.released")
    assert rel["reason"] == "preempted"
    assert events_of(bare, big.id, "reservation.preempted") == [
        {"state": "released", "poolId": bare.pool_id, "by": r.id, "noticeUntil": cut}]
    assert bare.sql("SELECT end_reason FROM reservations WHERE id = %s", (big.id,))[0][0] == "preempted"
    assert not charged(bare, big.id) and charged(bare, r.id)  # the victim's quota refunded
    assert get(bare, small_a.id).state != "released" and get(bare, small_b.id).state != "released"
    check_invariants(bare.conninfo, bare.tenant)


def test_spot_never_preempts_spot(bare: World) -> None:
    node(bare)
    full = mk(bare, count=8, spot=True, duration="8h")
    other = mk(bare, count=4, spot=True)
    assert other.state == "pending" and other.conditions[0].type == "Unschedulable"
    assert not events_of(bare, full.id, "reservation.preempting")
    assert not any(c.type == "Preempting" for c in get(bare, full.id).conditions)


def test_a_regular_reservation_never_preempts_a_regular_one(bare: World) -> None:
    node(bare)
    full = mk(bare, count=6, duration="8h")
    spot = mk(bare, count=2, spot=True, duration="8h")
    r = mk(bare, count=4)  # two spot GPUs would not be enough: the regular six stay
    assert r.state == "pending"
    assert not events_of(bare, full.id, "reservation.preempting")
    assert not events_of(bare, spot.id, "reservation.preempting")
    assert get(bare, spot.id).during.end - get(bare, spot.id).during.start == 8 * 3_600_000


def test_a_calendar_reservation_preempts_only_the_part_of_spot_its_window_overlaps(bare: World) -> None:
    node(bare)
    spot = mk(bare, count=8, spot=True, duration="8h")
    start = bare.later(hours=2)
    r = mk(bare, count=8, start=start, duration="1h")
    assert r.state == "placed" and r.during.start == start  # its own start: past the notice already
    victim = get(bare, spot.id)
    assert victim.during.end == start and victim.state != "released"  # the spot runs until then
    assert events_of(bare, spot.id, "reservation.preempting")[0]["noticeUntil"] == start
    # A calendar window after the spot's end takes nothing from it.
    later = mk(bare, count=8, start=start + 3_600_000, duration="1h")
    assert later.state == "placed" and later.during.start == start + 3_600_000
    assert len(events_of(bare, spot.id, "reservation.preempting")) == 1


def test_a_calendar_reservation_after_a_spot_booking_preempts_nothing(bare: World) -> None:
    node(bare)
    spot = mk(bare, count=8, spot=True, duration="1h")
    r = mk(bare, count=8, start=bare.later(hours=2), duration="1h")
    assert r.state == "placed"
    assert not events_of(bare, spot.id, "reservation.preempting")
    assert get(bare, spot.id).during.end - get(bare, spot.id).during.start == 3_600_000


def test_a_gang_preempts_on_several_nodes_in_one_notice(bare: World) -> None:
    nodes = [node(bare, "fab-a"), node(bare, "fab-a")]
    spots = [mk(bare, count=8, spot=True, duration="8h") for _ in range(2)]  # one whole node each
    nodes.append(node(bare, "fab-b"))
    regular = mk(bare, count=8, duration="8h")  # the only node left: fab-b's
    spot_nodes = {get(bare, s.id).allocations[0].node_id for s in spots}
    assert get(bare, regular.id).allocations[0].node_id == nodes[2]
    g = mk(bare, count=8, gang=pb.Gang(size=2, topology_key=FABRIC), duration="1h")
    assert g.state == "placed"
    assert {a.node_id for a in g.allocations} == spot_nodes == set(nodes[:2])
    cut = g.during.start
    notices = [events_of(bare, s.id, "reservation.preempting") for s in spots]
    assert notices == [[{"state": get(bare, s.id).state, "poolId": bare.pool_id, "by": g.id, "noticeUntil": cut}]
                       for s in spots]
    assert not events_of(bare, regular.id, "reservation.preempting")
    for s in spots:
        released = eventually(bare, s.id, lambda x: x.state == "released", seconds=30)
        assert released.state == "released" and not charged(bare, s.id)
    assert charged(bare, g.id) and charged(bare, regular.id)
    check_invariants(bare.conninfo, bare.tenant)


def test_a_lease_pool_falls_back_to_inline_placement_to_preempt(bare: World) -> None:
    pool = bare.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=bare.tenant, name="lease", region="eu-1",
        policy=apb.PoolPolicy(placer="lease", spot_notice_seconds=NOTICE_S)))
    bare.pool_id = pool.id
    node(bare)
    bare.wait_ms = 20_000
    spot = mk(bare, count=8, spot=True, duration="8h")
    assert spot.state == "placed"
    r = eventually(bare, mk(bare, count=8, duration="1h").id, lambda x: x.state == "placed", seconds=15)
    assert booked_atoms(bare, r.id) == booked_atoms(bare, spot.id)
    assert [d["by"] for d in events_of(bare, spot.id, "reservation.preempting")] == [r.id]
    types = [t for (t,) in bare.sql("SELECT type FROM events WHERE subject = %s ORDER BY id", (f"reservation/{r.id}",))]
    assert types == ["reservation.queued", "reservation.pending", "reservation.placed"]


def test_reserve_spot_on_the_cli(cli, world: World) -> None:  # noqa: F811
    out = cli("reserve", "--gpus", "1", "--spot").json
    assert out["spot"] is True and out["request"]["spot"] is True and out["state"] == "placed"
    assert cli("reserve", "--gpus", "1").json["spot"] is False  # printed, as the spec shows a false field


def test_a_spot_gang_on_two_nodes_counts_as_one_victim(bare: World) -> None:
    a_nodes = [node(bare, "fab-a"), node(bare, "fab-a")]
    spot_gang = mk(bare, count=8, spot=True, gang=pb.Gang(size=2, topology_key=FABRIC), duration="8h")
    assert spot_gang.state == "placed"
    b_nodes = [node(bare, "fab-b"), node(bare, "fab-b")]
    singles = [mk(bare, count=8, spot=True, duration="8h") for _ in range(2)]
    assert {get(bare, s.id).allocations[0].node_id for s in singles} == set(b_nodes)
    g = mk(bare, count=8, gang=pb.Gang(size=2, topology_key=FABRIC), duration="1h")
    assert g.state == "placed" and {a.node_id for a in g.allocations} == set(a_nodes)  # one victim, not two
    assert [d["by"] for d in events_of(bare, spot_gang.id, "reservation.preempting")] == [g.id]
    assert not any(events_of(bare, s.id, "reservation.preempting") for s in singles)


def _node_with(bookings: dict[str, list[tuple[int, int]]]) -> Node:
    n = Node("node-1", "pool-1", "n1", {}, frozenset(), "ready", "connected")
    for i in range(4):
        atom_id = f"a{i}"
        n.atoms[atom_id] = Atom(atom_id, n.id, "gpu", f"GPU-{i}", "H100", 0, "d0", True, True,
                                intervals=sorted(bookings.get(atom_id, [])))
    return n


def test_the_victim_search_takes_the_smallest_set_and_never_a_regular_booking() -> None:
    span = (0, 10_000)
    node_ = _node_with({"a0": [span], "a1": [span], "a2": [span], "a3": [span]})
    pool = PoolIndex("pool-1")
    pool.put(node_)

    def held(*atoms: str) -> preempt.Held:
        h = preempt.Held()
        for a in atoms:
            h.atoms[a].add(span)
        return h

    spots = {"A": held("a0", "a1"), "B": held("a2"), "C": held("a3")}

    def window(count: int) -> Window:
        return Window(count, "any", "", {}, 1_000, 2_000)

    victims, plan = preempt.cheapest(pool, node_, window(2), spots, limit=256)
    assert victims == ("A",) and sorted(plan.atom_ids) == ["a0", "a1"]
    victims, plan = preempt.cheapest(pool, node_, window(3), spots, limit=256)
    assert sorted(victims) == ["A", "B"] and sorted(plan.atom_ids) == ["a0", "a1", "a2"]
    # Past the cap (only the empty set tried) a greedy search: enough victims, none to spare.
    assert sorted(preempt.cheapest(pool, node_, window(2), spots, limit=1)[0]) == ["B", "C"]
    without_c = {"A": spots["A"], "B": spots["B"]}  # a3 is booked by a regular reservation
    assert preempt.cheapest(pool, node_, window(4), without_c, limit=256) is None
    assert preempt.choose_one(pool, window(1), {node_.id: spots}, 256)[0] == ["B"]  # one GPU taken, not two


def test_the_spot_lookups_can_use_the_partial_index(bare: World) -> None:
    """The queries' predicates imply the index's (migration 0026), so PostgreSQL may use it."""
    import psycopg

    with psycopg.connect(bare.conninfo, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        params = {"pool_id": bare.pool_id, "cut": 0, "end": 1, "ids": []}
        for query in (preempt.SPOT_BOOKINGS, preemption.WAKE_IF_SPOT):
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + query, params).fetchall())
            assert "reservations_spot_live" in plan, plan
