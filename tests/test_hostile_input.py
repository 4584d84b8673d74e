"""A hostile tenant against the reservation API: absurd inputs, idempotency abuse and lifecycle
races, through the real gRPC API. Each test here was an attack that broke a promise before its
fix (DESIGN.md sections 6, 7a, 8 and 10; spec "Reservations")."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import reservations_pb2_grpc
from controlplane import bootstrap
from controlplane.config import Settings
from tests.conftest import clone_database
from tests.invariants import check_invariants
from tests.promise_support import pool_locked
from tests.support import Client, ServerThread, World, get, invalid, make_world, refused, rpc_error


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


# Strings ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool_id", ["not-a-pool", "pool_\u0430" * 2, "POOL_" + "0" * 26, "pool_" + "0" * 26 + "\n"],
                         ids=ascii)
def test_a_list_filtered_by_a_pool_id_that_is_no_pool_id_is_invalid_input(world: World, pool_id: str) -> None:
    world.create(start=world.later(2))
    invalid("poolId", world.user.res, "List", pb.ListReservationsRequest(tenant_id=world.tenant, pool_id=pool_id))
    listed = world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, pool_id=world.pool_id))
    assert len(listed.items) == 1


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


def holds(world: World, rid: str) -> int:
    return world.sql("SELECT count(*) FROM extend_holds WHERE reservation_id = %s", (rid,))[0][0]


def until_staged(world: World, rid: str) -> None:
    """Until the extend's transaction 1 committed its hold (its transaction 2 comes next)."""
    deadline = time.monotonic() + 15
    while not holds(world, rid):
        assert time.monotonic() < deadline, "the extend never staged its change"
        time.sleep(0.02)


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


@pytest.mark.parametrize("passed", ["window-ended", "lease-lapsed"])
def test_a_reservation_past_its_end_or_lapsed_lease_cannot_be_extended_back_to_life(unhandled: World,
                                                                                    passed: str) -> None:
    w = unhandled
    lease = {"lease_seconds": 60} if passed == "lease-lapsed" else {}
    r = w.create(count=2, duration="1h", **lease)
    advance(w, 61_000 if lease else 3_600_000 + 1_000)  # passed; the reconciler has not released it yet
    for change in ({"by": "1h"}, {"until": r.during.end + 3_600_000}):
        code, reason, details = refused(extend, w, r.id, **change)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE"), details
        assert details["reason"] == passed and details["reservationId"] == r.id, details
    assert get(w, r.id).during == r.during
    booked = w.sql("SELECT max(epoch_ms(upper(b.during))) FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
                   " WHERE a.reservation_id = %s", (r.id,))[0][0]
    assert booked == r.during.end
    assert holds(w, r.id) == 0
    check_invariants(w.conninfo, w.tenant)


def test_an_end_that_passes_while_the_extension_is_decided_is_not_extended_past(unhandled: World) -> None:
    w = unhandled
    r = w.create(count=2, duration="1h")
    with ThreadPoolExecutor(1) as pool, pool_locked(w):
        pending = pool.submit(refused, extend, w, r.id, by="1h")
        until_staged(w, r.id)  # transaction 2 waits for the test's pool lock
        advance(w, 3_600_000 + 1_000)
    code, reason, details = pending.result(timeout=30)
    assert (code, reason, details["reason"]) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE",
                                                 "window-ended"), details
    assert get(w, r.id).during == r.during
    assert holds(w, r.id) == 0
    check_invariants(w.conninfo, w.tenant)


def test_an_extend_whose_client_went_away_does_not_keep_the_slot(world: World) -> None:
    r = world.create(count=2, start=world.later(2))
    stub = reservations_pb2_grpc.ReservationsStub(world.user.channel)
    with pool_locked(world):
        gone = stub.Extend.future(pb.ExtendReservationRequest(
            tenant_id=world.tenant, reservation_id=r.id, idempotency_key="gone", by="1h"),
            metadata=world.user.metadata, timeout=60)
        until_staged(world, r.id)  # transaction 2 waits for the test's pool lock
        gone.cancel()  # the client goes away
        assert gone.cancelled()
    deadline = time.monotonic() + 15
    while holds(world, r.id):
        assert time.monotonic() < deadline, "the slot stayed held after the client went away"
        time.sleep(0.05)
    assert world.sql("SELECT pending FROM authz_projection WHERE reservation_id = %s", (r.id,))[0][0] is None
    assert extend(world, r.id, by="1h").extended  # not CONFLICT extend-in-flight for a minute
    check_invariants(world.conninfo, world.tenant)


# Idempotency: concurrent twins of one key -------------------------------------------------------


def waiting_for_locks(world: World, n: int) -> None:
    """Until `n` sessions of the world's database wait for a row lock (the positive signal that
    the twins are queued behind the test's lock)."""
    deadline = time.monotonic() + 15
    while world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()")[0][0] < n:
        assert time.monotonic() < deadline, "the twins never queued behind the lock"
        time.sleep(0.02)


def twins(world: World, client: Client, req: pb.CreateReservationRequest, policy: str, n: int = 4) -> set[tuple]:
    """`n` creates of one key decided at once under `policy`: the draft is left by a refused quota
    charge, the test holds its row while the twins take their decisions, then lets them race for it."""
    world.quota(0)
    assert refused(client.res, "Create", req)[1] == "QUOTA_EXCEEDED"  # the draft stays a draft
    world.quota(64)
    world.policy(policy)
    rid = world.sql("SELECT id FROM reservations WHERE tenant_id = %s AND idempotency_key = %s",
                    (world.tenant, req.idempotency_key))[0][0]
    with psycopg.connect(world.conninfo) as conn, ThreadPoolExecutor(n) as pool:
        conn.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (rid,))
        answers = [pool.submit(answer, client.res, "Create", req) for _ in range(n)]
        waiting_for_locks(world, n)
        conn.rollback()
        return {a.result(timeout=30) for a in answers}


def answer(call, *args, **kw) -> tuple:
    """(OK, state) or (gRPC code, spec code, details) of a call."""
    try:
        return grpc.StatusCode.OK, call(*args, **kw).state
    except grpc.RpcError as exc:
        code, reason, details = rpc_error(type("Raised", (), {"value": exc}))
        return code, reason, tuple(sorted(details.items()))


def test_twins_of_a_refused_create_are_all_access_denied(world: World) -> None:
    req = world.create_request(key="deny-twins", count=2)
    answers = twins(world, world.user, req, "permit(principal, action, resource) unless { resource.gpuCount > 1 };")
    assert len(answers) == 1, answers  # not a 200 OK with state denied for the twins
    (code, reason, details), = answers
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED") and dict(details)["reservationId"]
    check_invariants(world.conninfo, world.tenant)
