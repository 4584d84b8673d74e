"""Spec audit of the gang/calendar/timeline page (004) and the reservationGrants page (001): the
promises no other test checked, each through the real API against the real server, database and
simulated provider. Every test here would fail if its promise broke."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.promise_support import advance_and_settle
from tests.support import PERMISSIVE, Client, ServerThread, World, eventually, get, make_world, rpc_error
from tests.vps_support import HOUR, MIN, Vps, own_stack, sim, v, world_of  # noqa: F401 (fixtures)


@pytest.fixture
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from own_stack(pg_uri)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    yield from world_of(stack, nodes=2)


def until(check, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def now(world: World) -> int:
    return world.root.admin("GetClock", apb.GetClockRequest()).now


def advance(world: World, ms: int) -> None:
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=ms))


def capacity(world: World) -> capacity_pb2_grpc.CapacityStub:
    return capacity_pb2_grpc.CapacityStub(world.user.channel)


def timeline(world: World, **kw) -> cpb.TimelineResponse:
    return capacity(world).Timeline(cpb.TimelineRequest(tenant_id=world.tenant, pool_id=world.pool_id, **kw),
                                    metadata=world.user.metadata, timeout=30)


def rollup(world: World) -> cpb.RollupResponse:
    return capacity(world).Rollup(cpb.RollupRequest(tenant_id=world.tenant, pool_id=world.pool_id),
                                  metadata=world.user.metadata, timeout=30)


def live_nodes(r: pb.Reservation) -> set[str]:
    return {a.node_id for a in r.allocations if a.state in ("placed", "binding", "bound")}


# --- 004: the timeline ------------------------------------------------------------------------------

def test_timeline_counts_a_gpu_booked_twice_in_a_bucket_once_and_free_never_below_zero(world: World) -> None:
    """"`booked` counts the distinct whole GPUs ... with any booking that overlaps the bucket";
    "`free` is `max(0, allocatable - booked)`, where `allocatable` is the pool's current rollup value"."""
    a, b = world.nodes
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=b.id, state="cordoned"))
    base = now(world)
    h0 = base - base % HOUR + 2 * HOUR  # BookingRepair's first look (start - 15 min) is still ahead
    first = world.create(count=8, start=h0, duration="30m")
    second = world.create(count=8, start=h0 + 30 * MIN, duration="30m")
    assert live_nodes(first) == live_nodes(second) == {a.id}  # the same eight GPUs, twice in one hour
    out = timeline(world, **{"from": h0, "to": h0 + 2 * HOUR})
    assert out.allocatable == 8
    assert [(bk.booked, bk.free) for bk in out.buckets] == [(8, 0), (0, 8)]
    # One booked GPU turns unhealthy: the current allocatable is 7, the bucket still books 8.
    uuid = first.allocations[0].device_ids[0]
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=a.id, device_uuid=uuid, health="unhealthy"))
    out = timeline(world, **{"from": h0, "to": h0 + 2 * HOUR})
    assert out.allocatable == 7
    assert [(bk.booked, bk.free) for bk in out.buckets] == [(8, 0), (0, 7)]


def test_timeline_to_defaults_to_from_plus_24_hours_in_hourly_buckets(world: World) -> None:
    """`to` defaults to "from plus 24 hours", `stepMinutes` to 60."""
    base = now(world)
    start = base - base % HOUR + 3 * HOUR + 17 * MIN
    out = timeline(world, **{"from": start})
    assert len(out.buckets) == 24
    assert [(bk.start, bk.end) for bk in out.buckets] == [(start + i * HOUR, start + (i + 1) * HOUR)
                                                          for i in range(24)]


def test_timeline_is_decided_as_capacity_read_on_the_pool(world: World) -> None:
    """"decided as `compute:capacity:read` on the pool"."""
    world.policy(PERMISSIVE + '\nforbid(principal, action == Action::"compute:capacity:read", resource);')
    with pytest.raises(grpc.RpcError) as exc:
        timeline(world)
    code, reason, details = rpc_error(exc)
    assert (code, reason, details.get("poolId")) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED",
                                                     world.pool_id)
    world.policy(PERMISSIVE)
    assert len(timeline(world).buckets) == 24


# --- 004: calendar reservations ---------------------------------------------------------------------

def test_the_rollup_counts_a_calendar_booking_reserved_until_it_begins(world: World) -> None:
    """"The pool's rollup counts the booking as `reserved` until it begins.\""""
    r = world.create(count=3, start=now(world) + HOUR, duration="2h")
    assert r.state == "placed"
    before = rollup(world).total
    assert (before.reserved, before.in_use) == (3, 0)
    advance(world, HOUR)
    eventually(world, r.id, lambda x: x.state == "binding")
    after = rollup(world).total
    assert (after.reserved, after.in_use) == (0, 3)


def test_a_pending_reservation_is_retried_periodically_without_any_wake_up(pg_uri: str) -> None:
    """"If nothing fits the window at admission, the reservation is `pending` and retried every 30
    seconds" (BC_PENDING_RETRY_SECONDS; 1 s here). The room appears through a write that wakes
    nobody, so only the periodic retry can place it."""
    stack = module_stack(pg_uri, pending_retry_seconds=1)
    server, root = next(stack)
    try:
        w = make_world(server.endpoint, root, server.conninfo, nodes=1)
        node = w.nodes[0].id
        w.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node, state="cordoned"))
        start = w.later(2)
        r = w.create(count=2, start=start, duration="1h")
        assert r.state == "pending"
        w.sql("UPDATE nodes SET state = 'ready' WHERE id = %s", (node,))
        placed = eventually(w, r.id, lambda x: x.state == "placed", seconds=30)
        assert live_nodes(placed) == {node} and placed.during.start == start
        w.close()
    finally:
        stack.close()


# --- 004: BookingRepair -----------------------------------------------------------------------------

def test_booking_repair_checks_again_at_the_start(world: World) -> None:
    """"At 15 minutes before the start, and again at the start, the lifecycle checks every
    allocation of a `placed` reservation": a node that went bad after the first check (its
    wake-up lost) is left at the start, for the same window."""
    start = now(world) + HOUR
    r = world.create(count=8, start=start, duration="1h")
    [bad] = live_nodes(r)
    spare = next(n.id for n in world.nodes if n.id != bad)
    advance_and_settle(world, r.id, 50 * MIN)  # the first check ran (start - 15 min): all was well
    assert get(world, r.id).state == "placed"
    world.sql("UPDATE nodes SET state = 'cordoned' WHERE id = %s", (bad,))  # no wake-up for it
    advance(world, 10 * MIN)
    repaired = eventually(world, r.id, lambda x: bool(world.sql(
        "SELECT 1 FROM events WHERE subject = %s AND type = 'reservation.repaired'", (f"reservation/{r.id}",))))
    assert live_nodes(repaired) == {spare}
    # The same window; the check runs at the start, so the time already gone is left out (the
    # repair books from the moment it ran, as a late repair does) and the end stays.
    assert start <= repaired.during.start <= now(world) and repaired.during.end == start + HOUR
    data = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.repaired'",
                     (f"reservation/{r.id}",))[0][0]
    assert (data["from"], data["nodeIds"]) == ([bad], [spare])


# --- 001: grants -----------------------------------------------------------------------------------

def root_events(v: Vps, type_: str) -> list[dict]:
    return [d for (d,) in v.world.sql("SELECT data FROM events WHERE tenant_id = 'root' AND type = %s ORDER BY id",
                                      (type_,))]


def test_capacity_short_counts_only_the_live_grants(v: Vps) -> None:
    """"When a scan sees the reservation's `total` drop below the slots its live grants hold (at
    their peak overlap), it publishes `reservation-grant.capacity-short`": ended and cancelled
    grants hold no slots."""
    start = v.now()
    cancelled = v.grant(slots=4, starts_at=start + HOUR, ends_at=start + 3 * HOUR)
    assert v.end(cancelled.id).state == "cancelled"
    ended = v.grant(slots=3, starts_at=start, ends_at=start + 3 * HOUR)
    until(lambda: v.get_grant(ended.id).state == "active")
    assert v.end(ended.id).state == "ended"
    live = v.grant(slots=2, starts_at=start + HOUR, ends_at=start + 3 * HOUR)
    v.put(2)
    v.scan()
    assert root_events(v, "reservation-grant.capacity-short") == []
    v.put(1)
    v.scan()
    assert root_events(v, "reservation-grant.capacity-short") == [{
        "accountId": v.account_id, "reservationId": v.reservation, "total": 1, "grantedSlots": 2,
        "grantIds": [live.id]}]


def instance_ledger(v: Vps, instance_id: str) -> list[tuple[str, int, float]]:
    return [(m, h, q) for m, h, q in v.world.sql(
        "SELECT meter, epoch_ms(hour), quantity::float8 FROM usage_records WHERE subject = %s ORDER BY hour, meter",
        (f"instance/{instance_id}",))]


def test_an_instance_taken_in_at_a_grants_start_is_billed_inside_it_for_its_term_exactly(v: Vps) -> None:
    """"a grant that starts while its tenant already runs instances on the reservation outside any
    grant takes them in ... from its start"; "Its instances inside the grant record only the
    informational `vm.grant.usage.hours`, never compute meters"; "When a grant ends, its billing
    stops at `endsAt` and its running instances are billed at the reservation rate from then on"."""
    made = v.instance()
    assert made.placement == "reserved"
    began = v.world.sql("SELECT epoch_ms(min(started_at)) FROM instance_segments WHERE instance_id = %s",
                        (made.id,))[0][0]
    start = v.now() + HOUR + 20 * MIN
    g = v.grant(slots=1, starts_at=start, ends_at=start + 2 * HOUR)
    v.advance(HOUR + 20 * MIN)
    until(lambda: v.get_grant(g.id).state == "active")
    v.advance(2 * HOUR)
    until(lambda: v.get_grant(g.id).state == "ended")
    v.advance(2 * HOUR + 5 * MIN)  # the instance meter waits the five minutes a grant may start in the past
    end = start + 2 * HOUR
    until(lambda: any(m == "vm.reserved.instance.hours" and h >= end for m, h, _ in instance_ledger(v, made.id)))
    rows = instance_ledger(v, made.id)
    inside = sum(q for m, h, q in rows if m == "vm.grant.usage.hours")
    assert inside == pytest.approx(2.0, abs=1e-6)  # exactly the term, from startsAt to endsAt
    before = sum(q for m, h, q in rows if m == "vm.reserved.instance.hours" and h < start)
    assert before == pytest.approx((start - began) / HOUR, abs=1e-6)
    # No compute meter in any hour that lies wholly inside the term.
    assert [r for r in rows if r[0] != "vm.grant.usage.hours" and r[1] >= start and r[1] + HOUR <= end] == []
    assert {m for m, _, _ in rows} == {"vm.reserved.instance.hours", "vm.grant.usage.hours"}


# --- second pass -----------------------------------------------------------------------------------

def test_the_documented_defaults(pg_uri: str) -> None:
    """Defaults the pages state: pending retried "every 30 seconds"; grants listed "at most 1000";
    a grant's `startsAt` "at most 5 minutes in the past"."""
    from controlplane.config import Settings
    s = Settings(database_url="")
    assert (s.pending_retry_seconds, s.grants_list_max, s.grant_start_past_seconds) == (30, 1000, 300)


def test_timeline_does_not_count_mig_instances(world: World) -> None:
    """"MIG instances and slots are not counted" (slots: test_shared_gpus)."""
    from controlplane.nodes import inventory
    from tests.support import gpus
    from tests.test_pki import arun
    from tests.test_shared_gpus import _mig_inventory, shared_pool
    shared_pool(world, "mig", nodes=0)
    node = world.add_node(gpus("mig-audit", count=2))
    first, second = (g.uuid for g in gpus("mig-audit", count=2))
    arun(world.conninfo, lambda pool: inventory.apply_inventory(
        pool, node.id, _mig_inventory(2, {first: [(1, "3g.40gb"), (2, "3g.40gb")], second: [(0, "7g.80gb")]})))
    held = world.create(device_class="gpu.mig", count=2, profile="3g.40gb")
    whole = world.create(device_class="gpu.mig", count=1, profile="7g.80gb")
    assert (held.state, whole.state) == ("placed", "placed")
    out = timeline(world)
    assert {bk.booked for bk in out.buckets} == {0} and out.allocatable == 0


def test_booking_repair_moves_a_booking_off_a_gpu_no_longer_bookable(world: World) -> None:
    """BookingRepair checks that "every booked atom [is] healthy and bookable": a booked GPU gone
    from its node's inventory (kept, with its booking, but no longer bookable) is bad hardware."""
    from bettercompute.node.v1 import node_pb2
    from controlplane.nodes import inventory
    from tests.support import gpus
    from tests.test_pki import arun
    start = now(world) + HOUR
    r = world.create(count=2, start=start, duration="1h")
    [bad] = live_nodes(r)
    node = next(n for n in world.nodes if n.id == bad)
    gone = r.allocations[0].device_ids[0]
    kept = [node_pb2.Gpu(uuid=g.uuid, model=g.model, memory_mib=g.memory_mib) for g in gpus(node.name)
            if g.uuid != gone]
    arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, bad, node_pb2.Inventory(generation=2,
                                                                                            gpus=kept)))
    assert world.sql("SELECT bookable FROM atoms WHERE device_uuid = %s", (gone,)) == [(False,)]
    advance(world, 45 * MIN + 1000)  # BookingRepair's look at start - 15 min
    repaired = eventually(world, r.id, lambda x: bool(world.sql(
        "SELECT 1 FROM events WHERE subject = %s AND type = 'reservation.repaired'", (f"reservation/{r.id}",))))
    assert repaired.state == "placed"
    assert (repaired.during.start, repaired.during.end) == (start, start + HOUR)
    assert bad not in live_nodes(repaired)  # "avoiding the bad nodes": the node, not only the GPU
    data = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.repaired'",
                     (f"reservation/{r.id}",))[0][0]
    assert (data["from"], data["nodeIds"]) == ([bad], sorted(live_nodes(repaired)))


def test_end_after_a_lost_term_end_never_moves_ends_at_later(v: Vps) -> None:
    """end: "`endsAt` becomes the current time (never later than it was)". The grant's own wake-ups
    are lost, so it is still `active` when `end` comes after its `endsAt`."""
    start = v.now()
    g = v.grant(slots=1, starts_at=start, ends_at=start + HOUR)
    until(lambda: v.get_grant(g.id).state == "active")
    v.world.sql("DELETE FROM work_items WHERE kind = 'grant' AND subject = %s", (g.id,))
    v.advance(2 * HOUR)
    assert v.get_grant(g.id).state == "active"
    ended = v.end(g.id)
    assert (ended.state, ended.ends_at) == ("ended", start + HOUR)


def test_a_renewal_keeps_billing_its_instance_inside_a_grant_and_the_rest_go_to_the_reservation_rate(
    v: Vps,
) -> None:
    """"When a grant ends, its billing stops at `endsAt` and its running instances are billed at the
    reservation rate from then on, unless another grant of the tenant on the same reservation is
    live then (a renewal), which takes them on up to its free slots"."""
    start = v.now()
    first = v.grant(slots=2, starts_at=start, ends_at=start + HOUR + 30 * MIN)
    renewal = v.grant(slots=1, starts_at=start + HOUR + 30 * MIN, ends_at=start + 4 * HOUR)
    until(lambda: v.get_grant(first.id).state == "active")
    a, b = v.instance(), v.instance()
    assert {a.grant_id, b.grant_id} == {first.id}
    cut = start + HOUR + 30 * MIN
    after = cut - cut % HOUR + HOUR  # the first whole hour after the cut
    v.advance(HOUR + 30 * MIN)
    until(lambda: v.get_grant(renewal.id).state == "active")
    # Until that hour has ended (1 to 2 hours, by the minute the test began), and the five minutes in
    # which a grant may still be made to start in it, after which the instance meter writes it.
    v.advance(after + HOUR + 5 * MIN - v.now())
    until(lambda: any(h >= cut for m, h, _ in instance_ledger(v, b.id) if m == "vm.reserved.instance.hours"))
    until(lambda: any(h == after for _, h, _ in instance_ledger(v, a.id)))
    rows_a, rows_b = instance_ledger(v, a.id), instance_ledger(v, b.id)
    # The oldest instance goes on inside the renewal: informational usage only, never billed.
    assert {m for m, _, _ in rows_a} == {"vm.grant.usage.hours"}
    assert [q for _, h, q in rows_a if h == after] == [pytest.approx(1.0)]
    # The other one: inside the ended grant until its end, the reservation rate from then on.
    assert not [r for r in rows_b if r[0] == "vm.grant.usage.hours" and r[1] >= cut]
    assert not [r for r in rows_b if r[0] == "vm.reserved.instance.hours" and r[1] + HOUR <= cut]
    assert [q for m, h, q in rows_b if h == after] == [pytest.approx(1.0)]
    assert [m for m, h, _ in rows_b if h == after] == ["vm.reserved.instance.hours"]


def test_booking_repair_in_a_lease_pool_places_inline(world: World) -> None:
    """"Repairs always place inline": in a pool placed by the pool-lease placer, the repaired
    booking is placed at once, never queued for the placer."""
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
    world.nodes = []
    world.add_node()
    world.add_node()
    world.wait_ms = 20_000
    start = now(world) + HOUR
    r = world.create(count=4, start=start, duration="1h")
    r = eventually(world, r.id, lambda x: x.state == "placed", seconds=20)
    [bad] = live_nodes(r)
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=bad, state="cordoned"))
    advance(world, 45 * MIN + 1000)
    repaired = eventually(world, r.id, lambda x: bool(world.sql(
        "SELECT 1 FROM events WHERE subject = %s AND type = 'reservation.repaired'", (f"reservation/{r.id}",))))
    assert repaired.state == "placed" and live_nodes(repaired) and bad not in live_nodes(repaired)
    types = [t for (t,) in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id",
                                     (f"reservation/{r.id}",))]
    assert types[types.index("reservation.placed"):] == ["reservation.placed", "reservation.repaired"]


def test_a_gang_is_picked_at_random_among_the_best_top_n_candidates() -> None:
    """"Candidate gangs are ranked by the sum of their members' scores, then by group name, and
    one is picked at random among the best `topN`": three equal groups, topN 2, many seeds."""
    import random

    from controlplane.placement import gang
    from controlplane.placement.index import Atom, Node, PoolIndex, Window
    pool = PoolIndex("p")
    for name, value in (("a1", "x"), ("a2", "x"), ("b1", "w"), ("b2", "w"), ("c1", "v"), ("c2", "v")):
        node = Node(name, "p", name, {"fabric.domain": {"value": value, "source": "system"}}, frozenset(),
                    "ready", "connected")
        for g in range(8):
            node.atoms[f"{name}-{g}"] = Atom(f"{name}-{g}", name, "gpu", f"GPU-{name}-{g}", "H100", g // 4, "d",
                                             True, True)
        pool.put(node)
    window = Window(8, "any", "", {}, 0, 1000)
    picked = {gang.plan_in(pool, window, gang.Gang(2, "fabric.domain"), top_n=2, rng=random.Random(seed)).plan.group
              for seed in range(40)}
    assert picked == {"v", "w"}  # the two best by name among equal sums; never the third
    only = {gang.plan_in(pool, window, gang.Gang(2, "fabric.domain"), top_n=1, rng=random.Random(seed)).plan.group
            for seed in range(10)}
    assert only == {"v"}


def test_timeline_counts_a_released_booking_for_the_buckets_it_touched_only(world: World) -> None:
    """"a GPU busy for five minutes of an hour counts for the hour": a booking released three
    minutes in (before its bind deadline moves it) counts for the current bucket and no later one."""
    base = now(world)
    hour = base - base % HOUR
    r = world.create(count=2, duration="3h")
    advance(world, 3 * MIN)
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    out = timeline(world, **{"from": hour, "to": hour + 4 * HOUR})
    booked = [bk.booked for bk in out.buckets]
    if (base + 3 * MIN) // HOUR == base // HOUR:  # the release fell in the same hour
        assert booked == [2, 0, 0, 0]
    else:
        assert booked == [2, 2, 0, 0]


@pytest.mark.parametrize(("method", "fields", "name"), [
    ("End", {"account_id": "pacct_short"}, "accountId"),
    ("End", {"account_id": "acct_" + "0" * 26}, "accountId"),
    ("End", {"grant_id": "rgrant_nope"}, "grantId"),
    ("End", {"grant_id": "grant_" + "0" * 26}, "grantId"),
    ("List", {"tenant_id": "root tenant"}, "tenantId"),
    ("List", {"tenant_id": "x" * 129}, "tenantId"),
])
def test_end_and_list_check_their_field_constraints(v: Vps, method: str, fields: dict, name: str) -> None:
    """The input tables of end and list: a value out of its constraint is INVALID_INPUT naming it."""
    from bettercompute.v1 import grants_pb2 as gpb
    g = v.grant(starts_at=v.now() + HOUR)
    if method == "End":
        request = gpb.EndReservationGrantRequest(tenant_id="root", account_id=v.account_id, grant_id=g.id)
    else:
        request = gpb.ListReservationGrantsRequest(tenant_id="root")
    for field, value in fields.items():
        setattr(request, field, value)
    with pytest.raises(grpc.RpcError) as exc:
        v.root("grants", method, request)
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", name)
    assert v.get_grant(g.id).state == "scheduled"


def test_a_calendar_gang_is_billed_for_every_member_from_active_until_release(world: World) -> None:
    """Calendar: "Billing starts only when it is `active`"; a gang: "The reservation becomes
    `active` only when every member node has reported its devices bound", and counts as `size`
    times the per-node devices: gpu.hours are 2 x 8 GPUs from active to release, nothing before."""
    from tests.promise_support import SigningNodes
    start = now(world) + 30 * MIN
    r = world.create(count=8, gang=pb.Gang(size=2), start=start, duration="6h")
    assert r.state == "placed" and len(live_nodes(r)) == 2
    advance(world, 31 * MIN)
    eventually(world, r.id, lambda x: x.state == "binding")
    advance(world, 3 * MIN)  # three minutes of binding: not billed
    SigningNodes(world).activate(r.id)
    activated = world.sql("SELECT epoch_ms(time) FROM events WHERE subject = %s AND type = 'reservation.active'",
                          (f"reservation/{r.id}",))[0][0]
    advance(world, 2 * HOUR)
    released = world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    ended = released.during.end
    advance(world, 3 * HOUR)
    until(lambda: world.sql("SELECT metered_until >= from_epoch_ms(%s) FROM metering_progress WHERE source = 'gpu'",
                            (ended + HOUR,)) == [(True,)])
    billed = world.sql("SELECT coalesce(sum(quantity), 0)::float8 FROM usage_records WHERE meter = 'gpu.hours' "
                       "AND subject = %s", (f"reservation/{r.id}",))[0][0]
    assert billed == pytest.approx(16 * (ended - activated) / HOUR, abs=1e-4)


@pytest.mark.parametrize(("attempts", "placed"), [(1, False), (2, True)])
def test_a_gang_is_planned_again_after_a_lost_race_up_to_max_attempts(world: World, attempts: int,
                                                                       placed: bool) -> None:
    """"If any member loses a race, the whole gang rolls back, that node is excluded, and the gang
    is planned again, up to `maxAttempts` times" (BC_PLACEMENT_MAX_ATTEMPTS): with one attempt a
    lost race ends it; with two the second plan, without the lost node, is committed."""
    import asyncio

    from controlplane import db
    from controlplane.config import Settings
    from controlplane.placement import gang, placer
    from tests.test_gang import FABRIC, fleet
    nodes = fleet(world, {"fab-a": 3})["fab-a"]
    r = world.create(count=8, gang=pb.Gang(size=2, topology_key=FABRIC), start=world.later(5))
    world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    settings = Settings(database_url="", placement_top_n=1, placement_max_attempts=attempts)

    async def scenario() -> tuple[gang.Committed, str, int]:
        pool = await db.open_pool(world.conninfo, size=2)
        try:
            async with pool.connection() as conn:
                start = (await (await conn.execute("SELECT epoch_ms(compute_now()) + 3600000 AS s")).fetchone())["s"]
                ask = placer.Ask(world.pool_id, 8, "any", "", {}, start, start + HOUR)
                planned = await gang.plan(conn, ask, gang.Gang(2, FABRIC), settings)
                lost = planned.plan.members[0].node_id
                await conn.execute("UPDATE nodes SET state = 'cordoned' WHERE id = %s", (lost,))
                committed = await gang.commit(conn, ask, gang.Gang(2, FABRIC), r.id, planned, settings)
                kept = (await (await conn.execute(
                    "SELECT count(*) AS n FROM allocations WHERE reservation_id = %s AND state = 'placed'",
                    (r.id,))).fetchone())["n"]
                await conn.rollback()
                return committed, lost, kept
        finally:
            await pool.close()

    committed, lost, kept = asyncio.run(scenario())
    if placed:
        assert committed.placements is not None and kept == 2
        assert sorted(p.node_id for p in committed.placements) == sorted(set(nodes) - {lost})
    else:
        assert committed.placements is None and kept == 0
        assert committed.reason == "no gang of 2 nodes could be committed in 1 attempts (lost races)"


def test_an_extended_calendar_reservation_runs_to_its_new_end_then_expires(world: World) -> None:
    """"`reservations.extend` works on a placed reservation too": extended before its start, it is
    still active at its old end and released (expired) at the new one."""
    from tests.promise_support import SigningNodes
    start = now(world) + HOUR
    r = world.create(count=2, start=start, duration="1h")
    out = world.user.res("Extend", pb.ExtendReservationRequest(tenant_id=world.tenant, reservation_id=r.id,
                                                               idempotency_key="ext", by="1h"))
    assert out.extended and out.reservation.state == "placed" and out.reservation.during.end == start + 2 * HOUR
    advance(world, HOUR)
    SigningNodes(world).activate(r.id)
    advance_and_settle(world, r.id, HOUR + MIN)  # past the old end: the old end's wake-up ran
    assert get(world, r.id).state == "active"
    advance(world, HOUR)
    done = eventually(world, r.id, lambda x: x.state == "released")
    assert done.during.end == start + 2 * HOUR
    assert world.sql("SELECT data->>'reason' FROM events WHERE subject = %s AND type = 'reservation.released'",
                     (f"reservation/{r.id}",)) == [("expired",)]
