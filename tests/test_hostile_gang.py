"""A hostile tenant against gangs, calendar reservations, the timeline and capacity preview
(spec "Gang and calendar reservations", DESIGN.md section 9), through the real gRPC API. Each test
here was an attack; the ones that broke a promise came with their fix."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.support import World, get, gpus, invalid, make_world, refused, rpc_error
from tests.test_gang import bare  # noqa: F401 (fixture)

FABRIC = "fabric.domain"
HOUR = 3_600_000
DAY = 24 * HOUR
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


def fleet(world: World, n: int, value: str = "fab-a", count: int = 8) -> list[str]:
    return [world.add_node(gpus(f"h{random.randrange(10**9)}", count), system_labels={FABRIC: value}).id
            for _ in range(n)]


def gang_create(world: World, size: int, key: str = FABRIC, count: int = 8, **kw) -> pb.Reservation:
    return world.create(count=count, gang=pb.Gang(size=size, topology_key=key), **kw)


def capacity(world: World):
    return capacity_pb2_grpc.CapacityStub(world.user.channel)


def timeline(world: World, **kw) -> cpb.TimelineResponse:
    req = cpb.TimelineRequest(tenant_id=world.tenant, pool_id=kw.pop("pool_id", world.pool_id), **kw)
    return capacity(world).Timeline(req, metadata=world.user.metadata, timeout=30)


def preview(world: World, **kw) -> cpb.PreviewResponse:
    return capacity(world).Preview(world.create_request(**kw), metadata=world.user.metadata, timeout=30)


def live_allocs(world: World, rid: str) -> list[tuple[str, int]]:
    return world.sql("SELECT a.id, epoch_ms(max(upper(b.during))) FROM allocations a JOIN bookings b"
                     " ON b.allocation_id = a.id WHERE a.reservation_id = %s AND upper(b.during) > compute_now()"
                     " GROUP BY a.id", (rid,))


# Gang inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, -1, 65, INT32_MAX, -INT32_MAX - 1])
def test_a_gang_size_out_of_2_to_64_is_invalid_input(bare: World, size: int) -> None:
    fleet(bare, 2)
    invalid("gang.size", gang_create, bare, size)
    invalid("gang.size", preview, bare, count=8, gang=pb.Gang(size=size))
    assert bare.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (bare.tenant,))[0][0] == 0


@pytest.mark.parametrize("key", ["x" * 129, "fabric\x00domain", "a b", "fabric.domain\n", "\u0430" * 3], ids=ascii)
def test_a_topology_key_that_is_no_label_is_invalid_input(bare: World, key: str) -> None:
    fleet(bare, 2)
    invalid("gang.topologyKey", gang_create, bare, 2, key=key)
    invalid("gang.topologyKey", preview, bare, count=8, gang=pb.Gang(size=2, topology_key=key))


def test_an_empty_topology_key_is_any_nodes_and_an_absent_label_never_joins(bare: World) -> None:
    fleet(bare, 2)
    assert gang_create(bare, 2, key="").state == "placed"
    fleet(bare, 2, value="fab-b")
    # A label no node of this pool carries (another tenant's operator label): pending, nothing leaked.
    r = gang_create(bare, 2, key="x" * 128)
    assert r.state == "pending" and not r.allocations
    r = gang_create(bare, 2, key="bc.dev/cap.devices.limits")
    assert r.state == "pending"
    check_invariants(bare.conninfo, bare.tenant)


# Quota and IAM count the whole gang, under concurrency -------------------------------------------


def test_concurrent_gangs_near_the_quota_limit_charge_all_or_nothing(bare: World) -> None:
    fleet(bare, 8)
    bare.quota(40)  # room for two gangs of 2 x 8, not three; never a part of one
    with ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(gang_create, bare, 2, start=bare.later(2)) for _ in range(8)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result().state)
            except grpc.RpcError as exc:
                outcomes.append(exc.code().name)
    assert outcomes.count("placed") == 2, outcomes
    assert all(o in ("placed", "RESOURCE_EXHAUSTED") for o in outcomes), outcomes
    check_invariants(bare.conninfo, bare.tenant)


# Every member or none, raced ----------------------------------------------------------------------


@pytest.mark.parametrize("round_", range(3))
def test_extend_release_and_cancel_of_one_gang_raced_move_every_member_or_none(bare: World, round_: int) -> None:
    fleet(bare, 4)
    start = bare.later(2)
    r = gang_create(bare, 4, start=start, duration="1h")
    res = bare.user.res

    def extend(i: int):
        return res("Extend", pb.ExtendReservationRequest(tenant_id=bare.tenant, reservation_id=r.id,
                                                          idempotency_key=f"e{i}", by="1h"))

    calls = [lambda i=i: extend(i) for i in range(4)]
    calls.append(lambda: res("Cancel", pb.CancelReservationRequest(tenant_id=bare.tenant, reservation_id=r.id)))
    calls.append(lambda: res("Release", pb.ReleaseReservationRequest(tenant_id=bare.tenant, reservation_id=r.id)))
    random.shuffle(calls)
    with ThreadPoolExecutor(len(calls)) as ex:
        for f in [ex.submit(c) for c in calls]:
            try:
                f.result()
            except grpc.RpcError as exc:
                assert exc.code() != grpc.StatusCode.INTERNAL and exc.code() != grpc.StatusCode.UNKNOWN, exc
    final = get(bare, r.id)
    left = live_allocs(bare, r.id)
    if final.state in ("cancelled", "released"):
        assert left == []
    else:
        assert len(left) == 4 and len({end for _, end in left}) == 1, left
    check_invariants(bare.conninfo, bare.tenant)


# Preview and earliest fit ------------------------------------------------------------------------


def test_preview_and_earliest_fit_on_a_pool_the_tenant_cannot_see_are_not_found(bare: World, stack) -> None:
    server, root = stack
    other = make_world(server.endpoint, root, server.conninfo, nodes=2)
    try:
        for kw in [{}, {"gang": pb.Gang(size=2)}, {"start_earliest": True, "horizon_ms": 60 * DAY}]:
            code, reason, details = refused(preview, bare, count=8, pool_id=other.pool_id, **kw)
            assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND"), details
            code, reason, _ = refused(timeline, bare, pool_id=other.pool_id)
            assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
    finally:
        other.close()


@pytest.mark.parametrize("horizon", [-1, 0, 60 * DAY + 1, INT64_MAX])
def test_an_absurd_earliest_horizon_is_invalid_input(bare: World, horizon: int) -> None:
    fleet(bare, 1)
    invalid("horizonMs", preview, bare, count=1, start_earliest=True, horizon_ms=horizon)


# The timeline ------------------------------------------------------------------------------------


def test_the_timeline_at_and_past_its_bounds(bare: World) -> None:
    fleet(bare, 1)
    now = bare.later(0)
    start = now - now % HOUR
    assert len(timeline(bare, **{"from": start, "to": start + 7 * DAY, "step_minutes": 30}).buckets) == 336
    assert len(timeline(bare, **{"from": start, "to": start + 28 * HOUR, "step_minutes": 5}).buckets) == 336
    assert len(timeline(bare, **{"from": start, "to": start + 7 * DAY, "step_minutes": 1440}).buckets) == 7
    invalid("stepMinutes", timeline, bare, **{"from": start, "to": start + 28 * HOUR + 1, "step_minutes": 5})
    invalid("to", timeline, bare, **{"from": start, "to": start + 7 * DAY + 1, "step_minutes": 1440})
    for step in (0, 4, 1441, -1, INT32_MAX, -INT32_MAX - 1):
        invalid("stepMinutes", timeline, bare, step_minutes=step)
    invalid("from", timeline, bare, **{"from": -(2**63)})
    invalid("from", timeline, bare, **{"from": INT64_MAX})
    invalid("to", timeline, bare, **{"from": start, "to": INT64_MAX})
    invalid("to", timeline, bare, **{"from": start, "to": -(2**63)})
    invalid("to", timeline, bare, **{"to": 0})
    assert len(timeline(bare, **{"from": 0, "to": HOUR}).buckets) == 1  # 1970: nothing booked, no crash
    far = bare.later(0) + (365 + 366) * DAY  # as far as the last booking can end (defaults)
    assert len(timeline(bare, **{"from": far, "to": far + 7 * DAY, "step_minutes": 30}).buckets) == 336
    invalid("from", timeline, bare, **{"from": far + HOUR, "to": far + 2 * HOUR})


# Calendar starts --------------------------------------------------------------------------------


def test_calendar_starts_in_the_past_now_and_beyond_the_horizon(bare: World) -> None:
    fleet(bare, 2)
    now = bare.later(0)
    past = gang_create(bare, 2, start=now - DAY)  # docs/decisions.md: the window begins at placement
    assert past.during.start >= now and past.during.end - past.during.start == HOUR
    bare.user.res("Release", pb.ReleaseReservationRequest(tenant_id=bare.tenant, reservation_id=past.id))
    invalid("start", gang_create, bare, 2, start=now + 400 * DAY)
    invalid("start", gang_create, bare, 2, start=INT64_MAX)
    r = gang_create(bare, 2, start=bare.later(0))
    assert r.state in ("placed", "binding", "active"), r.state
    check_invariants(bare.conninfo, bare.tenant)


# BookingRepair raced ----------------------------------------------------------------------------


@pytest.mark.parametrize("round_", range(2))
@pytest.mark.parametrize("race", ["release", "extend", "cancel"])
def test_booking_repair_racing_a_release_extend_or_cancel_never_double_books_or_loses_a_refund(
    clock_world: World, race: str, round_: int
) -> None:
    w = clock_world
    w.sql("UPDATE nodes SET state = 'cordoned' WHERE pool_id = %s", (w.pool_id,))
    fleet(w, 3)
    fleet(w, 3, value="fab-b")
    start = w.later(1)
    r = gang_create(w, 2, start=start, duration="1h")
    members = [a.node_id for a in r.allocations]
    w.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=members[0], state="cordoned"))

    def act():
        if race == "release":
            return w.user.res("Release", pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=r.id))
        if race == "cancel":
            return w.user.res("Cancel", pb.CancelReservationRequest(tenant_id=w.tenant, reservation_id=r.id))
        return w.user.res("Extend", pb.ExtendReservationRequest(tenant_id=w.tenant, reservation_id=r.id,
                                                                idempotency_key="x1", by="1h"))

    with ThreadPoolExecutor(2) as ex:
        tick = ex.submit(w.root.admin, "AdvanceClock", apb.AdvanceClockRequest(by_ms=45 * 60_000 + 1000))
        out = ex.submit(act)
        tick.result()
        try:
            out.result()
        except grpc.RpcError as exc:
            assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc
    # Wait for the repair worker to have judged the reservation (its work item done or it is ended).
    deadline = time.monotonic() + 15
    while True:  # the event first: a reservation read before it could predate the repair it reports
        repaired = w.sql("SELECT count(*) FROM events WHERE subject = %s AND type = 'reservation.repaired'",
                         (f"reservation/{r.id}",))[0][0]
        final = get(w, r.id)
        if final.state in ("released", "cancelled") or repaired:
            break
        assert time.monotonic() < deadline, final
        time.sleep(0.05)
    left = live_allocs(w, r.id)
    if final.state in ("released", "cancelled"):
        assert left == [], left
    else:
        assert len(left) == 2 and len({e for _, e in left}) == 1, left
        assert members[0] not in {a.node_id for a in final.allocations if a.state == "placed"}
    check_invariants(w.conninfo, w.tenant)


def test_a_gang_in_a_lease_pool_places_inline_and_twins_of_its_key_make_one(bare: World) -> None:
    bare.pool_id = bare.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=bare.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
    fleet(bare, 4)
    req = bare.create_request(count=8, gang=pb.Gang(size=4, topology_key=FABRIC), key="twin", start=bare.later(2))
    with ThreadPoolExecutor(8) as ex:
        got = [f.result() for f in [ex.submit(bare.user.res, "Create", req) for _ in range(8)]]
    assert len({r.id for r in got}) == 1 and {r.state for r in got} == {"placed"}, {r.state for r in got}
    assert bare.sql("SELECT count(*) FROM allocations a JOIN reservations r ON r.id = a.reservation_id"
                    " WHERE r.tenant_id = %s", (bare.tenant,))[0][0] == 4
    check_invariants(bare.conninfo, bare.tenant)


# Earliest fit stays bounded ----------------------------------------------------------------------

CHECKS = 12  # the budget of the control plane below: a handful of nodes checked at a start


@pytest.fixture
def budgeted(pg_uri: str):
    stack = module_stack(pg_uri, earliest_max_checks=CHECKS)
    server, root = next(stack)
    w = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=256)
    yield w
    w.close()
    next(stack, None)


def staggered(world: World, nodes: int, cycles: int) -> int:
    """`nodes` nodes of 8 GPUs whose 1-GPU bookings of an hour tile the time from a start on (one
    node is always busy), so a gang of all of them fits only after the last; that start."""
    names = []
    for _ in range(nodes):
        name = f"s{random.randrange(10**9)}"
        world.add_node(gpus(name, 8), name=name, labels={"host": name})
        names.append(name)
    t0 = world.later(0.5)
    for k in range(cycles):
        for i, name in enumerate(names):
            r = world.create(count=1, node_selector={"host": name}, start=t0 + (k * nodes + i) * HOUR, duration="1h")
            assert r.state == "placed", r
    return t0 + cycles * nodes * HOUR


def test_an_earliest_gang_search_stops_at_its_budget_of_checks(budgeted: World) -> None:
    """A gang's earliest-fit search checked every ready member again at every booking's end: a pool
    whose bookings keep one node of the group busy at any time (6,400 bookings on 64 nodes: 2 s of
    the event loop, linear in the bookings) held the control plane for as long as the pool had
    bookings. The search now stops after `earliest_max_checks` node checks, answering no start."""
    w = budgeted
    first = staggered(w, 4, 3)
    single = preview(w, count=8, start_earliest=True, horizon_ms=2 * DAY)  # one node: a few checks
    assert single.fits
    out = preview(w, count=8, gang=pb.Gang(size=4), start_earliest=True, horizon_ms=2 * DAY)
    assert not out.fits and "nothing fits within the horizon" in out.reason, (out.start, first, out.reason)
    r = w.create(count=8, gang=pb.Gang(size=4), start_earliest=True, horizon_ms=2 * DAY)
    assert r.state == "pending"  # no start chosen: pending like any request nothing fits
    check_invariants(w.conninfo, w.tenant)


@pytest.mark.parametrize("round_", range(3))
def test_a_pending_gang_cancelled_while_a_release_wakes_it_is_placed_or_cancelled_whole(
    bare: World, round_: int
) -> None:
    fleet(bare, 2)
    holder = gang_create(bare, 2)
    waiting = gang_create(bare, 2)
    assert (holder.state, waiting.state) == ("placed", "pending")
    res = bare.user.res
    with ThreadPoolExecutor(2) as ex:
        calls = [lambda: res("Release", pb.ReleaseReservationRequest(tenant_id=bare.tenant, reservation_id=holder.id)),
                 lambda: res("Cancel", pb.CancelReservationRequest(tenant_id=bare.tenant, reservation_id=waiting.id))]
        random.shuffle(calls)
        for f in [ex.submit(c) for c in calls]:
            try:
                f.result()
            except grpc.RpcError as exc:
                assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc
    final = get(bare, waiting.id)
    left = live_allocs(bare, waiting.id)
    assert (final.state, len(left)) in (("cancelled", 0), ("placed", 2), ("binding", 2), ("active", 2)), final
    check_invariants(bare.conninfo, bare.tenant)


def test_preview_of_a_gang_on_an_impossible_model_or_key_answers_why_and_books_nothing(bare: World) -> None:
    fleet(bare, 3)
    for kw in [{"model": "NOPE"}, {"gang": pb.Gang(size=64, topology_key=FABRIC)}]:
        kw.setdefault("gang", pb.Gang(size=2))
        out = preview(bare, count=8, start_earliest=True, horizon_ms=60 * DAY, **kw)
        assert not out.fits and out.reason and not out.members
    assert bare.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (bare.tenant,))[0][0] == 0


def test_gangs_and_single_creates_stormed_on_a_lease_pool_keep_the_invariants(bare: World) -> None:
    bare.pool_id = bare.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=bare.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
    fleet(bare, 4)
    bare.quota(48)
    start = bare.later(2)

    def one(i: int):
        try:
            if i % 3 == 0:
                r = gang_create(bare, 2, start=start)
            else:
                r = bare.create(count=4, start=start, wait=pb.Wait(timeout_ms=10_000))
            if i % 4 == 0:
                bare.user.res("Cancel", pb.CancelReservationRequest(tenant_id=bare.tenant, reservation_id=r.id))
            return r.state
        except grpc.RpcError as exc:
            assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc
            return exc.code().name

    with ThreadPoolExecutor(8) as ex:
        outcomes = list(ex.map(one, range(16)))
    assert "placed" in outcomes, outcomes
    check_invariants(bare.conninfo, bare.tenant)


# A node lease as a gang --------------------------------------------------------------------------


def test_a_node_lease_gang_is_charged_as_the_gang_and_never_booked_as_one_machine(bare: World) -> None:
    """A `binding: node` create with a gang of 4 was once accepted, charged 4 machines' GPUs and
    placed (or previewed) on ONE machine: whole-machine placement ignored the gang. Node-lease gangs
    are served now (tests/test_node_lease_gang.py); in a pool without 4 leasable machines the gang
    is pending, charged as the whole gang, with no allocation, and the preview does not fit."""
    from tests.test_node_profiles import register

    bare.pool_id = bare.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=bare.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(tenant_root=True))).id
    profile = register(bare.root, 1)
    kw = {"binding": "node", "node": pb.NodeLease(profile_id=profile), "gang": pb.Gang(size=4), "duration": "8h"}
    r = bare.create(count=8, **kw)
    assert r.state == "pending" and not r.allocations
    assert r.conditions[0].message.startswith("no gang of 4 nodes fits in the pool")
    charged = bare.sql("SELECT sum(amount) FROM quota_charges WHERE reservation_id = %s AND resource = 'gpu'", (r.id,))
    assert charged == [(32,)]
    seen = preview(bare, count=8, **kw)
    assert not seen.fits and not seen.members
    check_invariants(bare.conninfo, bare.tenant)


def test_a_pending_calendar_gang_placed_after_its_start_books_the_full_duration_from_then(
    clock_world: World,
) -> None:
    w = clock_world
    w.sql("UPDATE nodes SET state = 'cordoned' WHERE pool_id = %s", (w.pool_id,))
    fleet(w, 2)
    blocker = gang_create(w, 2, duration="4h")
    start = w.later(1)
    r = gang_create(w, 2, start=start, duration="1h")
    assert (blocker.state, r.state) == ("placed", "pending")
    w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=2 * HOUR))
    w.user.res("Release", pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=blocker.id))
    deadline = time.monotonic() + 15
    while (got := get(w, r.id)).state == "pending":
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    assert got.during.start >= start + HOUR and got.during.end - got.during.start == HOUR, got.during
    assert len(live_allocs(w, r.id)) == 2
    check_invariants(w.conninfo, w.tenant)


def test_gangs_racing_for_the_same_nodes_place_whole_or_not_at_all(bare: World) -> None:
    fleet(bare, 5)
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda _: gang_create(bare, 2, start=bare.later(1)), range(8)))
    states = sorted(r.state for r in got)
    assert states.count("placed") == 2 and states.count("pending") == 6, states
    for r in got:
        assert len(live_allocs(bare, r.id)) == (2 if r.state == "placed" else 0), r.id
    check_invariants(bare.conninfo, bare.tenant)


def _booking_index_loops(plan: dict) -> int:
    """The loops of every scan of the bookings table in an EXPLAIN (ANALYZE, FORMAT JSON) plan."""
    own = plan.get("Actual Loops", 0) if plan.get("Relation Name") == "bookings" else 0
    return own + sum(_booking_index_loops(p) for p in plan.get("Plans", []))


def test_the_timeline_reads_each_gpus_bookings_once_not_once_per_bucket(bare: World) -> None:
    """capacity.timeline probed the bookings of every GPU of the pool once per bucket: at the
    documented bound of 336 buckets, 300 idle 8-GPU nodes took 0.7 s of PostgreSQL per call (about
    2.3 s at 1,000 nodes), with nothing booked. The bookings overlapping the span are now read
    once and spread over the buckets they touch; the answer is unchanged."""
    from controlplane import capacity as cap

    fleet(bare, 2)
    now = bare.later(0)
    base = now - now % HOUR + HOUR
    bare.create(count=3, start=base + 10 * 60_000, duration="50m")  # inside one hourly bucket
    bare.create(count=2, start=base + 90 * 60_000, duration="2h")  # from mid-bucket across two more
    out = timeline(bare, **{"from": base, "to": base + 5 * HOUR + 30 * 60_000, "step_minutes": 60})
    assert [(b.start - base, b.end - base, b.booked) for b in out.buckets] == [
        (0, HOUR, 3), (HOUR, 2 * HOUR, 2), (2 * HOUR, 3 * HOUR, 2), (3 * HOUR, 4 * HOUR, 2),
        (4 * HOUR, 5 * HOUR, 0), (5 * HOUR, 5 * HOUR + 30 * 60_000, 0)]
    assert all(b.free == out.allocatable - b.booked for b in out.buckets) and out.allocatable == 16
    params = {"pool_id": bare.pool_id, "from": base, "to": base + 28 * HOUR, "step": 5 * 60_000}
    ((plan,),) = bare.sql("EXPLAIN (ANALYZE, FORMAT JSON) " + cap._BUCKETS, params)
    assert _booking_index_loops(plan[0]["Plan"]) <= 16  # once per GPU at most, not 336 times


def test_an_earliest_gang_in_a_lease_pool_places_inline_at_the_first_free_start(bare: World) -> None:
    bare.pool_id = bare.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=bare.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
    fleet(bare, 2)
    blocker = gang_create(bare, 2, duration="2h")
    assert blocker.state == "placed"
    r = bare.create(count=8, gang=pb.Gang(size=2), start_earliest=True, horizon_ms=DAY)
    assert r.state == "placed" and r.during.start == blocker.during.end, (r.state, r.during, blocker.during)
    assert len(live_allocs(bare, r.id)) == 2
    check_invariants(bare.conninfo, bare.tenant)


def test_an_invisible_pool_and_a_pool_that_does_not_exist_are_the_same_not_found(bare: World, stack) -> None:
    server, root = stack
    other = make_world(server.endpoint, root, server.conninfo, nodes=1)
    try:
        ghost = "pool_" + "0" * 26
        for call, kw in [(preview, {"count": 1}), (preview, {"count": 8, "gang": pb.Gang(size=2)}),
                         (preview, {"count": 1, "start_earliest": True}), (timeline, {})]:
            seen = []
            for pool_id in (other.pool_id, ghost):
                with pytest.raises(grpc.RpcError) as exc:
                    call(bare, pool_id=pool_id, **kw)
                code, reason, details = rpc_error(exc)
                details.pop("poolId", None)
                seen.append((code, reason, details, exc.value.details().replace(pool_id, "<pool>")))
            assert seen[0] == seen[1], seen
    finally:
        other.close()


def test_a_regular_create_that_preempts_one_member_of_a_spot_gang_cuts_every_member(bare: World) -> None:
    fleet(bare, 2)
    spot = gang_create(bare, 2, spot=True, duration="8h")
    assert spot.state == "placed"
    regular = bare.create(count=8, duration="1h")
    assert regular.state == "placed", regular
    ends = {end for _, end in live_allocs(bare, spot.id)}
    assert len(live_allocs(bare, spot.id)) == 2 and len(ends) == 1, live_allocs(bare, spot.id)
    assert ends == {regular.during.start}, (ends, regular.during)
    check_invariants(bare.conninfo, bare.tenant)


# A gang's remembered plans --------------------------------------------------------------------


def test_a_mig_gang_books_instances_of_its_own_profile_after_a_gang_of_another(bare: World) -> None:
    """Gang planning remembers the plan of an idle node per node and shape, but the shape left out
    the device class and MIG profile: after a gang of one 3g.40gb instance per node, a gang of one
    7g.80gb instance per node was handed the remembered 3g.40gb instances of the same idle nodes."""
    from controlplane.nodes import inventory
    from tests.test_pki import arun
    from tests.test_shared_gpus import _mig_inventory, shared_pool

    shared_pool(bare, "mig", nodes=0)
    for _ in range(2):
        name = f"m{random.randrange(10**9)}"
        node = bare.add_node(gpus(name, count=2))
        first, second = (g.uuid for g in gpus(name, count=2))
        inv = _mig_inventory(2, {first: [(1, "3g.40gb"), (2, "3g.40gb")], second: [(0, "7g.80gb")]})
        arun(bare.conninfo, lambda pool, node_id=node.id, inv=inv: inventory.apply_inventory(pool, node_id, inv))
    small = bare.create(device_class="gpu.mig", count=1, profile="3g.40gb", gang=pb.Gang(size=2),
                        start=bare.later(1))
    big = bare.create(device_class="gpu.mig", count=1, profile="7g.80gb", gang=pb.Gang(size=2),
                      start=bare.later(3))
    assert (small.state, big.state) == ("placed", "placed")

    def profiles(rid: str) -> list[str]:
        return sorted(p for (p,) in bare.sql(
            "SELECT t.profile FROM bookings b JOIN atoms t ON t.id = b.atom_id JOIN allocations a"
            " ON a.id = b.allocation_id WHERE a.reservation_id = %s", (rid,)))

    assert profiles(small.id) == ["3g.40gb", "3g.40gb"]
    assert profiles(big.id) == ["7g.80gb", "7g.80gb"]
    check_invariants(bare.conninfo, bare.tenant)


def test_mig_requests_of_each_profile_find_the_one_node_that_has_it(bare: World) -> None:
    from controlplane.nodes import inventory
    from tests.test_pki import arun
    from tests.test_shared_gpus import _mig_inventory, shared_pool

    shared_pool(bare, "mig", nodes=0)
    layouts = [[(1, "3g.40gb"), (2, "3g.40gb")], [(0, "7g.80gb")], [(k, "1g.10gb") for k in range(7, 14)]]
    for layout in layouts:
        name = f"m{random.randrange(10**9)}"
        node = bare.add_node(gpus(name, count=1))
        inv = _mig_inventory(2, {gpus(name, count=1)[0].uuid: layout})
        arun(bare.conninfo, lambda pool, node_id=node.id, inv=inv: inventory.apply_inventory(pool, node_id, inv))
    for profile, count in (("7g.80gb", 1), ("1g.10gb", 7), ("3g.40gb", 2)):
        r = bare.create(device_class="gpu.mig", count=count, profile=profile, start=bare.later(1))
        assert r.state == "placed", (profile, r)
        got = {p for (p,) in bare.sql("SELECT t.profile FROM bookings b JOIN atoms t ON t.id = b.atom_id"
                                      " JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = %s",
                                      (r.id,))}
        assert got == {profile}
    # (check_invariants counts charges in whole GPUs: a MIG pool charges GPU equivalents.)
    assert bare.sql("SELECT count(*) FROM bookings b1 JOIN bookings b2 ON b2.atom_id = b1.atom_id"
                    " AND b2.ctid <> b1.ctid AND b2.during && b1.during") == [(0,)]
