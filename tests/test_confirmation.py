"""Delegated confirmation: an agent refused on an action its person holds for confirmation."""

from __future__ import annotations

import grpc
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World, rpc_error

# People may book; agents in a delegated session may not without their person's confirmation.
POLICY = """
permit(principal, action, resource) unless { context.delegated };
"""


def agent_world(world: World):
    world.policy(POLICY)
    agent_id, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                                     confirm_actions=["compute:reservations:create"])
    return agent_id, agent


def require_confirmation(world: World, agent, key: str) -> dict[str, str]:
    with pytest.raises(grpc.RpcError) as exc:
        world.create(agent, key=key, count=2)
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CONFIRMATION_REQUIRED")
    return details


def test_confirmation_required_then_approved_retry_places_it(world: World) -> None:
    _, agent = agent_world(world)
    details = require_confirmation(world, agent, "agent-run")
    rid = details["reservationId"]
    held = world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=rid))
    assert held.state == "awaiting-confirmation"
    assert held.conditions[0].type == "ConfirmationRequired"
    now_ms = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    assert 0 < int(details["expiresAt"]) - now_ms <= 30 * 60 * 1000
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s", (rid,))[0][0] == 0
    # A retry before the person decides asks again for the same confirmation.
    assert require_confirmation(world, agent, "agent-run")["confirmationId"] == details["confirmationId"]
    # Only the person may approve.
    with pytest.raises(grpc.RpcError) as exc:
        agent.conf("Approve", pb.DecideConfirmationRequest(tenant_id=world.tenant,
                                                           confirmation_id=details["confirmationId"]))
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    approved = world.user.conf("Approve", pb.DecideConfirmationRequest(
        tenant_id=world.tenant, confirmation_id=details["confirmationId"]))
    assert approved.state == "approved"
    placed = world.create(agent, key="agent-run", count=2)
    assert placed.id == rid and placed.state == "placed"
    assert world.sql("SELECT sum(amount) FROM quota_charges WHERE reservation_id = %s AND resource = 'gpu'",
                     (rid,))[0][0] == 2


def test_rejected_confirmation_denies_the_retry(world: World) -> None:
    _, agent = agent_world(world)
    details = require_confirmation(world, agent, "agent-no")
    world.user.conf("Reject", pb.DecideConfirmationRequest(tenant_id=world.tenant,
                                                           confirmation_id=details["confirmationId"]))
    with pytest.raises(grpc.RpcError) as exc:
        world.create(agent, key="agent-no", count=2)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"


def test_after_the_deadline_a_late_retry_finds_it_expired(world: World) -> None:
    _, agent = agent_world(world)
    details = require_confirmation(world, agent, "agent-late")
    world.sql("UPDATE confirmations SET expires_at = compute_now() - interval '1 second' WHERE id = %s",
              (details["confirmationId"],))
    late = world.create(agent, key="agent-late", count=2)
    assert late.state == "expired" and late.operation.state == "failed"
    with pytest.raises(grpc.RpcError) as exc:
        world.user.conf("Approve", pb.DecideConfirmationRequest(tenant_id=world.tenant,
                                                                confirmation_id=details["confirmationId"]))
    assert rpc_error(exc)[1] == "INVALID_STATE"


def test_a_person_is_not_asked_to_confirm_their_own_request(world: World) -> None:
    agent_world(world)
    # A start ahead keeps it placed: one starting now may already be binding when the answer is read.
    assert world.create(key="person-self", count=1, start=world.later()).state == "placed"
