"""Leftovers around the surface: the bearer token kept out of argv (BC_TOKEN, --token-file) for the
CLI and the MCP server, tenant ids that would read as tokens, and a release racing the reconciler's
expiry of a confirmation (one lock order: the reservation's row, then its confirmation)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from structlog.testing import capture_logs

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.support import World, clock_now, make_world, refused

SECOND = 1000
AGENT_POLICY = "permit(principal, action, resource) unless { context.delegated };"


# A release racing the expiry of its confirmation ---------------------------------------------------

@pytest.fixture
def timed(pg_uri: str) -> Iterator[World]:
    """A world whose control plane runs its workers and lets the test move compute_now()."""
    stack = module_stack(pg_uri, clock_control=True)
    server, root = next(stack)
    w = make_world(server.endpoint, root, server.conninfo)
    try:
        yield w
    finally:
        w.close()
        next(stack, None)


RACED = 40  # reservations released at once, per round
ROUNDS = 3


def test_releases_racing_the_expiry_of_their_confirmations_never_deadlock(timed: World) -> None:
    """The reconciler's expiry locked the confirmation and then the reservation; a release locks
    the reservation and then the confirmation. Released at the deadline while the reconciler
    expired them, the two deadlocked: PostgreSQL broke it after deadlock_timeout and one side ran
    again (the release's transaction retried, or the reconciler's work item failed and was
    retried). Both now take the reservation's row first: no deadlock, every release answers."""
    w = timed
    w.policy(AGENT_POLICY)
    _, agent = w.identity(kind="agent", person_identity_id=w.user_id,
                          confirm_actions=["compute:reservations:create"])
    deadlocks: list[dict] = []
    for _ in range(ROUNDS):
        deadlocks += _race_round(w, agent)
    assert deadlocks == [], deadlocks
    check_invariants(w.conninfo, w.tenant)


def _race_round(w: World, agent) -> list[dict]:
    """RACED requests held for confirmation, released all at once while the clock moves past their
    deadline (so the reconciler expires them meanwhile); the log lines of any deadlock."""
    held: list[str] = []
    deadline = 0
    for _ in range(RACED):
        _, reason, details = refused(agent.res, "Create", w.create_request(count=1))
        assert reason == "CONFIRMATION_REQUIRED", details
        held.append(details["reservationId"])
        deadline = max(deadline, int(details["expiresAt"]))
    start = threading.Barrier(RACED + 1)

    def release(rid: str) -> pb.Reservation:
        start.wait(30)
        return w.user.res("Release", pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=rid))

    def past_deadline() -> None:
        start.wait(30)
        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=deadline - clock_now(w) + SECOND))

    with capture_logs() as logs, ThreadPoolExecutor(RACED + 1) as pool:
        clock = pool.submit(past_deadline)
        answers = [f.result(timeout=120) for f in [pool.submit(release, rid) for rid in held]]
        clock.result(timeout=60)
        final = _settled(w, held)
    assert {a.state for a in answers} <= {"expired", "cancelled"}, [a.state for a in answers]
    assert set(final) == set(held) and set(final.values()) <= {"expired", "cancelled"}, final
    assert w.sql("SELECT count(*) FROM confirmations WHERE reservation_id = ANY(%s)"
                 " AND state IN ('pending', 'approved')", (held,)) == [(0,)]
    return [e for e in logs if e.get("sqlstate") == "40P01" or "eadlock" in str(e.get("error", ""))]


def _settled(w: World, held: list[str], seconds: float = 60) -> dict[str, str]:
    """The reservations' states once the reconciler has handled every item of theirs that is due
    (so a deadlock on its side is logged before the test looks)."""
    deadline = time.monotonic() + seconds
    while w.sql("SELECT count(*) FROM work_items WHERE subject = ANY(%s) AND run_at <= compute_now()",
                (held,)) != [(0,)]:
        assert time.monotonic() < deadline, "the reconciler never handled the confirmation deadlines"
        time.sleep(0.05)
    return dict(w.sql("SELECT id, state FROM reservations WHERE id = ANY(%s)", (held,)))
