"""Renew and cancel of a started reservation (spec "Start, lease, extend and release"): renew moves
the lease to now plus leaseSeconds without touching during, in binding and active too; cancel
withdraws only what has not started, so a binding or active reservation is INVALID_STATE."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, advance_and_settle, wake_up_times
from tests.support import clock_now as now
from tests.support import Client, ServerThread, World, eventually, get, rpc_error

MIN = 60_000


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def started(world: World, state: str, **kw) -> pb.Reservation:
    r = world.create(count=2, duration="8h", **kw)
    if state == "active":
        return SigningNodes(world).activate(r.id)
    return eventually(world, r.id, lambda x: x.state == "binding")


def used(world: World) -> int:
    return world.sql("SELECT coalesce(sum(amount), 0) FROM quota_charges WHERE tenant_id = %s"
                     " AND resource = 'gpu' AND refunded_at IS NULL", (world.tenant,))[0][0]


@pytest.mark.parametrize("state", ["binding", "active"])
def test_cancel_of_a_started_reservation_is_invalid_state(world: World, state: str) -> None:
    r = started(world, state)
    with pytest.raises(grpc.RpcError) as exc:
        world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
    assert details["state"] == state and details["reservationId"] == r.id
    after = get(world, r.id)
    assert after.state == state and after.during == r.during and used(world) == 2
    assert "reservation.cancelled" not in [t for (t,) in world.sql(
        "SELECT type FROM events WHERE subject = %s", (f"reservation/{r.id}",))]
    check_invariants(world.conninfo, world.tenant)


@pytest.mark.parametrize("state", ["binding", "active"])
def test_renew_in_binding_and_active_moves_the_lease_and_keeps_it_alive(world: World, state: str) -> None:
    r = started(world, state, lease_seconds=600)
    first_deadline = r.lease_deadline
    assert first_deadline > 0
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=3 * MIN))  # inside the 5-minute bind timeout
    renewed = world.user.res("Renew", pb.RenewReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    at = now(world)
    assert renewed.state == state and renewed.during == r.during
    assert at + 600_000 - 5_000 <= renewed.lease_deadline <= at + 600_000  # now plus leaseSeconds
    assert renewed.lease_deadline > first_deadline
    assert renewed.lease_deadline in wake_up_times(world, r.id)
    if state == "active":
        # Past the first deadline, its wake-up has run: renewed, so still active.
        advance_and_settle(world, r.id, first_deadline - now(world) + 1000)
        assert get(world, r.id).state == "active"
        world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=renewed.lease_deadline - now(world) + 1000))
        lapsed = eventually(world, r.id, lambda x: x.state == "released")
        assert world.sql("SELECT data->>'reason' FROM events WHERE subject = %s AND type = 'reservation.released'",
                         (f"reservation/{r.id}",)) == [("lease-lapsed",)]
        assert lapsed.during.end == renewed.lease_deadline and used(world) == 0  # ended when it lapsed
    check_invariants(world.conninfo, world.tenant)
