"""Time: the reconciler, calendar reservations, leases, extend, expiry, BookingRepair, timeline.

The clock is compute_now(); this module's server runs with clock control, and its own database,
so jumping in time here moves nothing elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.reservations import schedule
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, advance_and_settle, poll, pool_locked, settled
from tests.support import clock_now as now
from tests.support import PERMISSIVE, Client, ServerThread, World, get, rpc_error
from tests.support import eventually as _eventually

MIN = 60_000
HOUR = 3_600_000


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def advance(world: World, ms: int) -> None:
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=ms))


def eventually(world: World, rid: str, check, seconds: float = 10) -> pb.Reservation:
    return _eventually(world, rid, check, seconds)


def state_is(*states: str):
    return lambda r: r.state in states


def event_types(world: World, rid: str) -> list[str]:
    return [t for (t,) in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id", (f"reservation/{rid}",))]


def used(world: World) -> int:
    return world.sql("SELECT coalesce(sum(amount), 0) FROM quota_charges WHERE tenant_id = %s"
                     " AND resource = 'gpu' AND refunded_at IS NULL", (world.tenant,))[0][0]


def extend(world: World, rid: str, **change) -> pb.ExtendReservationResponse:
    return world.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=rid, idempotency_key=change.pop("key", "ext"), **change))


# Calendar reservations -------------------------------------------------------------------

def test_a_calendar_reservation_stays_placed_until_its_start_then_binds(world: World) -> None:
    start = now(world) + 2 * HOUR
    r = world.create(count=8, start=start, duration="1h")
    assert r.state == "placed" and r.during.start == start
    assert used(world) == 8  # the charge is held from admission
    # The same atoms serve a reservation that ends before the start: with the other node cordoned,
    # an eight-GPU hour from now can only be on r's GPUs.
    node = r.allocations[0].node_id
    others = [n.id for n in world.nodes if n.id != node]
    for other in others:
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=other, state="cordoned"))
    before = world.create(count=8, duration="1h")
    assert before.state in ("placed", "binding") and before.during.end <= start
    assert before.allocations[0].node_id == node
    assert sorted(before.allocations[0].device_ids) == sorted(r.allocations[0].device_ids)
    atoms = "SELECT b.atom_id FROM bookings b JOIN allocations a ON a.id = b.allocation_id" \
            " WHERE a.reservation_id = %s ORDER BY 1"
    assert world.sql(atoms, (before.id,)) == world.sql(atoms, (r.id,))
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=before.id))
    for other in others:
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=other, state="ready"))
    # Ten minutes before the start its BookingRepair wake-up (start - 15 min) has run: still placed.
    advance_and_settle(world, r.id, HOUR + 50 * MIN)
    assert get(world, r.id).state == "placed"
    generation = world.sql("SELECT desired_generation FROM nodes WHERE id = %s", (node,))[0][0]
    advance(world, 10 * MIN)
    bound = eventually(world, r.id, state_is("binding"))
    assert [a.state for a in bound.allocations] == ["binding"]
    assert world.sql("SELECT desired_generation FROM nodes WHERE id = %s", (node,))[0][0] > generation
    deadline = world.sql("SELECT epoch_ms(bind_deadline) FROM allocations WHERE id = %s",
                         (bound.allocations[0].id,))[0][0]
    assert deadline == start + 5 * MIN
    assert event_types(world, r.id) == ["reservation.placed", "reservation.binding"]
    # The move to binding wakes it at the bind deadline, in the same statement: without that wake-up
    # a node that never reports would hold it binding for ever.
    wakes = world.sql("SELECT epoch_ms(run_at) FROM work_items WHERE subject = %s AND dead_at IS NULL", (r.id,))
    assert deadline in [ms for (ms,) in wakes]


def test_a_placement_wakes_at_the_repair_check_only_while_it_is_ahead(world: World) -> None:
    """The work items of a placement: start - 15 min (BookingRepair's check), start, end and the
    lease deadline. A repair check already past at placement is left out (its pass would find the
    start not reached; the pass at the start checks first): one pass fewer for a start within 15
    minutes."""
    def wakes(rid: str) -> list[int]:
        return [ms for (ms,) in world.sql("SELECT epoch_ms(run_at) FROM work_items WHERE subject = %s"
                                          " AND dead_at IS NULL ORDER BY run_at", (rid,))]

    later = world.create(count=1, start=now(world) + 2 * HOUR, duration="1h")
    assert later.state == "placed"
    start = later.during.start
    assert wakes(later.id) == [start - 15 * MIN, start, start + HOUR]
    # The one due at once would be taken by the worker before it could be read here: the list
    # the placement writes from is the place to see it left out.
    t = 10 * HOUR
    assert schedule.booked_moment_list(t, t + HOUR, None, t - 16 * MIN) == [t - 15 * MIN, t, t + HOUR]
    assert schedule.booked_moment_list(t, t + HOUR, t + 5 * MIN, t - 15 * MIN) == [t, t + HOUR, t + 5 * MIN]
    assert schedule.booked_moment_list(t, t + HOUR, None, t + MIN) == [t, t + HOUR]  # a start already passed
    assert schedule.booked_moment_list(t, t + HOUR, None) == [t - 15 * MIN, t, t + HOUR]  # no clock: all


def test_cancel_before_the_start_refunds(world: World) -> None:
    r = world.create(count=4, start=now(world) + HOUR)
    assert used(world) == 4
    out = world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    assert out.state == "cancelled" and used(world) == 0
    assert world.sql("SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
                     " WHERE a.reservation_id = %s", (r.id,))[0][0] == 0


def test_pending_calendar_retries_for_the_same_start_then_books_from_placement(world: World) -> None:
    start = now(world) + HOUR
    blockers = [world.create(count=8, start=start - 30 * MIN, duration="1h") for _ in range(2)]
    waiting = world.create(count=8, start=start, duration="2h")
    assert waiting.state == "pending"
    world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=blockers[0].id))
    placed = eventually(world, waiting.id, state_is("placed"))
    assert (placed.during.start, placed.during.end) == (start, start + 2 * HOUR)  # same start, still ahead
    late = world.create(count=8, start=now(world) + 10 * MIN, duration="2h")  # blocked by `placed`+blocker
    assert late.state == "pending"
    advance(world, 20 * MIN)  # its start has passed
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=blockers[1].id))
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=placed.id))
    booked = eventually(world, late.id, state_is("placed", "binding"))
    assert booked.during.end - booked.during.start == 2 * HOUR
    assert booked.during.start >= now(world) - 5_000 - 0  # from the moment of placement, not the old start
    assert booked.during.start > late.request.start


# Leases -----------------------------------------------------------------------------------

def test_a_lapsed_lease_releases_with_reason_lease_lapsed(world: World) -> None:
    # A calendar reservation: it stays placed, so only the lease moves it (no bind deadline).
    r = world.create(count=1, lease_seconds=600, duration="8h", start=now(world) + 24 * HOUR)
    advance(world, 5 * MIN)
    renewed = world.user.res("Renew", pb.RenewReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    assert renewed.lease_deadline > r.lease_deadline and renewed.during == r.during
    advance_and_settle(world, r.id, 9 * MIN)  # the first lease deadline's wake-up has run
    assert get(world, r.id).state == "placed"  # renewed: not lapsed yet
    advance(world, 2 * MIN)
    released = eventually(world, r.id, state_is("released"))
    data = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.released'",
                     (f"reservation/{r.id}",))[0][0]
    assert data["reason"] == "lease-lapsed" and released.state == "released"
    assert used(world) == 0


# Expiry -----------------------------------------------------------------------------------

def test_at_the_end_it_is_released_expired_bookings_end_and_quota_refunds(world: World) -> None:
    r = world.create(count=2, duration="1h")
    eventually(world, r.id, state_is("binding"))
    node = r.allocations[0].node_id
    generation = world.sql("SELECT desired_generation FROM nodes WHERE id = %s", (node,))[0][0]
    advance(world, HOUR + 1000)
    done = eventually(world, r.id, state_is("released", "failed"))
    assert done.state == "released"
    assert world.sql("SELECT data->>'reason' FROM events WHERE subject = %s AND type = 'reservation.released'",
                     (f"reservation/{r.id}",)) == [("expired",)]
    assert used(world) == 0
    assert world.sql("SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
                     " WHERE a.reservation_id = %s AND upper(b.during) > compute_now()", (r.id,))[0][0] == 0
    assert world.sql("SELECT desired_generation FROM nodes WHERE id = %s", (node,))[0][0] > generation


# Binding deadline ---------------------------------------------------------------------------

def test_no_bind_report_in_5_minutes_places_again_at_most_twice_then_fails(world: World) -> None:
    world.add_node()  # three nodes: room to move twice
    r = world.create(count=8, duration="8h")
    nodes = []
    for attempt in range(1, 4):
        current = eventually(world, r.id, state_is("binding", "failed"))
        if current.state == "failed":
            break
        nodes.append([a.node_id for a in current.allocations if a.state == "binding"][0])
        advance(world, 5 * MIN + 1000)
        eventually(world, r.id, lambda x, n=attempt: x.state == "failed" or
                   world.sql("SELECT bind_failures FROM reservations WHERE id = %s", (r.id,))[0][0] >= n)
    final = eventually(world, r.id, state_is("failed"))
    assert final.state == "failed" and len(set(nodes)) == 3  # each retry avoided the node that failed
    assert world.sql("SELECT bind_failures FROM reservations WHERE id = %s", (r.id,))[0][0] == 3
    assert used(world) == 0
    types = event_types(world, r.id)
    assert types.count("reservation.placed") == 3 and types[-1] == "reservation.failed"


# Extend -----------------------------------------------------------------------------------

def test_extend_by_and_until_move_the_end(world: World) -> None:
    start = now(world) + HOUR
    r = world.create(count=1, start=start, duration="2h")
    out = extend(world, r.id, by="1h")
    assert out.extended and out.reservation.during.end == start + 3 * HOUR
    out = extend(world, r.id, until=start + 5 * HOUR, key="ext-2")
    assert out.extended and out.reservation.during.end == start + 5 * HOUR
    ends = world.sql("SELECT DISTINCT epoch_ms(upper(b.during)) FROM bookings b JOIN allocations a"
                     " ON a.id = b.allocation_id WHERE a.reservation_id = %s", (r.id,))
    assert ends == [(start + 5 * HOUR,)]
    data = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.extended' ORDER BY id",
                     (f"reservation/{r.id}",))[-1][0]
    assert (data["from"], data["to"]) == (start + 3 * HOUR, start + 5 * HOUR)


def test_an_until_already_reached_answers_false_without_a_decision(world: World) -> None:
    r = world.create(count=1, start=now(world) + HOUR, duration="2h")
    world.policy("forbid(principal, action, resource);")
    try:
        out = extend(world, r.id, until=r.during.end)
        assert not out.extended and out.reservation.during.end == r.during.end
    finally:
        world.policy(PERMISSIVE)


def test_extend_answers_available_until_when_another_booking_starts_first(world: World) -> None:
    for node in world.nodes[1:]:
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node.id, state="cordoned"))
    start = now(world) + HOUR
    first = world.create(count=8, start=start, duration="2h")
    second = world.create(count=8, start=start + 3 * HOUR, duration="1h")
    assert second.state == "placed"
    out = extend(world, first.id, by="2h")
    assert not out.extended and out.available_until == start + 3 * HOUR
    assert get(world, first.id).during.end == start + 2 * HOUR  # nothing moved
    assert world.sql("SELECT count(*) FROM extend_holds WHERE reservation_id = %s", (first.id,))[0][0] == 0


def test_extend_is_bounded_by_the_policy_on_the_total_duration(world: World) -> None:
    r = world.create(count=1, start=now(world) + HOUR, duration="8h")
    world.policy('permit(principal, action, resource) when { !(resource has durationHours) || '
                 'resource.durationHours <= 10 };')
    try:
        assert extend(world, r.id, by="2h").extended
        with pytest.raises(grpc.RpcError) as exc:
            extend(world, r.id, by="1h", key="too-long")
        assert rpc_error(exc)[1] == "ACCESS_DENIED"
        assert world.sql("SELECT pending FROM authz_projection WHERE reservation_id = %s", (r.id,)) == [(None,)]
    finally:
        world.policy(PERMISSIVE)


def test_one_extend_at_a_time_and_a_stale_hold_is_taken_over(world: World) -> None:
    start = now(world) + HOUR
    r = world.create(count=1, start=start, duration="1h")

    def holds() -> list[str]:
        return [h for (h,) in world.sql("SELECT hold FROM extend_holds WHERE reservation_id = %s", (r.id,))]

    with ThreadPoolExecutor(2) as pool:
        with pool_locked(world):  # extends that reach their second transaction wait here
            first = pool.submit(extend, world, r.id, by="1h", key="first")
            [hold] = poll(holds, what="the first extend's hold")
            with pytest.raises(grpc.RpcError) as exc:
                extend(world, r.id, by="1h", key="second")
            code, reason, details = rpc_error(exc)
            assert (code, reason) == (grpc.StatusCode.ABORTED, "CONFLICT")
            assert details["reason"] == "extend-in-flight" and details["retryAfterSeconds"] == "60"
            advance(world, 61_000)
            second = pool.submit(extend, world, r.id, by="2h", key="second")
            poll(lambda: holds() not in ([], [hold]), what="the 61 s old hold taken over")
        assert second.result(30).extended
        with pytest.raises(grpc.RpcError) as exc:
            first.result(30)  # its slot was taken over: it applies nothing
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["reason"]) == (grpc.StatusCode.ABORTED, "CONFLICT", "extend-in-flight")
    assert get(world, r.id).during.end == start + 3 * HOUR  # the second's 2 h only
    assert holds() == [] and world.sql("SELECT pending FROM authz_projection WHERE reservation_id = %s",
                                       (r.id,)) == [(None,)]


def test_extend_needs_exactly_one_of_until_or_by(world: World) -> None:
    r = world.create(count=1, start=now(world) + HOUR)
    with pytest.raises(grpc.RpcError) as exc:
        world.user.res("Extend", pb.ExtendReservationRequest(tenant_id=world.tenant, reservation_id=r.id,
                                                             idempotency_key="x"))
    assert rpc_error(exc)[1] == "INVALID_INPUT"


# BookingRepair ------------------------------------------------------------------------------

@pytest.mark.parametrize("trouble", ["cordon", "quarantine", "unreachable"])
def test_booking_repair_moves_a_future_booking_off_bad_hardware(world: World, trouble: str) -> None:
    start = now(world) + HOUR
    r = world.create(count=4, start=start, duration="1h")
    bad = r.allocations[0].node_id
    if trouble == "cordon":
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=bad, state="cordoned"))
    elif trouble == "quarantine":
        uuid = r.allocations[0].device_ids[0]
        world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=bad, device_uuid=uuid, health="unhealthy"))
    else:
        world.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(node_id=bad,
                                                                               connectivity="unreachable"))
    settled(world, r.id)  # the trouble woke it, and the reconciler has handled that wake-up
    assert get(world, r.id).allocations[-1].node_id == bad  # not before start - 15 min
    assert "reservation.repaired" not in event_types(world, r.id)
    advance(world, 45 * MIN)
    repaired = eventually(world, r.id, lambda x: "reservation.repaired" in event_types(world, r.id))
    assert repaired.state == "placed" and (repaired.during.start, repaired.during.end) == (start, start + HOUR)
    live = [a for a in repaired.allocations if a.state == "placed"]
    assert len(live) == 1 and live[0].node_id != bad
    data = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.repaired'",
                     (f"reservation/{r.id}",))[0][0]
    assert data["from"] == [bad] and data["nodeIds"] == [live[0].node_id]
    assert used(world) == 4  # the charge is kept


def test_booking_repair_with_nowhere_to_go_is_pending_booking_repair_failed(world: World) -> None:
    start = now(world) + HOUR
    r = world.create(count=8, start=start, duration="1h")
    other = next(n.id for n in world.nodes if n.id != r.allocations[0].node_id)
    filler = world.create(count=8, start=start, duration="1h")  # fills the other node for the window
    assert filler.state == "placed" and [a.node_id for a in filler.allocations] == [other]
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=r.allocations[0].node_id, state="cordoned"))
    advance(world, 45 * MIN + 1000)
    pending = eventually(world, r.id, state_is("pending"))
    assert pending.conditions[0].type == "Unschedulable" and pending.conditions[0].reason == "BookingRepairFailed"
    assert used(world) == 16
    assert [a.node_id for a in get(world, filler.id).allocations if a.state == "placed"] == [other]
    # Freed capacity retries it at once; still nothing fits, and it keeps the reason it went
    # pending for: the retry only rewrites the message (from the repair's own to the placer's).
    brief = world.create(count=1, duration="1m")
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=brief.id))
    retried = eventually(world, r.id, lambda x: not x.conditions[0].message.startswith("booking repair"))
    assert retried.state == "pending" and retried.conditions[0].reason == "BookingRepairFailed"


# Confirmation deadline -----------------------------------------------------------------------

def test_the_reconciler_expires_an_unconfirmed_request_at_its_deadline(world: World) -> None:
    world.policy("permit(principal, action, resource) unless { context.delegated };")
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                              confirm_actions=["compute:reservations:create"])
    with pytest.raises(grpc.RpcError) as exc:
        world.create(agent, key="agent-slow", count=1)
    rid = rpc_error(exc)[2]["reservationId"]
    advance(world, 31 * MIN)
    expired = eventually(world, rid, state_is("expired"))
    assert expired.operation.state == "failed"
    world.policy(PERMISSIVE)


# Timeline -----------------------------------------------------------------------------------

def timeline(world: World, **kw) -> cpb.TimelineResponse:
    stub = capacity_pb2_grpc.CapacityStub(world.user.channel)
    return stub.Timeline(cpb.TimelineRequest(tenant_id=world.tenant, pool_id=world.pool_id, **kw),
                         metadata=world.user.metadata, timeout=30)


def test_timeline_counts_booked_and_free_gpus_per_bucket(world: World) -> None:
    base = now(world)
    hour0 = base - base % HOUR + HOUR
    world.create(count=3, start=hour0, duration="2h")
    world.create(count=2, start=hour0 + 90 * MIN, duration="5m")  # five minutes count for the hour
    out = timeline(world, **{"from": hour0, "to": hour0 + 4 * HOUR})
    assert out.allocatable == 16
    assert [(b.booked, b.free) for b in out.buckets] == [(3, 13), (5, 11), (0, 16), (0, 16)]
    assert [b.start for b in out.buckets] == [hour0 + i * HOUR for i in range(4)]


def test_timeline_defaults_and_limits(world: World) -> None:
    base = now(world)
    out = timeline(world)
    assert len(out.buckets) == 24 and out.buckets[0].start == base - base % HOUR
    for kw in ({"step_minutes": 4}, {"step_minutes": 1441}, {"from": base, "to": base + 8 * 24 * HOUR},
               {"from": base, "to": base}, {"from": base, "to": base + 7 * 24 * HOUR, "step_minutes": 5}):
        with pytest.raises(grpc.RpcError) as exc:
            timeline(world, **kw)
        assert rpc_error(exc)[1] == "INVALID_INPUT", kw
    assert len(timeline(world, **{"from": base, "to": base + 7 * 24 * HOUR, "step_minutes": 30}).buckets) == 336


# Active reservations and node trouble -------------------------------------------------------

def test_an_unreachable_node_only_raises_a_condition_on_an_active_reservation(world: World) -> None:
    r = world.create(count=2, duration="8h")
    active = SigningNodes(world).activate(r.id)  # the node's signed AllocationBound, through the gateway
    assert active.binding.attested
    node = active.allocations[-1].node_id
    world.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(node_id=node, connectivity="unreachable"))
    degraded = eventually(world, r.id, lambda x: any(c.type == "NodeUnreachable" for c in x.conditions))
    assert degraded.state == "active" and used(world) == 2
    advance_and_settle(world, r.id, 20 * MIN)  # the 15-minute recheck has run, and never releases it
    rechecked = get(world, r.id)
    assert rechecked.state == "active" and any(c.type == "NodeUnreachable" for c in rechecked.conditions)
    world.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(node_id=node, connectivity="connected"))
    healed = eventually(world, r.id, lambda x: not any(c.type == "NodeUnreachable" for c in x.conditions))
    assert healed.state == "active"
    check_invariants(world.conninfo, world.tenant)
