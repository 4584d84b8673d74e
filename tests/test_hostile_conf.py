"""A hostile tenant or agent against delegated confirmation, IAM, delegated sessions, offboarding and
tokens (spec "Delegated confirmation", "Drafts and idempotency", "The admission sequence"; DESIGN.md
sections 7, 7a, 8 and 14). Every attack runs through the real API against a real server; the
database is read to check what is stored, and written only to hold a lock or move a deadline."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import reservations_pb2_grpc
from controlplane import bootstrap
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, eventually, gpus, make_world, refused

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


def test_an_approved_retry_placing_while_the_person_is_offboarded_passes_to_the_successor(world: World) -> None:
    agent_id, agent = agent_world(world)
    successor_id, successor = world.identity()
    request = world.create_request(count=1, start=world.later(24))
    first = held(world, agent, request)
    decide(world, "Approve", first["confirmationId"])
    with psycopg.connect(world.conninfo) as holder:
        holder.execute("SELECT 1 FROM quotas WHERE tenant_id = %s AND resource = 'gpu' FOR UPDATE", (world.tenant,))
        create = Background(agent.res, "Create", request)
        wait_for_lock_wait(world, "%charge_all%")  # transaction 2 of an approved retry
        offboarding = Background(world.root.admin, "OffboardIdentity", apb.OffboardIdentityRequest(
            identity_id=world.user_id, successor_identity_id=successor_id))
        wait_for_lock_wait(world, "%FROM reservations%")
        holder.rollback()
    placed = create.result()
    answer = offboarding.result()
    assert placed.state == "placed"
    assert list(answer.reassigned_reservation_ids) == [placed.id]
    assert list(answer.disabled_agent_ids) == [agent_id]
    seen = successor.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=placed.id))
    assert seen.owner_identity_id == successor_id
    assert world.sql("SELECT data->>'reason' FROM events WHERE subject = %s AND type = 'reservation.reassigned'",
                     (f"reservation/{placed.id}",)) == [("delegator-offboarded",)]
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


def absent_confirmation() -> str:
    return "conf_" + "0" * 26


def test_a_confirmation_is_not_found_for_another_member_and_another_agent_of_the_person(world: World) -> None:
    """Only the person asked and the agent asking see a confirmation: another member of the tenant,
    and another agent of the same person, get NOT_FOUND exactly as for an absent one."""
    _, agent = agent_world(world)
    cid = held(world, agent, world.create_request(count=1))["confirmationId"]
    _, other_user = world.identity()
    _, other_agent = world.identity(kind="agent", person_identity_id=world.user_id, confirm_actions=[CREATE])
    for client in (other_user, other_agent):
        for method, request in (("Get", pb.GetConfirmationRequest), ("Approve", pb.DecideConfirmationRequest),
                                ("Reject", pb.DecideConfirmationRequest)):
            theirs = refused(client.conf, method, request(tenant_id=world.tenant, confirmation_id=cid))
            absent = refused(client.conf, method, request(tenant_id=world.tenant,
                                                          confirmation_id=absent_confirmation()))
            assert theirs[:2] == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND"), (method, theirs)
            assert {k: v.replace(cid, "ID") for k, v in theirs[2].items()} == \
                   {k: v.replace(absent_confirmation(), "ID") for k, v in absent[2].items()}
    assert world.sql("SELECT state FROM confirmations WHERE id = %s", (cid,)) == [("pending",)]


def test_a_confirmation_named_under_another_tenant_of_the_person_is_not_found(world: World) -> None:
    """The person is a member of two tenants; its confirmation of tenant A named under tenant B is
    NOT_FOUND, and deciding it there changes nothing."""
    _, agent = agent_world(world)
    cid = held(world, agent, world.create_request(count=1))["confirmationId"]
    other = f"t{cid[-10:]}"
    world.root.admin("CreateTenant", apb.CreateTenantRequest(id=other, name=other))
    world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=world.user_id, kind="user", tenant_ids=[other]))
    for method in ("Approve", "Reject"):
        code, reason, details = refused(world.user.conf, method, pb.DecideConfirmationRequest(
            tenant_id=other, confirmation_id=cid))
        assert (code, reason, details["confirmationId"]) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", cid)
    assert world.sql("SELECT state FROM confirmations WHERE id = %s", (cid,)) == [("pending",)]


def refused_or_answer(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except grpc.RpcError:
        return refused(fn, *args)


def test_concurrent_decisions_of_the_person_leave_exactly_one(world: World) -> None:
    """Approve and reject racing from the person's own sessions: exactly one wins, every other is
    INVALID_STATE naming the winner's state, and the stored state is the winner's."""
    _, agent = agent_world(world)
    request = world.create_request(count=1, start=world.later(24))
    cid = held(world, agent, request)["confirmationId"]
    calls = [Background(refused_or_answer, decide, world, "Approve" if i % 2 else "Reject", cid) for i in range(8)]
    answers = [c.result() for c in calls]
    won = [a for a in answers if isinstance(a, pb.Confirmation)]
    assert len(won) == 1, answers
    lost = [a for a in answers if not isinstance(a, pb.Confirmation)]
    assert all(a[:2] == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE") and a[2]["state"] == won[0].state
               for a in lost), lost
    assert world.sql("SELECT state FROM confirmations WHERE id = %s", (cid,)) == [(won[0].state,)]
    # Deciding again after the race is refused the same way.
    assert refused(decide, world, "Approve", cid)[1] == "INVALID_STATE"


def test_concurrent_retries_of_an_approved_request_place_it_once_and_charge_once(world: World) -> None:
    _, agent = agent_world(world)
    world.quota(4)
    request = world.create_request(count=3, start=world.later(24))
    first = held(world, agent, request)
    decide(world, "Approve", first["confirmationId"])
    retries = [Background(agent.res, "Create", request) for _ in range(8)]
    answers = [r.result() for r in retries]
    assert {a.id for a in answers} == {first["reservationId"]}
    assert {a.state for a in answers} == {"placed"}
    assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (first["reservationId"],)) == [(1,)]
    assert world.sql("SELECT count(*) FROM events WHERE subject = %s AND type = 'reservation.placed'",
                     (f"reservation/{first['reservationId']}",)) == [(1,)]
    # Exactly 3 of 4 GPUs are used: a second reservation of 2 does not fit.
    assert refused(world.create, count=2)[1] == "QUOTA_EXCEEDED"
    check_invariants(world.conninfo, world.tenant)


def test_concurrent_retries_of_an_approved_request_in_a_lease_pool_queue_it_once(world: World) -> None:
    """The same race in a pool whose creates the lease holder places (admitted queued in one
    statement): one reservation, one charge, placed once."""
    _, agent = agent_world(world)
    world.quota(4)
    pool = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="leased", region="eu-1", policy=apb.PoolPolicy(placer="lease")))
    world.root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=pool.id, name=f"leased-{world.tenant}",
                                                            gpus=gpus(f"leased-{world.tenant}")))
    request = world.create_request(count=3, start=world.later(24), pool_id=pool.id)
    first = held(world, agent, request)
    decide(world, "Approve", first["confirmationId"])
    answers = [r.result() for r in [Background(agent.res, "Create", request) for _ in range(8)]]
    assert {a.id for a in answers} == {first["reservationId"]}
    assert {a.state for a in answers} <= {"queued", "placed"}
    eventually(world, first["reservationId"], lambda r: r.state == "placed", seconds=30)
    assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (first["reservationId"],)) == [(1,)]
    assert world.sql("SELECT count(*) FROM events WHERE subject = %s AND type = 'reservation.queued'",
                     (f"reservation/{first['reservationId']}",)) == [(1,)]
    assert refused(world.create, count=2)[1] == "QUOTA_EXCEEDED"
    check_invariants(world.conninfo, world.tenant)

def test_the_same_key_with_another_request_while_held_is_conflict(world: World) -> None:
    _, agent = agent_world(world)
    request = world.create_request(count=1, start=world.later(24))
    first = held(world, agent, request)
    other = world.create_request(key=request.idempotency_key, count=2, start=world.later(24))
    code, reason, details = refused(agent.res, "Create", other)
    assert (code, reason, details["reservationId"]) == (grpc.StatusCode.ABORTED, "CONFLICT", first["reservationId"])
    decide(world, "Approve", first["confirmationId"])
    assert refused(agent.res, "Create", other)[1] == "CONFLICT"  # an approval is for that request only
    placed = agent.res("Create", request)
    assert (placed.state, placed.request.devices[0].count) == ("placed", 1)
    check_invariants(world.conninfo, world.tenant)


def test_a_held_request_released_by_its_agent_cannot_be_approved_into_a_placement(world: World) -> None:
    _, agent = agent_world(world)
    request = world.create_request(count=1, start=world.later(24))
    first = held(world, agent, request)
    rid, cid = first["reservationId"], first["confirmationId"]
    world.policy(AGENT_POLICY + f'\npermit(principal, action == Action::"compute:reservations:release", resource);')
    released = agent.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=rid))
    assert released.state == "cancelled"
    code, reason, _ = refused(decide, world, "Approve", cid)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
    again = agent.res("Create", request)
    assert (again.id, again.state) == (rid, "cancelled")
    assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (rid,)) == [(0,)]
    check_invariants(world.conninfo, world.tenant)


def test_offboarding_the_agent_alone_withdraws_what_it_asked(world: World) -> None:
    """Root offboards the agent (its person stays): its open confirmation is withdrawn, the person
    can no longer approve it, and its held request expired."""
    agent_id, agent = agent_world(world)
    request = world.create_request(count=1, start=world.later(24))
    first = held(world, agent, request)
    answer = world.root.admin("OffboardIdentity", apb.OffboardIdentityRequest(
        identity_id=agent_id, successor_identity_id=world.user_id))
    assert list(answer.withdrawn_confirmation_ids) == [first["confirmationId"]]
    assert list(answer.expired_reservation_ids) == [first["reservationId"]]
    assert refused(decide, world, "Approve", first["confirmationId"])[1] == "INVALID_STATE"
    assert refused(agent.res, "Create", request)[1] == "UNAUTHENTICATED"
    seen = world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=first["reservationId"]))
    assert seen.state == "expired"


def test_an_approval_never_outranks_the_persons_own_refusal(world: World) -> None:
    """Approved, then the policy forbids the person: the retry is decided on the person's authority
    and refused; nothing is charged or booked, and the key stays refused."""
    _, agent = agent_world(world)
    request = world.create_request(count=1, start=world.later(24))
    first = held(world, agent, request)
    decide(world, "Approve", first["confirmationId"])
    world.policy(AGENT_POLICY + f'\nforbid(principal == Identity::"{world.user_id}", action, resource);')
    assert refused(agent.res, "Create", request)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    world.policy(AGENT_POLICY)
    assert refused(agent.res, "Create", request)[1] == "ACCESS_DENIED"
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s",
                     (first["reservationId"],)) == [(0,)]
    check_invariants(world.conninfo, world.tenant)


def test_an_approved_request_over_quota_stays_approved_and_places_once_there_is_room(world: World) -> None:
    _, agent = agent_world(world)
    world.quota(1)
    request = world.create_request(count=2, start=world.later(24))
    first = held(world, agent, request)
    decide(world, "Approve", first["confirmationId"])
    assert refused(agent.res, "Create", request)[1] == "QUOTA_EXCEEDED"
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s",
                     (first["reservationId"],)) == [(0,)]
    world.quota(2)
    assert agent.res("Create", request).state == "placed"
    check_invariants(world.conninfo, world.tenant)


@pytest.mark.parametrize("cid", ["", "conf_" + "0" * 25, "conf_" + "0" * 26 + "\x00", "CONF_" + "0" * 26,
                                 "conf_" + "0" * 5000, "rsv_" + "0" * 52])
def test_a_malformed_confirmation_id_is_invalid_input_naming_it(world: World, cid: str) -> None:
    code, reason, details = refused(world.user.conf, "Approve", pb.DecideConfirmationRequest(
        tenant_id=world.tenant, confirmation_id=cid))
    assert (code, reason, details.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT",
                                                    "confirmationId"), details


@pytest.fixture(scope="module")
def capped(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, max_drafts_per_identity=3)


def test_an_agent_cannot_flood_its_person_with_confirmations(capped: tuple[ServerThread, Client]) -> None:
    """Each held create is an unfinished create request: an agent holds at most
    max_drafts_per_identity of them (and drafts) at once, like any identity's drafts, so it
    cannot open confirmations for its person without end. A retry of a held key still works, and
    a decided one frees its place."""
    server, root = capped
    w = make_world(server.endpoint, root, server.conninfo, nodes=1)
    try:
        _, agent = agent_world(w)
        requests = [w.create_request(key=f"ask-{i}", count=1, start=w.later(24)) for i in range(3)]
        asked = [held(w, agent, r) for r in requests]
        code, reason, details = refused(agent.res, "Create", w.create_request(key="ask-more", count=1))
        assert (code, reason, details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED",
                                                     "draft-limit"), details
        assert 0 < int(details["retryAfterSeconds"])
        assert w.sql("SELECT count(*) FROM confirmations WHERE tenant_id = %s", (w.tenant,)) == [(3,)]
        retry = held(w, agent, requests[0])
        assert retry["confirmationId"] == asked[0]["confirmationId"]
        decide(w, "Reject", asked[1]["confirmationId"])
        assert refused(agent.res, "Create", requests[1])[1] == "ACCESS_DENIED"  # decided: denied, no longer held
        held(w, agent, w.create_request(key="ask-more", count=1))
        # The person is not held back by its agent's requests.
        assert w.create(count=1, start=w.later(24)).state == "placed"
    finally:
        w.close()


# Tokens --------------------------------------------------------------------------------------------


def list_with(world: World, header: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    channel = grpc.insecure_channel(world.endpoint)
    try:
        stub = reservations_pb2_grpc.ReservationsStub(channel)
        return refused(stub.List, pb.ListReservationsRequest(tenant_id=world.tenant), metadata=header, timeout=30)
    finally:
        channel.close()


def test_malformed_bearer_values_are_unauthenticated(world: World) -> None:
    token = world.user.metadata[0][1].split(" ", 1)[1]
    for header in [
        (("authorization", "Bearer"),), (("authorization", "Bearer    "),), (("authorization", "Basic " + token),),
        (("authorization", token),), (("authorization", "Bearer " + token + "x"),),
        (("authorization", "Bearer " + token[:-1]),), (("authorization", "Bearer " + "a" * 6000),),
        (("authorization", "Bearer " + token.upper()),), (("authorization-bin", token.encode()),),
        (("x-authorization", "Bearer " + token),), (),
    ]:
        code, reason, _ = list_with(world, header)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"), header[:1]
    # The token itself works, with any case of the scheme and spaces around the secret.
    for header in ((("authorization", "bearer " + token),), (("authorization", "BEARER   " + token + "  "),)):
        channel = grpc.insecure_channel(world.endpoint)
        try:
            reservations_pb2_grpc.ReservationsStub(channel).List(
                pb.ListReservationsRequest(tenant_id=world.tenant), metadata=header, timeout=30)
        finally:
            channel.close()


def test_a_token_minted_while_its_identity_is_offboarded_is_refused(world: World) -> None:
    """CreateToken read the identity not offboarded while an offboarding held it, then minted once
    the offboarding committed: a live token for a gone identity. It must wait for the offboarding
    and answer INVALID_STATE, storing no token."""
    leaver, _ = world.identity()
    with psycopg.connect(world.conninfo) as offboarding:  # holds the identity row, as offboarding does
        offboarding.execute("SELECT 1 FROM identities WHERE id = %s FOR UPDATE", (leaver,))
        mint = Background(refused, world.root.admin, "CreateToken", apb.CreateTokenRequest(identity_id=leaver))
        wait_for_lock_wait(world, "%identit%")
        offboarding.execute("UPDATE identities SET offboarded_at = now(), offboard_reason = 'offboarded',"
                            " successor_id = %s WHERE id = %s", (world.user_id, leaver))
        offboarding.commit()
    code, reason, details = mint.result()
    assert (code, reason, details.get("identityId")) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE", leaver)
    assert world.sql("SELECT count(*) FROM api_tokens WHERE identity_id = %s", (leaver,)) == [(1,)]  # its first


def test_a_token_of_an_identity_in_no_tenant_reaches_nothing(world: World) -> None:
    loner = f"loner-{world.tenant}"
    world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=loner, kind="user", name=loner))
    token = world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=loner)).secret
    client = Client(world.endpoint, token)
    try:
        assert refused(client.res, "List", pb.ListReservationsRequest(tenant_id=world.tenant))[1] == "ACCESS_DENIED"
        assert refused(client.res, "Create", world.create_request(count=1))[1] == "ACCESS_DENIED"
        assert refused(client.admin, "PutPolicy", apb.PutPolicyRequest(
            tenant_id=world.tenant, cedar="permit(principal, action, resource);"))[1] == "ACCESS_DENIED"
    finally:
        client.close()


# Deadlines -----------------------------------------------------------------------------------------


def test_an_approval_not_used_by_the_deadline_expires_with_the_request(clock_world: World) -> None:
    """The person approved, but the agent keeps the approval and retries days later: after the
    deadline the request is expired (spec: by the reconciler or on a late retry), not placed at a
    time the person never saw."""
    w = clock_world
    _, agent = agent_world(w)
    request = w.create_request(count=1)  # "now": the person approves a booking from now
    first = held(w, agent, request)
    decide(w, "Approve", first["confirmationId"])
    w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=2 * 24 * 3600 * 1000))
    late = agent.res("Create", request)
    assert (late.id, late.state) == (first["reservationId"], "expired")
    assert w.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (late.id,)) == [(0,)]
    assert w.sql("SELECT state FROM confirmations WHERE id = %s", (first["confirmationId"],)) == [("expired",)]
    assert w.sql("SELECT data->>'reason' FROM events WHERE subject = %s AND type = 'reservation.expired'",
                 (f"reservation/{late.id}",)) == [("confirmation-expired",)]
    check_invariants(w.conninfo, w.tenant)


# Policies ------------------------------------------------------------------------------------------

REPO = pathlib.Path(__file__).resolve().parents[1]


def deep(depth: int, opening: str = "(", closing: str = ")", inner: str = "true") -> str:
    return f"permit(principal, action, resource) when {{ {opening * depth}{inner}{closing * depth} }};"


def test_a_deeply_nested_policy_is_invalid_input_and_the_server_lives(database: str) -> None:
    """Cedar's parser recurses per bracket: a policy of a few KB nested a thousand deep overflowed
    the stack and killed the control plane process on PutPolicy (a segmentation fault, not an
    error). It is INVALID_INPUT naming `cedar`, whichever bracket nests, and the process serves on."""
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "serve", "--listen", "127.0.0.1:0"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "DATABASE_URL": database, "BC_LOG_FORMAT": "json"})
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
        port = int(line.split(" (")[0].rsplit(":", 1)[1])
        root = Client(f"127.0.0.1:{port}", bootstrap.ensure_root(database))
        root.admin("CreateTenant", apb.CreateTenantRequest(id="deep", name="deep"))
        for text in (deep(2000), deep(2000, "[", "]", ""), deep(2000, "{a:", "}", "1"),
                     deep(40, "(if true then (", ") else true)")):
            assert len(text) < 65536
            code, reason, details = refused(root.admin, "PutPolicy", apb.PutPolicyRequest(tenant_id="deep", cedar=text))
            assert (code, reason, details.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT",
                                                            "cedar"), details
        assert proc.poll() is None
        # Brackets in strings and comments do not count; an ordinary policy nests as it likes.
        fine = ('// ' + "(" * 2000 + '\npermit(principal, action, resource) when { "' + "[" * 2000 + '" != "" && '
                + "(" * 20 + "true" + ")" * 20 + " };")
        assert root.admin("PutPolicy", apb.PutPolicyRequest(tenant_id="deep", cedar=fine)).cedar == fine
        # A policy stored before PutPolicy checked nesting is never handed to the parser: its
        # decisions are refusals, and the process serves on.
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("UPDATE policies SET cedar = %s WHERE tenant_id = 'deep'", (deep(2000),))
        pool_id = root.admin("CreatePool", apb.CreatePoolRequest(owner_tenant_id="deep", name="p", region="eu-1")).id
        root.admin("CreateIdentity", apb.CreateIdentityRequest(id="deep-user", kind="user", name="u",
                                                               tenant_ids=["deep"]))
        user = Client(f"127.0.0.1:{port}", root.admin("CreateToken", apb.CreateTokenRequest(identity_id="deep-user")).secret)
        code, reason, _ = refused(user.res, "Create", pb.CreateReservationRequest(
            tenant_id="deep", pool_id=pool_id, devices=[pb.DeviceRequest(device_class="gpu", count=1)],
            duration="1h", idempotency_key="deep-1"))
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
        assert proc.poll() is None
        user.close()
        root.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
