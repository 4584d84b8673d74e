"""Leftovers of tenancy and administration, each a gap an earlier review noted (DESIGN.md section 7,
spec "Waiting for placement"; docs/decisions.md "Offboarding" and "Removing a membership"):

- an operator could add an identity to a tenant but not take it out of one while it stays in its
  others (Admin.RemoveMembership: its tokens stop acting there at once, its live reservations
  there pass to a successor as offboarding passes them);
- two pools may share a name: ids are what identifies a pool (a documented choice);
- a create waiting on the pool-lease placer was handed its answer by the batch without its token
  being read, so a token revoked after the wait's last read still got that answer.

Real control plane on loopback, real gRPC, real PostgreSQL; the database is read only to check
what is stored (and, for the races, to hold a row lock as the racing transaction does)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.common.status import error_info
from controlplane.ids import draft_id
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, pool_locked
from tests.support import Client, World, make_world, refused
from tests.test_admission_leftovers import lease_pool, queued
from tests.test_confirmation import agent_world, require_confirmation
from tests.test_watch import Stream


def remove(world: World, identity: str, tenant: str, successor: str = "",
           client: Client | None = None) -> apb.RemoveMembershipResponse:
    return (client or world.root).admin("RemoveMembership", apb.RemoveMembershipRequest(
        identity_id=identity, tenant_id=tenant, successor_identity_id=successor))


def mine(client: Client, tenant: str) -> dict[str, pb.Reservation]:
    return {r.id: r for r in client.res("List", pb.ListReservationsRequest(tenant_id=tenant, scope="mine")).items}


def denied_in(client: Client, tenant: str) -> None:
    code, reason, details = refused(client.res, "List", pb.ListReservationsRequest(tenant_id=tenant))
    assert (code, reason, details["tenantId"]) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED", tenant)


def reassigned(world: World, rid: str) -> list[dict]:
    return [row[0] for row in world.sql(
        "SELECT data FROM events WHERE subject = %s AND type = 'reservation.reassigned' ORDER BY id",
        (f"reservation/{rid}",))]


def member_of(world: World, identity: str) -> list[str]:
    return [r[0] for r in world.sql("SELECT tenant_id FROM memberships WHERE identity_id = %s ORDER BY tenant_id",
                                    (identity,))]


@pytest.fixture
def other(world: World) -> Iterator[World]:
    """A second tenant with a pool of its own."""
    w = make_world(world.endpoint, world.root, world.conninfo, nodes=1)
    yield w
    w.close()


# -- Removing a membership ----------------------------------------------------------------------


def test_a_member_removed_from_one_tenant_loses_it_at_once_and_keeps_its_others(world: World, other: World) -> None:
    """Before: no call took an identity out of a tenant (only offboarding, from every tenant).
    Removed from one, its token is ACCESS_DENIED there from the commit and works in its other
    tenant; its live reservations there pass to the successor, one reservation.reassigned each,
    one version further; terminal ones, and everything in its other tenant, stay its own."""
    leaver_id, leaver = world.identity(tenants=[world.tenant, other.tenant])
    successor_id, successor = world.identity()
    placed = world.create(leaver, count=1, start=world.later(24))
    pending = world.create(leaver, count=8, model="none-such")
    active = SigningNodes(world).activate(world.create(leaver, count=1, duration="2h").id)
    ended = world.create(leaver, count=1, start=world.later(30))
    leaver.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=ended.id))
    elsewhere = other.create(leaver, count=1, start=other.later(24))
    before = mine(leaver, world.tenant)
    live = {placed.id, pending.id, active.id}

    answer = remove(world, leaver_id, world.tenant, successor_id)
    assert answer.changed and (answer.identity_id, answer.tenant_id) == (leaver_id, world.tenant)
    assert set(answer.reassigned_reservation_ids) == live
    assert list(answer.removed_agent_ids) == [] and list(answer.expired_reservation_ids) == []

    denied_in(leaver, world.tenant)
    code, reason, _ = refused(world.create, leaver, count=1)
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    assert set(mine(leaver, other.tenant)) == {elsewhere.id}  # the same token, its other tenant
    assert member_of(world, leaver_id) == [other.tenant]

    theirs = mine(successor, world.tenant)
    assert set(theirs) == live
    for rid in live:
        assert theirs[rid].owner_identity_id == successor_id
        assert theirs[rid].state == before[rid].state and theirs[rid].version == before[rid].version + 1
        assert reassigned(world, rid) == [{"reservationId": rid, "from": leaver_id, "to": successor_id,
                                           "reason": "membership-removed", "state": before[rid].state,
                                           "poolId": world.pool_id}]
    kept = successor.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=ended.id))
    assert kept.owner_identity_id == leaver_id and reassigned(world, ended.id) == []  # history
    assert reassigned(world, elsewhere.id) == []
    released = successor.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=active.id))
    assert released.state == "released"
    check_invariants(world.conninfo, world.tenant)


def test_removing_again_changes_nothing_and_a_bad_request_changes_nothing_and_names_the_field(
        world: World, other: World) -> None:
    leaver_id, leaver = world.identity()
    outsider_id, outsider = world.identity(tenants=[other.tenant])
    kept = world.create(leaver, count=1, start=world.later(24))

    # A successor is needed as something moves; it must be able to act in the tenant.
    code, reason, details = refused(remove, world, leaver_id, world.tenant)
    assert (code, reason, details["field"], json.loads(details["reservationIds"])) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "successorIdentityId", [kept.id])
    code, reason, details = refused(remove, world, leaver_id, world.tenant, outsider_id)
    assert (reason, details["field"], json.loads(details["tenantIds"])) == (
        "INVALID_INPUT", "successorIdentityId", [world.tenant])
    assert refused(remove, world, leaver_id, world.tenant, leaver_id)[2]["field"] == "successorIdentityId"
    assert refused(remove, world, leaver_id, world.tenant, "bad id\x00")[2]["field"] == "successorIdentityId"
    assert refused(remove, world, "nobody-here", world.tenant, world.user_id)[1:] == (
        "NOT_FOUND", {"identityId": "nobody-here"})
    assert refused(remove, world, leaver_id, "no-such-tenant", world.user_id)[1:] == (
        "NOT_FOUND", {"tenantId": "no-such-tenant"})
    assert refused(remove, world, leaver_id, world.tenant, "nobody-here")[1:] == (
        "NOT_FOUND", {"successorIdentityId": "nobody-here"})
    # Root's own seat in the root tenant is not removable: nobody could administer afterwards.
    assert refused(remove, world, "root", "root")[2]["field"] == "identityId"
    # Root only, as every Admin call; an agent of a root member neither.
    assert refused(remove, world, leaver_id, world.tenant, world.user_id, client=outsider)[1] == "ACCESS_DENIED"
    assert refused(remove, world, leaver_id, world.tenant, world.user_id, client=leaver)[1] == "ACCESS_DENIED"
    assert set(mine(leaver, world.tenant)) == {kept.id}  # nothing moved, the token still acts there

    first = remove(world, leaver_id, world.tenant, world.user_id)
    assert first.changed and list(first.reassigned_reservation_ids) == [kept.id]
    again = remove(world, leaver_id, world.tenant, world.user_id)
    assert not again.changed and list(again.reassigned_reservation_ids) == []
    assert not remove(world, leaver_id, world.tenant).changed  # no successor needed: nothing to move
    assert len(reassigned(world, kept.id)) == 1
    # Added back, it is a member as any other (CreateIdentity adds a membership), without its old reservations.
    world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=leaver_id, kind="user", tenant_ids=[world.tenant]))
    assert mine(leaver, world.tenant) == {}


def test_a_member_without_live_reservations_needs_no_successor_and_its_drafts_go(world: World) -> None:
    leaver_id, leaver = world.identity()
    world.quota(1)
    assert refused(world.create, leaver, count=2)[1] == "QUOTA_EXCEEDED"  # leaves its draft
    drafts = "SELECT count(*) FROM reservations WHERE owner_identity_id = %s AND state = 'draft'"
    assert world.sql(drafts, (leaver_id,)) == [(1,)]
    answer = remove(world, leaver_id, world.tenant)
    assert answer.changed and not answer.successor_identity_id and list(answer.reassigned_reservation_ids) == []
    assert world.sql(drafts, (leaver_id,)) == [(0,)]
    denied_in(leaver, world.tenant)


def test_the_persons_agents_leave_the_tenant_with_it_and_their_confirmations_are_withdrawn(
        world: World, other: World) -> None:
    """An agent acts only where its person is a member: removed with its person, its live
    reservations there pass to the successor (reason delegator-membership-removed), the request it
    holds for confirmation expires with its confirmation withdrawn; in the person's other tenant
    nothing changes."""
    world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=world.user_id, kind="user",
                                                                  tenant_ids=[other.tenant]))
    agent_id, agent = agent_world(world)
    world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=agent_id, kind="agent", tenant_ids=[other.tenant],
                                                                  delegation=apb.Delegation(
                                                                      person_identity_id=world.user_id)))
    successor_id, successor = world.identity()
    approved = require_confirmation(world, agent, "agent-placed")
    world.user.conf("Approve", pb.DecideConfirmationRequest(tenant_id=world.tenant,
                                                            confirmation_id=approved["confirmationId"]))
    placed = world.create(agent, key="agent-placed", count=2)
    assert placed.state == "placed"
    held = require_confirmation(world, agent, "agent-held")

    answer = remove(world, world.user_id, world.tenant, successor_id)
    assert list(answer.removed_agent_ids) == [agent_id]
    assert list(answer.reassigned_reservation_ids) == [placed.id]
    assert list(answer.expired_reservation_ids) == [held["reservationId"]]
    assert list(answer.withdrawn_confirmation_ids) == [held["confirmationId"]]
    assert reassigned(world, placed.id)[0]["reason"] == "delegator-membership-removed"
    assert world.sql("SELECT state FROM confirmations WHERE id = %s", (held["confirmationId"],)) == [("withdrawn",)]
    expired = successor.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=held["reservationId"]))
    assert (expired.state, expired.owner_identity_id) == ("expired", agent_id)

    denied_in(agent, world.tenant)
    denied_in(world.user, world.tenant)
    assert member_of(world, agent_id) == [other.tenant] and member_of(world, world.user_id) == [other.tenant]
    # Added back, the person does not bring the agent back with it.
    world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=world.user_id, kind="user",
                                                                  tenant_ids=[world.tenant]))
    denied_in(agent, world.tenant)
    check_invariants(world.conninfo, world.tenant)


def test_an_open_watch_stream_in_the_tenant_ends_access_denied_before_its_next_event(world: World) -> None:
    """The stream authenticated once: it kept delivering the tenant's events (here the very
    reservation.reassigned of its own reservations) to an identity no longer a member."""
    leaver_id, leaver = world.identity()
    successor_id, _ = world.identity()
    moved = world.create(leaver, count=1, start=world.later(24))
    with Stream(leaver, tenant_id=world.tenant, from_now=True) as stream:
        seen = world.create(count=1, start=world.later(30))  # streamed: the stream is open and reading
        assert [e.subject for e in stream.take(1)] == [f"reservation/{seen.id}"]
        remove(world, leaver_id, world.tenant, successor_id)
        with pytest.raises(grpc.RpcError) as ended:
            stream.take(1)
    assert ended.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(ended.value).reason == "ACCESS_DENIED"
    assert len(reassigned(world, moved.id)) == 1


def test_a_create_authenticated_just_before_the_removal_is_access_denied_and_stores_nothing(world: World) -> None:
    """The caller lookup takes no lock: a create authenticated, then the removal committed before
    its draft went in. Its draft was written for an owner who could no longer act in the tenant,
    and placed there, unseen by the removal. Now the draft's insert waits for the membership row
    and finds it gone (migration 0052): ACCESS_DENIED naming the tenant, nothing stored."""
    leaver_id, leaver = world.identity()
    request = world.create_request(count=1, start=world.later(2))
    answer: list[Any] = []
    with psycopg.connect(world.conninfo) as removal:  # holds the membership row, as the removal does
        removal.execute("SELECT 1 FROM memberships WHERE identity_id = %s AND tenant_id = %s FOR UPDATE",
                        (leaver_id, world.tenant))

        def create() -> None:
            try:
                answer.append(leaver.res("Create", request))
            except grpc.RpcError as exc:
                answer.append(exc)

        caller = threading.Thread(target=create)
        caller.start()
        deadline = time.monotonic() + 30
        while world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE %s", ("%INSERT INTO reservations%",)) == [(0,)]:
            assert time.monotonic() < deadline, "the create's draft insert never waited for the membership row"
            time.sleep(0.02)
        removal.execute("DELETE FROM memberships WHERE identity_id = %s AND tenant_id = %s", (leaver_id, world.tenant))
        removal.commit()
        caller.join(30)
    assert len(answer) == 1 and isinstance(answer[0], grpc.RpcError), answer
    info = error_info(answer[0])
    assert (answer[0].code(), info.reason, dict(info.metadata)) == (
        grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED", {"tenantId": world.tenant})
    assert world.sql("SELECT count(*) FROM reservations WHERE idempotency_key = %s",
                     (request.idempotency_key,)) == [(0,)]


def test_the_schema_refuses_a_new_draft_for_an_owner_who_is_not_a_member(world: World) -> None:
    outsider = f"user-{uuid.uuid4().hex[:10]}"
    world.sql("INSERT INTO identities (id, kind, name) VALUES (%s, 'user', %s)", (outsider, outsider))
    with pytest.raises(psycopg.errors.CheckViolation) as exc:
        world.sql("INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,"
                  " request_hash) VALUES ('rsv_outsider', %s, %s, %s, 'k', '{}', '')",
                  (world.tenant, world.pool_id, outsider))
    assert exc.value.diag.constraint_name == "reservations_owner_still_member"


# -- A create's wait ends with its token and its membership -----------------------------------


def waiting_create(world: World, key: str) -> tuple[str, str, Client, Any, str]:
    """A new identity with a token of its own starts a create with wait on the world's (lease)
    pool in the background: (identity, token id, client, the call's future, reservation id)."""
    ident, _ = world.identity()
    token = world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="1h"))
    caller = Client(world.endpoint, token.secret)
    request = world.create_request(key=key, count=1, start=world.later(2), wait=pb.Wait(timeout_ms=20_000))
    future = caller._r.Create.future(request, metadata=caller.metadata, timeout=60)
    return ident, token.id, caller, future, draft_id(world.tenant, ident, key)


def outcome_of(future: Any) -> str:
    try:
        return future.result().state
    except grpc.RpcError as exc:
        return error_info(exc).reason


@pytest.mark.parametrize("ending", ["token-revoked", "membership-removed"])
def test_a_wait_handed_its_answer_by_the_batch_ends_when_its_caller_no_longer_can_act(world: World,
                                                                                       ending: str) -> None:
    """The batch of the wait's own process hands it the reservation as committed, and the wait
    answered that without reading: a token revoked (or a membership removed) after the wait's
    last read still got the answer. Here the batch's own transaction revokes the token (or deletes
    the membership; a test trigger), so every read before it found the token live and the next
    answer is the hand-off: UNAUTHENTICATED (ACCESS_DENIED), as a read would have answered."""
    lease_pool(world)
    ident, _ = world.identity()
    token = world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="1h"))
    key = f"handed-{ending}"
    rid = draft_id(world.tenant, ident, key)
    action = ("UPDATE api_tokens SET revoked_at = now() WHERE id = '%s'" % token.id if ending == "token-revoked" else
              "DELETE FROM memberships WHERE identity_id = '%s' AND tenant_id = '%s'" % (ident, world.tenant))
    fn = f"test_end_caller_{uuid.uuid4().hex[:8]}"
    world.sql(f"CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN {action}; RETURN NEW; END $$")
    world.sql(f"CREATE TRIGGER {fn} AFTER UPDATE ON reservations FOR EACH ROW "
              f"WHEN (NEW.id = '{rid}' AND OLD.state = 'queued' AND NEW.state <> 'queued') EXECUTE FUNCTION {fn}()")
    caller = Client(world.endpoint, token.secret)
    try:
        answer = outcome_of(caller._r.Create.future(world.create_request(
            key=key, count=1, start=world.later(2), wait=pb.Wait(timeout_ms=20_000)),
            metadata=caller.metadata, timeout=60))
    finally:
        world.sql(f"DROP TRIGGER {fn} ON reservations")
        world.sql(f"DROP FUNCTION {fn}()")
        caller.close()
    assert answer == ("UNAUTHENTICATED" if ending == "token-revoked" else "ACCESS_DENIED")
    assert world.sql("SELECT state FROM reservations WHERE id = %s", (rid,))[0][0] in ("placed", "binding")


def test_a_wait_whose_caller_is_removed_from_the_tenant_ends_access_denied(world: World) -> None:
    """The wait read the reservation with the token's state only: removed from the tenant (its
    queued reservation passed to the successor), the caller kept waiting and was answered the
    successor's reservation."""
    lease_pool(world)
    with pool_locked(world):  # the batch waits: the wait reads, again and again
        ident, _, caller, future, rid = waiting_create(world, "removed-while-waiting")
        try:
            queued(world, rid)
            remove(world, ident, world.tenant, world.user_id)
            assert outcome_of(future) == "ACCESS_DENIED"
        finally:
            caller.close()
    assert world.sql("SELECT owner_identity_id FROM reservations WHERE id = %s", (rid,)) == [(world.user_id,)]


# -- Pool names are labels; ids identify pools --------------------------------------------------


def test_two_pools_may_share_a_name_and_every_call_tells_them_apart_by_id(world: World) -> None:
    """docs/decisions.md "Pool names": a name is a label for people, not an identity. A second
    pool named like the world's is created, listed beside it with its own id, and a create or a
    preview names the pool by id, so each lands on the pool it names; nothing a tenant is
    answered carries the name."""
    twin = world.root.admin("CreatePool", apb.CreatePoolRequest(owner_tenant_id=world.tenant, name="p", region="eu-1"))
    listed = world.root.admin("ListPools", apb.ListPoolsRequest(owner_tenant_id=world.tenant)).items
    assert sorted((p.name, p.id) for p in listed) == sorted([("p", world.pool_id), ("p", twin.id)])
    assert twin.id != world.pool_id

    empty = world.create(count=1, pool_id=twin.id)  # the twin has no node: pending there
    placed = world.create(count=1)
    assert (empty.pool_id, empty.state) == (twin.id, "pending")
    assert (placed.pool_id, placed.state) == (world.pool_id, "placed")
    assert world.sql("SELECT DISTINCT n.pool_id FROM allocations a JOIN nodes n ON n.id = a.node_id "
                     "WHERE a.reservation_id = %s", (placed.id,)) == [(world.pool_id,)]
    code, reason, details = refused(world.create, count=1, pool_id="p")  # a name is not a pool id
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "poolId")
