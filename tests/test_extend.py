"""Extend (spec "Start, lease, extend and release"): the node's desired state follows the new end,
one extend at a time under a bounded policy, the abandoned hook after an allow whose handler
fails, a repeated key decides again and a repeated `by` extends from the new end, and a terminal
reservation is INVALID_STATE.

Where two steps must overlap, the test holds the pool's lock itself, so the extend that reached
its second transaction waits there for as long as the test needs, with no timing window."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, desired_state, poll, pool_locked, wake_up_times
from tests.support import clock_now as now
from tests.support import PERMISSIVE, Client, ServerThread, World, eventually, get, rpc_error

HOUR = 3_600_000


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def extend(world: World, rid: str, key: str = "ext", **change) -> pb.ExtendReservationResponse:
    return world.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=rid, idempotency_key=key, **change))


def pending_change(world: World, rid: str) -> dict | None:
    return world.sql("SELECT pending FROM authz_projection WHERE reservation_id = %s", (rid,))[0][0]


def holds(world: World, rid: str) -> list[str]:
    return [h for (h,) in world.sql("SELECT hold FROM extend_holds WHERE reservation_id = %s", (rid,))]


@pytest.mark.parametrize("state", ["binding", "active"])
def test_extending_a_started_reservation_moves_the_until_in_the_nodes_desired_state(
    world: World, state: str
) -> None:
    r = world.create(count=2, duration="2h")
    current = (SigningNodes(world).activate(r.id) if state == "active"
               else eventually(world, r.id, lambda x: x.state == "binding"))
    alloc = current.allocations[0]
    before = desired_state(world, alloc.node_id)
    assert [(a.allocation_id, a.until) for a in before.assignments] == [(alloc.id, r.during.end)]

    out = extend(world, r.id, by="3h")
    assert out.extended and out.reservation.state == state
    assert out.reservation.during.end == r.during.end + 3 * HOUR
    after = desired_state(world, alloc.node_id)
    assert [(a.allocation_id, a.until) for a in after.assignments] == [(alloc.id, r.during.end + 3 * HOUR)]
    assert after.generation > before.generation  # the gateway pushes the new state
    assert r.during.end + 3 * HOUR in wake_up_times(world, r.id)  # the reconciler ends it at the new end
    check_invariants(world.conninfo, world.tenant)


def test_two_extends_racing_for_the_slot_under_a_bounded_policy_never_pass_the_bound(world: World) -> None:
    start = now(world) + HOUR
    r = world.create(count=1, start=start, duration="8h")
    world.policy('permit(principal, action, resource) when { !(resource has durationHours) || '
                 'resource.durationHours <= 11 };')
    try:
        with ThreadPoolExecutor(1) as pool:
            with pool_locked(world):
                first = pool.submit(extend, world, r.id, "ext-a", by="2h")  # 10 h: allowed alone
                hold = poll(lambda: holds(world, r.id), what="the first extend's hold")[0]
                staged = pending_change(world, r.id)
                assert (staged["hold"], staged["durationHours"]) == (hold, 10)
                with pytest.raises(grpc.RpcError) as exc:
                    extend(world, r.id, "ext-b", by="2h")  # 12 h with the first: must never pass
                code, reason, details = rpc_error(exc)
                assert (code, reason) == (grpc.StatusCode.ABORTED, "CONFLICT")
                assert details["reason"] == "extend-in-flight" and details["retryAfterSeconds"] == "60"
                assert pending_change(world, r.id) == staged and holds(world, r.id) == [hold]  # untouched
                assert not first.done()  # still waiting for the pool lock in its second transaction
            assert first.result(30).extended
        assert get(world, r.id).during.end == start + 10 * HOUR
        assert pending_change(world, r.id) is None and holds(world, r.id) == []
        with pytest.raises(grpc.RpcError) as exc:
            extend(world, r.id, "ext-b", by="2h")  # retried alone: decided on the real total, 12 h
        assert rpc_error(exc)[1] == "ACCESS_DENIED"
        assert get(world, r.id).during.end == start + 10 * HOUR
        assert pending_change(world, r.id) is None and holds(world, r.id) == []
    finally:
        world.policy(PERMISSIVE)
    check_invariants(world.conninfo, world.tenant)


def test_a_handler_that_fails_after_an_allow_clears_its_pending_change_through_the_abandoned_hook(
    world: World
) -> None:
    r = world.create(count=1, start=now(world) + HOUR, duration="2h")
    with ThreadPoolExecutor(1) as pool:
        with pool_locked(world):
            ext = pool.submit(extend, world, r.id, "ext", by="1h")
            poll(lambda: holds(world, r.id), what="the extend's hold")
            assert pending_change(world, r.id)["durationHours"] == 3
            # The reservation changes between the extend's transactions.
            released = world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant,
                                                                              reservation_id=r.id))
            assert released.state == "released"
        with pytest.raises(grpc.RpcError) as exc:
            ext.result(30)
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["reason"]) == (grpc.StatusCode.ABORTED, "CONFLICT", "reservation-changed")
    assert pending_change(world, r.id) is None and holds(world, r.id) == []
    assert get(world, r.id).during.end <= released.during.end  # nothing moved
    check_invariants(world.conninfo, world.tenant)


def test_a_repeated_key_decides_again_and_a_repeated_by_extends_from_the_new_end(world: World) -> None:
    start = now(world) + HOUR
    r = world.create(count=1, start=start, duration="2h")
    assert extend(world, r.id, "same", by="1h").reservation.during.end == start + 3 * HOUR
    world.policy("forbid(principal, action, resource);")
    try:
        with pytest.raises(grpc.RpcError) as exc:
            extend(world, r.id, "same", by="1h")  # no stored answer replayed: IAM decides again
        assert rpc_error(exc)[1] == "ACCESS_DENIED"
    finally:
        world.policy(PERMISSIVE)
    again = extend(world, r.id, "same", by="1h")
    assert again.extended and again.reservation.during.end == start + 4 * HOUR  # from the new end
    types = [t for (t,) in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id",
                                     (f"reservation/{r.id}",))]
    assert types.count("reservation.extended") == 2
    check_invariants(world.conninfo, world.tenant)


@pytest.mark.parametrize("end", ["Release", "Cancel"])
def test_extending_a_terminal_reservation_is_invalid_state(world: World, end: str) -> None:
    r = world.create(count=1, start=now(world) + HOUR, duration="2h")
    request = (pb.ReleaseReservationRequest if end == "Release" else pb.CancelReservationRequest)(
        tenant_id=world.tenant, reservation_id=r.id)
    state = world.user.res(end, request).state
    assert state == {"Release": "released", "Cancel": "cancelled"}[end]
    for change in ({"by": "1h"}, {"until": r.during.end + HOUR}):
        with pytest.raises(grpc.RpcError) as exc:
            extend(world, r.id, **change)
        code, reason, details = rpc_error(exc)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
        assert details["state"] == state and details["reservationId"] == r.id
    assert pending_change(world, r.id) is None and holds(world, r.id) == []
    assert get(world, r.id).state == state
