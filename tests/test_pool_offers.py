"""An operator takes a pool's offer back (Admin.WithdrawPoolOffer): from then on the tenant sees
the pool no more (create, preview, timeline: NOT_FOUND) and extends nothing on it; what it booked
before runs its course. The owner cannot lose its own pool, and a live grant keeps the offer
(tests/test_grants.py)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import Client, World, offered_guest, rpc_error


@pytest.fixture
def guest(world: World) -> Iterator[World]:
    """A second tenant the world's pool is offered to."""
    other = offered_guest(world)
    try:
        yield other
    finally:
        other.close()


def withdraw(root: Client, pool_id: str, tenant_id: str) -> apb.Pool:
    return root.admin("WithdrawPoolOffer", apb.WithdrawPoolOfferRequest(pool_id=pool_id, tenant_id=tenant_id))


def refused(call) -> tuple:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return rpc_error(exc)


def test_a_withdrawn_offer_hides_the_pool_and_keeps_what_was_booked(world: World, guest: World) -> None:
    later = guest.later(2)
    booked = guest.create(count=2, start=later, duration="1h")
    assert booked.state == "placed"

    pool = withdraw(world.root, world.pool_id, guest.tenant)
    assert guest.tenant not in pool.offered_to
    assert withdraw(world.root, world.pool_id, guest.tenant) == pool  # again: nothing changes

    code, reason, details = refused(lambda: guest.create(count=1))
    assert (code, reason, details["poolId"]) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", world.pool_id)
    stub = capacity_pb2_grpc.CapacityStub(guest.user.channel)
    assert refused(lambda: stub.Preview(guest.create_request(count=1), metadata=guest.user.metadata,
                                        timeout=30))[1] == "NOT_FOUND"
    assert refused(lambda: stub.Timeline(cpb.TimelineRequest(tenant_id=guest.tenant, pool_id=world.pool_id),
                                         metadata=guest.user.metadata, timeout=30))[1] == "NOT_FOUND"

    # What it booked before stays booked and readable; extending it books more: refused.
    got = guest.user.res("Get", pb.GetReservationRequest(tenant_id=guest.tenant, reservation_id=booked.id))
    assert got.state == "placed" and got.during == booked.during
    code, reason, details = refused(lambda: guest.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=guest.tenant, reservation_id=booked.id, idempotency_key="ext", by="1h")))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
    assert (details["reason"], details["poolId"], details["reservationId"]) == (
        "pool-withdrawn", world.pool_id, booked.id)
    assert guest.user.res("Get", pb.GetReservationRequest(tenant_id=guest.tenant, reservation_id=booked.id)
                          ).during == booked.during
    assert world.sql("SELECT count(*) FROM extend_holds WHERE reservation_id = %s", (booked.id,)) == [(0,)]
    # An until it already reaches changes nothing and still answers.
    same = guest.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=guest.tenant, reservation_id=booked.id, idempotency_key="ext-same", until=booked.during.end))
    assert not same.extended
    # It can still be released (its quota refunded).
    assert guest.user.res("Release", pb.ReleaseReservationRequest(
        tenant_id=guest.tenant, reservation_id=booked.id)).state in ("released", "cancelled")

    # The owner is not touched; offered again, the guest books again.
    assert world.create(count=1).state == "placed"
    world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
    assert guest.create(count=1).state == "placed"


def test_withdrawing_names_what_is_wrong(world: World, guest: World) -> None:
    root = world.root
    code, reason, details = refused(lambda: withdraw(root, "pool_00000000000000000000000000", guest.tenant))
    assert (code, reason, details["poolId"]) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND",
                                                 "pool_00000000000000000000000000")
    code, reason, details = refused(lambda: withdraw(root, world.pool_id, "nobody-here"))
    assert (reason, details["tenantId"]) == ("NOT_FOUND", "nobody-here")
    code, reason, details = refused(lambda: withdraw(root, world.pool_id, world.tenant))  # the owner
    assert (reason, details["field"], details["poolId"]) == ("INVALID_INPUT", "tenantId", world.pool_id)
    assert world.create(count=1).state == "placed"
    for pool_id, tenant_id, field in (("not a pool", guest.tenant, "poolId"), (world.pool_id, "", "tenantId"),
                                      (world.pool_id, "x" * 10_000, "tenantId")):
        code, reason, details = refused(lambda: withdraw(root, pool_id, tenant_id))
        assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", field)
    # Only root: a tenant's user cannot take an offer back (not even its own tenant's).
    assert refused(lambda: withdraw(guest.user, world.pool_id, guest.tenant))[1] in (
        "ACCESS_DENIED", "UNAUTHENTICATED")
    assert guest.create(count=1).state == "placed"  # still offered
