"""Delegated confirmation beyond create (spec "Delegated confirmation", "Extend": "admitted like a
create"): an agent's extend its person holds for confirmation asks the person, the approved retry
of that very change extends, and the approval authorises no other change; release, cancel and
renew open no confirmation and say so. Real servers, real agent and person tokens."""

from __future__ import annotations

import pathlib

import grpc
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World, refused
from tests.test_mcp import Call, _token, run_agent

HOUR = 3_600_000
EXTEND = "compute:reservations:extend"
RELEASE = "compute:reservations:release"
# People may do anything; an agent in a delegated session nothing without its person's confirmation.
POLICY = "permit(principal, action, resource) unless { context.delegated };"


def agent_and_booking(world: World, confirm: list[str] | None = None) -> tuple[str, object, pb.Reservation]:
    """An agent for the world's person holding `confirm` (extend) for confirmation, and the
    person's placed reservation (a start ahead keeps it placed)."""
    world.policy(POLICY)
    agent_id, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                                     confirm_actions=confirm or [EXTEND])
    booked = world.create(count=1, duration="1h", start=world.later())
    assert booked.state == "placed"
    return agent_id, agent, booked


def extend(client, world: World, rid: str, key: str, **change) -> pb.ExtendReservationResponse:
    return client.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=rid, idempotency_key=key, **change))


def held(client, world: World, rid: str, key: str, **change) -> dict[str, str]:
    code, reason, details = refused(extend, client, world, rid, key, **change)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CONFIRMATION_REQUIRED"), details
    return details


def confirmation(world: World, cid: str) -> pb.Confirmation:
    return world.user.conf("Get", pb.GetConfirmationRequest(tenant_id=world.tenant, confirmation_id=cid))


def decide(world: World, cid: str, approve: bool = True) -> pb.Confirmation:
    return world.user.conf("Approve" if approve else "Reject",
                           pb.DecideConfirmationRequest(tenant_id=world.tenant, confirmation_id=cid))


def unchanged(world: World, booked: pb.Reservation) -> None:
    """Nothing half-written: the window, the staged change and the extend slot as before."""
    now = world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=booked.id))
    assert (now.state, now.during.end) == (booked.state, booked.during.end)
    assert world.sql("SELECT pending FROM authz_projection WHERE reservation_id = %s", (booked.id,)) == [(None,)]
    assert world.sql("SELECT count(*) FROM extend_holds WHERE reservation_id = %s", (booked.id,)) == [(0,)]


def test_a_held_extend_asks_the_person_and_the_approved_retry_extends(world: World) -> None:
    agent_id, agent, booked = agent_and_booking(world)
    details = held(agent, world, booked.id, "ext-1", by="1h")
    cid = details["confirmationId"]
    assert details["reservationId"] == booked.id
    now_ms = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    assert 0 < int(details["expiresAt"]) - now_ms <= 30 * 60 * 1000
    unchanged(world, booked)

    # What the person is asked: the action and the new end.
    asked = confirmation(world, cid)
    assert (asked.action, asked.state, asked.agent_identity_id, asked.person_identity_id) == (
        EXTEND, "pending", agent_id, world.user_id)
    assert asked.until == booked.during.end + HOUR and asked.expires_at == int(details["expiresAt"])

    # A repeat before the person decides names the same confirmation; only the person decides.
    assert held(agent, world, booked.id, "ext-1", by="1h")["confirmationId"] == cid
    assert refused(agent.conf, "Approve", pb.DecideConfirmationRequest(
        tenant_id=world.tenant, confirmation_id=cid))[1] == "ACCESS_DENIED"
    assert decide(world, cid).state == "approved"

    # The approval is for that change under that key: another change, or the same under another
    # key, is not authorised by it (the one open confirmation of the reservation's extends).
    for key, change in (("ext-1", {"by": "5h"}), ("ext-other", {"by": "1h"}),
                        ("ext-1", {"until": booked.during.end + HOUR})):
        code, reason, other = refused(extend, agent, world, booked.id, key, **change)
        assert (reason, other["reason"], other["confirmationId"]) == ("CONFLICT", "confirmation-open", cid)
    unchanged(world, booked)

    out = extend(agent, world, booked.id, "ext-1", by="1h")
    assert out.extended and out.reservation.during.end == booked.during.end + HOUR
    assert confirmation(world, cid).state == "used"

    # Used once: the same `by` again would extend further, so the person is asked again.
    again = held(agent, world, booked.id, "ext-1", by="1h")
    assert again["confirmationId"] != cid
    assert confirmation(world, again["confirmationId"]).until == booked.during.end + 2 * HOUR
    assert world.user.res("Get", pb.GetReservationRequest(
        tenant_id=world.tenant, reservation_id=booked.id)).during.end == booked.during.end + HOUR


def test_a_rejected_extend_is_refused_and_a_new_change_asks_again(world: World) -> None:
    _, agent, booked = agent_and_booking(world)
    cid = held(agent, world, booked.id, "ext-no", by="2h")["confirmationId"]
    assert decide(world, cid, approve=False).state == "rejected"
    code, reason, details = refused(extend, agent, world, booked.id, "ext-no", by="2h")
    assert (reason, details["reason"], details["confirmationId"]) == ("ACCESS_DENIED", "confirmation-rejected", cid)
    unchanged(world, booked)
    assert held(agent, world, booked.id, "ext-smaller", by="1h")["confirmationId"] != cid


@pytest.mark.parametrize("approve", [False, True])
def test_an_extend_past_its_deadline_is_refused_then_asked_again(world: World, approve: bool) -> None:
    _, agent, booked = agent_and_booking(world)
    cid = held(agent, world, booked.id, "ext-late", until=booked.during.end + HOUR)["confirmationId"]
    if approve:  # an approval not used by the deadline lapses with it
        decide(world, cid)
    world.sql("UPDATE confirmations SET expires_at = compute_now() - interval '1 second' WHERE id = %s", (cid,))
    assert confirmation(world, cid).state == "expired"  # as the person sees it, approved or not
    code, reason, details = refused(extend, agent, world, booked.id, "ext-late", until=booked.during.end + HOUR)
    assert (reason, details["reason"], details["confirmationId"]) == ("ACCESS_DENIED", "confirmation-expired", cid)
    assert confirmation(world, cid).state == "expired"
    unchanged(world, booked)
    assert refused(decide, world, cid)[1] == "INVALID_STATE"
    fresh = held(agent, world, booked.id, "ext-late", until=booked.during.end + HOUR)["confirmationId"]
    assert fresh != cid
    decide(world, fresh)
    assert extend(agent, world, booked.id, "ext-late", until=booked.during.end + HOUR).extended


def test_an_agent_not_held_for_extend_is_refused_without_a_confirmation(world: World) -> None:
    _, agent, booked = agent_and_booking(world, confirm=["compute:reservations:create"])
    code, reason, details = refused(extend, agent, world, booked.id, "ext-plain", by="1h")
    assert reason == "ACCESS_DENIED" and "reason" not in details
    assert world.sql("SELECT count(*) FROM confirmations WHERE reservation_id = %s", (booked.id,)) == [(0,)]
    unchanged(world, booked)


@pytest.mark.parametrize("call,action", [("Release", RELEASE), ("Cancel", RELEASE), ("Renew", EXTEND)])
def test_release_cancel_and_renew_held_for_confirmation_say_so(world: World, call: str, action: str) -> None:
    _, agent, booked = agent_and_booking(world, confirm=[EXTEND, RELEASE])
    request = {"Release": pb.ReleaseReservationRequest, "Cancel": pb.CancelReservationRequest,
               "Renew": pb.RenewReservationRequest}[call](tenant_id=world.tenant, reservation_id=booked.id)
    code, reason, details = refused(agent.res, call, request)
    assert (reason, details["reason"], details["action"]) == ("ACCESS_DENIED", "confirmation-unsupported", action)
    assert details["reservationId"] == booked.id
    assert world.sql("SELECT count(*) FROM confirmations WHERE reservation_id = %s", (booked.id,)) == [(0,)]
    unchanged(world, booked)


def test_the_mcp_server_runs_the_confirmation_loop_for_an_extend(world: World, tmp_path: pathlib.Path) -> None:
    _, agent, booked = agent_and_booking(world)
    hours_ahead = (booked.during.end - world.sql("SELECT epoch_ms(compute_now())")[0][0]) // HOUR + 3

    async def script(call: Call) -> None:
        # A relative until: the retry must resend the held change, not read `+Nh` again.
        until = f"+{hours_ahead}h"
        failed, asked = await call("extend_reservation", reservationId=booked.id, until=until)
        assert not failed and asked["status"] == "confirmation-required", asked
        cid, key = asked["confirmationId"], asked["idempotencyKey"]
        assert asked["personMustRun"] == f"better-compute confirmations approve {cid}"
        assert "extend_reservation" in asked["next"] and key in asked["next"]
        decide(world, cid)
        failed, out = await call("extend_reservation", reservationId=booked.id, until=until, idempotencyKey=key)
        assert not failed and out["extended"], out
        assert int(out["reservation"]["during"]["end"]) == confirmation(world, cid).until

    run_agent(world, tmp_path, _token(agent), script)
