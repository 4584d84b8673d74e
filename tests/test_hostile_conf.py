"""A hostile tenant or agent against delegated confirmation, IAM, delegated sessions, offboarding and
tokens (spec "Delegated confirmation", "Drafts and idempotency", "The admission sequence"; DESIGN.md
sections 7, 7a, 8 and 14). Every attack runs through the real API against a real server; the
database is read to check what is stored, and written only to hold a lock or move a deadline."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.invariants import check_invariants
from tests.support import World, refused

AGENT_POLICY = "permit(principal, action, resource) unless { context.delegated };"
CREATE = "compute:reservations:create"


def wait_for_lock_wait(world: World, query_like: str, seconds: float = 30) -> None:
    """Until a backend running a statement like `query_like` waits for a lock (a positive signal)."""
    deadline = time.monotonic() + seconds
    while world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                    (query_like,)) == [(0,)]:
        assert time.monotonic() < deadline, f"no statement like {query_like!r} ever waited for a lock"
        time.sleep(0.02)


class Background:
    """A call on a thread of its own: its answer or its error, once joined."""

    def __init__(self, fn: Any, *args: Any, **kw: Any) -> None:
        self.answer: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kw), daemon=True)
        self._thread.start()

    def _run(self, fn: Any, args: tuple, kw: dict) -> None:
        try:
            self.answer = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def result(self, seconds: float = 60) -> Any:
        self._thread.join(seconds)
        assert not self._thread.is_alive(), "the call never answered"
        if self.error is not None:
            raise self.error
        return self.answer


# Offboarding against a create in flight ----------------------------------------------------------


def test_a_create_placing_while_its_owner_is_offboarded_passes_to_the_successor(world: World) -> None:
    """The create's transaction 2 holds its draft (it waits on the quota row) when the offboarding
    starts; it commits placed while the offboarding looks for the leaver's drafts. The placed
    reservation must pass to the successor with its event, not stay with an identity that is gone."""
    successor_id, successor = world.identity()
    request = world.create_request(count=1, start=world.later(24))
    with psycopg.connect(world.conninfo) as holder:  # holds the quota row charge_quota locks
        holder.execute("SELECT 1 FROM quotas WHERE tenant_id = %s AND resource = 'gpu' FOR UPDATE", (world.tenant,))
        create = Background(world.user.res, "Create", request)
        wait_for_lock_wait(world, "%place_inline%")
        offboarding = Background(world.root.admin, "OffboardIdentity", apb.OffboardIdentityRequest(
            identity_id=world.user_id, successor_identity_id=successor_id))
        wait_for_lock_wait(world, "%FROM reservations%")  # the offboarding waits for the create's row
        holder.rollback()
    placed = create.result()
    answer = offboarding.result()
    assert placed.state == "placed"
    assert list(answer.reassigned_reservation_ids) == [placed.id]
    seen = successor.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=placed.id))
    assert seen.owner_identity_id == successor_id
    assert world.sql("SELECT count(*) FROM events WHERE subject = %s AND type = 'reservation.reassigned'",
                     (f"reservation/{placed.id}",)) == [(1,)]
    check_invariants(world.conninfo, world.tenant)


# Delegated confirmation ----------------------------------------------------------------------------


def agent_world(world: World) -> tuple[str, Any]:
    """People may book; the person's agent is held for confirmation on creates."""
    world.policy(AGENT_POLICY)
    return world.identity(kind="agent", person_identity_id=world.user_id, confirm_actions=[CREATE])


def held(world: World, agent: Any, request: pb.CreateReservationRequest) -> dict[str, str]:
    """The details of the CONFIRMATION_REQUIRED an agent's create gets."""
    code, reason, details = refused(agent.res, "Create", request)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CONFIRMATION_REQUIRED"), details
    return details


def decide(world: World, method: str, cid: str, client: Any = None) -> pb.Confirmation:
    return (client or world.user).conf(method, pb.DecideConfirmationRequest(tenant_id=world.tenant,
                                                                            confirmation_id=cid))


@pytest.mark.parametrize("method", ["Approve", "Reject"])
def test_a_person_deciding_while_the_agent_retries_is_answered_by_that_decision(world: World, method: str) -> None:
    """The agent's retry read the confirmation pending and IAM held it again; the person decides
    before the retry's transaction 2. The retry must neither fail INTERNAL (a second open
    confirmation) nor open a new one that would undo a rejection."""
    _, agent = agent_world(world)
    request = world.create_request(count=1, start=world.later(24))
    first = held(world, agent, request)
    rid, cid = first["reservationId"], first["confirmationId"]
    with psycopg.connect(world.conninfo) as holder:  # holds the reservation row transaction 2 locks
        holder.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (rid,))
        retry = Background(refused, agent.res, "Create", request)
        wait_for_lock_wait(world, "%FROM reservations%FOR UPDATE%")
        assert decide(world, method, cid).state == ("approved" if method == "Approve" else "rejected")
        holder.rollback()
    code, reason, details = retry.result()
    assert reason != "INTERNAL", details
    assert world.sql("SELECT id, state FROM confirmations WHERE reservation_id = %s", (rid,)) == [
        (cid, "approved" if method == "Approve" else "rejected")]
    if method == "Approve":
        assert (reason, details["confirmationId"]) == ("CONFIRMATION_REQUIRED", cid)
        assert agent.res("Create", request).state == "placed"  # the next retry finds the approval
    else:
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
        assert refused(agent.res, "Create", request)[1] == "ACCESS_DENIED"  # the key stays refused
    check_invariants(world.conninfo, world.tenant)
