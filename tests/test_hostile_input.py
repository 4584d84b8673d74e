"""A hostile tenant against the reservation API: absurd inputs, idempotency abuse and lifecycle
races, through the real gRPC API. Each test here was an attack that broke a promise before its
fix (DESIGN.md sections 6, 7a, 8 and 10; spec "Reservations")."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.config import Settings
from tests.conftest import clone_database
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, get, make_world, rpc_error


def refused(call, *args, **kw) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as exc:
        call(*args, **kw)
    return rpc_error(exc)


def invalid(field: str, call, *args, **kw) -> dict[str, str]:
    code, reason, details = refused(call, *args, **kw)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT"), details
    assert details["field"] == field, details
    return details


def stored(world: World) -> int:
    return world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,))[0][0]


def extend(world: World, rid: str, **change) -> pb.ExtendReservationResponse:
    return world.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=rid, idempotency_key=f"x-{uuid.uuid4().hex[:8]}", **change))


# Durations ------------------------------------------------------------------------------------

# Digits and spaces of other scripts: Python's \d and \s match them and int() reads them, so
# "٨h" (Arabic-Indic eight) was an eight-hour reservation.
NOT_ASCII = ["\u0668h", "\uff18h", "\u0661\u0662h", "8h\u3000", "\u20038h", "\U0001d7d6h"]


@pytest.mark.parametrize("text", NOT_ASCII, ids=ascii)
def test_a_duration_in_digits_or_spaces_of_another_script_is_invalid_input(world: World, text: str) -> None:
    invalid("duration", world.create, duration=text)
    assert stored(world) == 0
    placed = world.create(start=world.later(2))
    invalid("by", extend, world, placed.id, by=text)
    assert world.create(duration=" 8h ", start=world.later(2)).request.duration == "28800000ms"


# Moments that passed before the reconciler handled them ---------------------------------------


@pytest.fixture
def unhandled(pg_uri: str) -> Iterator[World]:
    """A world whose control plane runs no workers and lets the test move compute_now(): a lease
    deadline or an end that passed stays unhandled, as under a work-queue backlog, until the
    reconciler gets to it."""
    conninfo = clone_database(pg_uri)
    server = ServerThread(conninfo, Settings(database_url=conninfo, clock_control=True), workers=False)
    root = Client(server.endpoint, bootstrap.ensure_root(conninfo))
    try:
        w = make_world(server.endpoint, root, conninfo)
        yield w
        w.close()
    finally:
        root.close()
        server.stop()


def advance(world: World, ms: int) -> None:
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=ms))


def renew(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Renew", pb.RenewReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def test_a_lapsed_lease_cannot_be_renewed_back_to_life(unhandled: World) -> None:
    w = unhandled
    r = w.create(count=2, lease_seconds=60, start=w.later(1))
    assert renew(w, r.id).lease_deadline >= r.lease_deadline  # alive: renewable
    deadline = get(w, r.id).lease_deadline
    advance(w, 61_000)  # the lease lapsed; the reconciler has not released it yet
    code, reason, details = refused(renew, w, r.id)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE"), details
    assert details["reason"] == "lease-lapsed" and details["reservationId"] == r.id, details
    assert get(w, r.id).lease_deadline == deadline
    check_invariants(w.conninfo, w.tenant)
