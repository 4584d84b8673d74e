"""Offboarding (issue "Tools for people and agents"): root offboards an identity and names a
successor; its live reservations pass to the successor with a reservation.reassigned event, its
tokens stop working, its open confirmations are withdrawn and its agents are disabled with it.
Driven through the API against a real server; the database is read only to check what is stored."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import grpc
import psycopg
import pytest
from google.protobuf.json_format import MessageToDict

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, poll
from tests.support import Client, ServerThread, World, rpc_error
from tests.test_confirmation import agent_world, require_confirmation
from tests.test_watch import Stream
from tests.test_webhooks import LOOPBACK, SECRET, Receiver, hooks


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Loopback webhook receivers allowlisted, to see reservation.reassigned delivered."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK)


def offboard(world: World, identity: str, successor: str) -> apb.OffboardIdentityResponse:
    return world.root.admin("OffboardIdentity", apb.OffboardIdentityRequest(
        identity_id=identity, successor_identity_id=successor))


def refused(world: World, identity: str, successor: str, client: Client | None = None) -> tuple:
    with pytest.raises(grpc.RpcError) as exc:
        (client or world.root).admin("OffboardIdentity", apb.OffboardIdentityRequest(
            identity_id=identity, successor_identity_id=successor))
    return rpc_error(exc)


def mine(client: Client, tenant: str) -> dict[str, pb.Reservation]:
    return {r.id: r for r in client.res("List", pb.ListReservationsRequest(tenant_id=tenant, scope="mine")).items}


def unauthenticated(client: Client, tenant: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        client.res("List", pb.ListReservationsRequest(tenant_id=tenant))
    assert rpc_error(exc)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")


def token_refused(world: World, identity: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=identity))
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["identityId"]) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE", identity)


def reassigned_events(world: World, rid: str) -> list[dict]:
    return [row[0] for row in world.sql(
        "SELECT data FROM events WHERE subject = %s AND type = 'reservation.reassigned' ORDER BY id",
        (f"reservation/{rid}",))]


def test_live_reservations_pass_to_the_successor_who_can_list_extend_and_release_them(world: World) -> None:
    leaver, leaver_id = world.user, world.user_id
    successor_id, successor = world.identity()
    placed = world.create(count=1, start=world.later(24))
    pending = world.create(count=8, model="none-such")
    active = SigningNodes(world).activate(world.create(count=1, duration="2h").id)
    ended = world.create(count=1, start=world.later(30))
    leaver.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=ended.id))
    assert (placed.state, pending.state, active.state) == ("placed", "pending", "active")
    before = mine(leaver, world.tenant)

    with Stream(successor, tenant_id=world.tenant, from_now=True, types=["reservation.reassigned"]) as stream:
        answer = offboard(world, leaver_id, successor_id)
        watched = stream.take(3)

    live = {placed.id, pending.id, active.id}
    assert answer.changed and answer.offboarded_at > 0
    assert set(answer.reassigned_reservation_ids) == live
    assert len(answer.revoked_token_ids) == 1 and list(answer.disabled_agent_ids) == []
    unauthenticated(leaver, world.tenant)
    token_refused(world, leaver_id)

    # The successor lists them as its own (scope mine), each one a version further on.
    theirs = mine(successor, world.tenant)
    assert set(theirs) == live
    for rid in live:
        assert theirs[rid].owner_identity_id == successor_id
        assert theirs[rid].state == before[rid].state and theirs[rid].version == before[rid].version + 1
    ended_now = successor.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=ended.id))
    assert ended_now.owner_identity_id == leaver_id  # history stays with its owner

    # One event per live reservation, watched and stored, as the catalog describes it.
    assert {e.subject for e in watched} == {f"reservation/{rid}" for rid in live}
    for event in watched:
        rid = event.subject.removeprefix("reservation/")
        data = MessageToDict(event.data)
        assert data == {"reservationId": rid, "from": leaver_id, "to": successor_id, "reason": "offboarded",
                        "state": before[rid].state, "poolId": world.pool_id}
        assert reassigned_events(world, rid) == [data]
    assert reassigned_events(world, ended.id) == []

    extended = successor.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=placed.id, by="1h", idempotency_key="after-offboarding"))
    assert extended.extended and extended.reservation.during.end == placed.during.end + 3_600_000
    released = successor.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=active.id))
    assert released.state == "released"
    check_invariants(world.conninfo, world.tenant)


def test_offboarding_again_is_a_no_op_with_the_same_successor_and_invalid_state_with_another(world: World) -> None:
    successor_id, _ = world.identity()
    other_id, _ = world.identity()
    world.create(count=1, start=world.later(24))
    first = offboard(world, world.user_id, successor_id)
    assert first.changed and len(first.reassigned_reservation_ids) == 1

    again = offboard(world, world.user_id, successor_id)
    assert not again.changed and again.offboarded_at == first.offboarded_at
    assert list(again.reassigned_reservation_ids) == [] and list(again.revoked_token_ids) == []
    assert len(world.sql("SELECT 1 FROM events WHERE type = 'reservation.reassigned' AND data->>'from' = %s",
                         (world.user_id,))) == 1

    code, reason, details = refused(world, world.user_id, other_id)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
    assert (details["identityId"], details["successorIdentityId"]) == (world.user_id, successor_id)
    # An offboarded identity cannot be anybody's successor either.
    assert refused(world, other_id, world.user_id)[1:] == (
        "INVALID_STATE", {"successorIdentityId": world.user_id, "state": "offboarded"})


def test_a_bad_request_changes_nothing_and_names_the_field(world: World) -> None:
    kept = world.create(count=1, start=world.later(24))
    outsider_tenant = f"{world.tenant}x"
    world.root.admin("CreateTenant", apb.CreateTenantRequest(id=outsider_tenant, name=outsider_tenant))
    outsider_id, outsider = world.identity(tenants=[outsider_tenant])

    assert refused(world, "nobody-here", world.user_id)[:2] == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
    assert refused(world, "nobody-here", world.user_id)[2]["identityId"] == "nobody-here"
    code, reason, details = refused(world, world.user_id, "nobody-here")
    assert (reason, details["successorIdentityId"]) == ("NOT_FOUND", "nobody-here")
    code, reason, details = refused(world, world.user_id, world.user_id)
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT",
                                                 "successorIdentityId")
    assert refused(world, world.user_id, "bad id\x00")[2]["field"] == "successorIdentityId"
    # The successor must be a member of every tenant where reservations move.
    code, reason, details = refused(world, world.user_id, outsider_id)
    assert (reason, details["field"], json.loads(details["tenantIds"])) == (
        "INVALID_INPUT", "successorIdentityId", [world.tenant])
    # Only root offboards.
    assert refused(world, world.user_id, outsider_id, client=outsider)[1] == "ACCESS_DENIED"

    assert set(mine(world.user, world.tenant)) == {kept.id}  # nothing moved, the token still works
    assert world.sql("SELECT offboarded_at FROM identities WHERE id = %s", (world.user_id,)) == [(None,)]


def test_the_persons_agents_are_disabled_and_their_confirmations_withdrawn(world: World) -> None:
    agent_id, agent = agent_world(world)
    successor_id, successor = world.identity()
    # The agent holds one placed reservation (its person approved) and one awaiting confirmation.
    approved = require_confirmation(world, agent, "agent-placed")
    world.user.conf("Approve", pb.DecideConfirmationRequest(tenant_id=world.tenant,
                                                            confirmation_id=approved["confirmationId"]))
    placed = world.create(agent, key="agent-placed", count=2)
    assert placed.state == "placed"
    held = require_confirmation(world, agent, "agent-held")

    answer = offboard(world, world.user_id, successor_id)
    assert list(answer.disabled_agent_ids) == [agent_id]
    assert list(answer.reassigned_reservation_ids) == [placed.id]
    assert list(answer.expired_reservation_ids) == [held["reservationId"]]
    assert list(answer.withdrawn_confirmation_ids) == [held["confirmationId"]]
    assert len(answer.revoked_token_ids) == 2

    unauthenticated(agent, world.tenant)
    unauthenticated(world.user, world.tenant)
    token_refused(world, agent_id)
    event = reassigned_events(world, placed.id)
    assert len(event) == 1 and event[0]["state"] in ("placed", "binding")  # it starts now
    assert event[0] == {"reservationId": placed.id, "from": agent_id, "to": successor_id,
                        "reason": "delegator-offboarded", "state": event[0]["state"], "poolId": world.pool_id}
    assert set(mine(successor, world.tenant)) == {placed.id}
    expired = successor.res("Get", pb.GetReservationRequest(tenant_id=world.tenant,
                                                             reservation_id=held["reservationId"]))
    assert (expired.state, expired.owner_identity_id) == ("expired", agent_id)
    assert world.sql("SELECT state FROM confirmations WHERE id = %s", (held["confirmationId"],)) == [("withdrawn",)]
    assert world.sql("SELECT data->>'reason' FROM events WHERE subject = %s AND type = 'reservation.expired'",
                     (f"reservation/{held['reservationId']}",)) == [("confirmation-withdrawn",)]
    # An agent of a gone person cannot be its successor's successor either: it is offboarded.
    assert refused(world, successor_id, agent_id)[1] == "INVALID_STATE"
    check_invariants(world.conninfo, world.tenant)


def test_an_agent_cannot_succeed_its_own_person(world: World) -> None:
    agent_id, agent = agent_world(world)
    code, reason, details = refused(world, world.user_id, agent_id)
    assert (reason, details["field"]) == ("INVALID_INPUT", "successorIdentityId")
    # Nothing happened: the agent still authenticates (IAM refuses it a listing, as before).
    with pytest.raises(grpc.RpcError) as exc:
        agent.res("List", pb.ListReservationsRequest(tenant_id=world.tenant))
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    assert world.sql("SELECT count(*) FROM identities WHERE offboarded_at IS NOT NULL AND id IN (%s, %s)",
                     (world.user_id, agent_id)) == [(0,)]


def test_idempotency_keys_stay_with_their_creator(world: World) -> None:
    successor_id, successor = world.identity()
    shared = world.create_request(key="shared-key", count=1, start=world.later(24))
    theirs = successor.res("Create", shared)
    leavers = world.user.res("Create", shared)
    only_leaver = world.create(key="leaver-key", count=1, start=world.later(28))
    assert len({theirs.id, leavers.id, only_leaver.id}) == 3

    answer = offboard(world, world.user_id, successor_id)
    assert set(answer.reassigned_reservation_ids) == {leavers.id, only_leaver.id}
    listed = mine(successor, world.tenant)
    assert set(listed) == {theirs.id, leavers.id, only_leaver.id}
    assert listed[leavers.id].idempotency_key == "shared-key"
    # The successor's own keys still name its own reservations, old and new.
    assert successor.res("Create", shared).id == theirs.id
    fresh = world.create(successor, key="leaver-key", count=1, start=world.later(30))
    assert fresh.id not in (only_leaver.id, theirs.id) and fresh.owner_identity_id == successor_id
    check_invariants(world.conninfo, world.tenant)


def test_drafts_are_deleted_and_a_watch_stream_of_the_leaver_ends(world: World) -> None:
    successor_id, _ = world.identity()
    world.quota(1)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(count=2)
    assert rpc_error(exc)[1] == "QUOTA_EXCEEDED"
    drafts = "SELECT count(*) FROM reservations WHERE owner_identity_id = %s AND state = 'draft'"
    assert world.sql(drafts, (world.user_id,)) == [(1,)]

    with Stream(world.user, tenant_id=world.tenant, from_now=True) as stream:
        offboard(world, world.user_id, successor_id)
        with pytest.raises(grpc.RpcError) as ended:
            stream.take(1)
    assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert world.sql(drafts, (world.user_id,)) == [(0,)]


def test_a_webhook_subscribed_to_reservation_reassigned_receives_it(world: World) -> None:
    successor_id, successor = world.identity()
    moved = world.create(count=1, start=world.later(24))
    receiver = Receiver()
    try:
        hooks(successor, "Create", epb.CreateWebhookRequest(
            tenant_id=world.tenant, url=receiver.url, secret=SECRET, event_types=["reservation.reassigned"]))
        offboard(world, world.user_id, successor_id)
        hits = poll(lambda: receiver.of(subject=f"reservation/{moved.id}"), what="the webhook delivery")
        assert [h.event["type"] for h in hits] == ["reservation.reassigned"] and hits[0].signed
        assert hits[0].event["data"] == {"reservationId": moved.id, "from": world.user_id, "to": successor_id,
                                         "reason": "offboarded", "state": "placed", "poolId": world.pool_id}
    finally:
        receiver.close()


def test_the_schema_refuses_a_new_reservation_for_an_offboarded_identity(world: World) -> None:
    """The guard for a create the identity authenticated just before it was offboarded."""
    successor_id, _ = world.identity()
    offboard(world, world.user_id, successor_id)
    with pytest.raises(psycopg.errors.CheckViolation) as exc:
        world.sql("INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,"
                  " request_hash) VALUES ('rsv_late', %s, %s, %s, 'late', '{}', '')",
                  (world.tenant, world.pool_id, world.user_id))
    assert exc.value.diag.constraint_name == "reservations_owner_not_offboarded"


def test_a_create_authenticated_just_before_its_identity_is_offboarded_is_unauthenticated(world: World) -> None:
    """The race the insert trigger closes (migration 0013): the create authenticated, then the
    offboarding committed before its draft went in. The answer is UNAUTHENTICATED naming the
    identity, not INTERNAL, and nothing is stored."""
    import threading
    import time

    request = world.create_request(count=1, start=world.later(2))
    with psycopg.connect(world.conninfo) as offboarding:  # holds the identity row, as offboarding does
        offboarding.execute("SELECT 1 FROM identities WHERE id = %s FOR UPDATE", (world.user_id,))
        answer: list[BaseException] = []

        def create() -> None:
            try:
                world.user.res("Create", request)
            except grpc.RpcError as exc:
                answer.append(exc)

        caller = threading.Thread(target=create)
        caller.start()
        deadline = time.monotonic() + 30
        while world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE %s", ("%INSERT INTO reservations%",)) == [(0,)]:  # not in its snapshot
            assert time.monotonic() < deadline, "the create's draft insert never waited for the identity row"
            time.sleep(0.02)
        offboarding.execute("UPDATE identities SET offboarded_at = now(), offboard_reason = 'offboarded' WHERE id = %s",
                            (world.user_id,))
        offboarding.commit()
        caller.join(30)
    assert len(answer) == 1
    code, reason, details = rpc_error(pytest.ExceptionInfo.from_exc_info((type(answer[0]), answer[0], None)))
    assert (code, reason, details["identityId"]) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", world.user_id)
    assert world.sql("SELECT count(*) FROM reservations WHERE idempotency_key = %s",
                     (request.idempotency_key,)) == [(0,)]


def test_an_agent_successor_must_be_able_to_act_in_the_tenants_it_would_receive(world: World) -> None:
    """An agent is a member of the tenant, but its person is not: it can never act there (an agent
    acts only where its person is a member too). Named successor, it was accepted and received
    reservations it could neither list nor release. Now INVALID_INPUT, nothing moves."""
    other = f"t{uuid.uuid4().hex[:10]}"
    world.root.admin("CreateTenant", apb.CreateTenantRequest(id=other, name=other))
    person_id, _ = world.identity(tenants=[other])
    agent_id, _ = world.identity(kind="agent", tenants=[world.tenant], person_identity_id=person_id)
    r = world.create(count=1)
    code, reason, details = refused(world, world.user_id, agent_id)
    assert (reason, details["field"], json.loads(details["tenantIds"])) == ("INVALID_INPUT", "successorIdentityId", [world.tenant])
    assert world.sql("SELECT owner_identity_id FROM reservations WHERE id = %s", (r.id,)) == [(world.user_id,)]
