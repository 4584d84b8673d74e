"""Faults against the promise that nothing is lost, double-booked or half-written and that every
call is safe to retry (DESIGN.md sections 2, 8, 11 and 13; spec "Drafts and idempotency", "The
admission sequence"): PostgreSQL ending the control plane's connections (pg_terminate_backend,
as a failover or an operator does) while idle and mid-call, kill -9 of the control plane and of
the gateway with calls and node reports in flight, and Watch streams across a restart. Each test
here was an attack; the ones that broke a promise came with their fix."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from tests.invariants import check_invariants
from tests.support import World, get, refused

WAIT = 30  # seconds: a bound on waiting for a positive signal, never a pause


def until(check: Callable[[], Any], what: str, seconds: float = WAIT) -> Any:
    deadline = time.monotonic() + seconds
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return result


def backends(conninfo: str, where: str = "true") -> list[int]:
    """The pids of the other sessions on this database (the servers'), filtered by `where`."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [pid for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            f" AND backend_type = 'client backend' AND {where}")]


def terminate(conninfo: str, pids: list[int]) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    until(lambda: not set(pids) & set(backends(conninfo)), "the backends to end")


POOLED = "application_name NOT LIKE 'bc-listen:%%'"  # the connection pool's, not a listener's


# -- the connection pool ------------------------------------------------------------------------


def test_pooled_connections_the_server_ended_while_idle_fail_no_call(world: World) -> None:
    """The server ends every pooled connection (a failover, an operator, an idle timeout) while
    nothing runs. Before the fix, each call that drew a dead connection from the pool answered
    INTERNAL (five in a row here) until the pool had discarded them all: the pool now checks a
    connection before lending it."""
    placed = world.create(count=1)
    terminate(world.conninfo, backends(world.conninfo, POOLED))
    for _ in range(20):
        assert get(world, placed.id).id == placed.id
    assert world.create(count=1).state == "placed"
    check_invariants(world.conninfo, world.tenant)


def waiting_on_a_lock(conninfo: str) -> list[int]:
    return backends(conninfo, "wait_event_type = 'Lock'")


@pytest.mark.parametrize("call", ["release", "cancel", "extend", "create"])
def test_a_call_whose_backend_is_ended_mid_call_is_unavailable_and_its_retry_converges(world: World, call: str) -> None:
    """The server ends the backend of a call while it waits on a lock. The caller gets
    UNAVAILABLE (the gRPC code clients retry on, ErrorInfo reason UNAVAILABLE, no internals), not
    INTERNAL, and the same call again succeeds once: nothing was half-written."""
    target = world.create(count=2, start=world.later(2))
    requests: dict[str, Callable[[], Any]] = {
        "release": lambda: world.user.res("Release", pb.ReleaseReservationRequest(
            tenant_id=world.tenant, reservation_id=target.id)),
        "cancel": lambda: world.user.res("Cancel", pb.CancelReservationRequest(
            tenant_id=world.tenant, reservation_id=target.id)),
        "extend": lambda: world.user.res("Extend", pb.ExtendReservationRequest(
            tenant_id=world.tenant, reservation_id=target.id, until=target.during.end + 3_600_000,
            idempotency_key="ext-1")),
        "create": lambda: world.user.res("Create", create),
    }
    create = world.create_request(key="mid-call", count=1)
    answer: dict[str, Any] = {}
    with psycopg.connect(world.conninfo) as holder:
        # Hold what the call needs next: the reservation's row, or (a create) the pool's lock.
        if call == "create":
            holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("pool:" + world.pool_id,))
        else:
            holder.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (target.id,))
        thread = threading.Thread(target=lambda: answer.update(refused=refused(requests[call])))
        thread.start()
        [blocked] = until(lambda: waiting_on_a_lock(world.conninfo), "the call to wait on the lock")
        terminate(world.conninfo, [blocked])
        thread.join(WAIT)
        holder.rollback()
    code, reason, details = answer["refused"]
    assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"), details
    assert "requestId" in details and "retryAfterSeconds" in details
    again = requests[call]()
    if call == "release":
        assert again.state == "released"
    elif call == "cancel":
        assert again.state == "cancelled"
    elif call == "extend":
        assert again.extended and again.reservation.during.end == target.during.end + 3_600_000
    else:
        assert again.state == "placed" and world.sql("SELECT count(*) FROM reservations WHERE id = %s",
                                                      (again.id,)) == [(1,)]
    check_invariants(world.conninfo, world.tenant)
