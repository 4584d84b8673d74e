"""Hostile review, round 25e: the operator's surface (Admin) changed under live bookings, and
callers who would act as the platform operator (real control plane on loopback, embedded
PostgreSQL)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world, offered_guest, outcome, refused
from tests.vps_support import SimThread, make_vps, sim  # noqa: F401 (fixture)

NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
INVALID_INPUT = (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT")
INVALID_STATE = (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
# tests/test_confirmation.py's policy: an agent's create is held for its person's confirmation.
CONFIRM_DELEGATED = "permit(principal, action, resource) unless { context.delegated };"


@pytest.fixture
def own_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """A control plane on a database of this test's own (the test may cost root its operator)."""
    yield from module_stack(pg_uri)


def offboard(root: Client, identity: str, successor: str) -> apb.OffboardIdentityResponse:
    return root.admin("OffboardIdentity", apb.OffboardIdentityRequest(identity_id=identity,
                                                                      successor_identity_id=successor))


def test_the_platform_root_identity_cannot_be_offboarded(own_stack: tuple[ServerThread, Client]) -> None:
    server, root = own_stack
    world = make_world(server.endpoint, root, server.conninfo, nodes=0)
    try:
        code, reason, details = refused(offboard, root, bootstrap.ROOT_IDENTITY, world.user_id)
        assert (code, reason) == INVALID_INPUT and details["field"] == "identityId", details
        assert world.sql("SELECT offboarded_at FROM identities WHERE id = 'root'") == [(None,)]
        assert world.sql("SELECT count(*) FROM api_tokens WHERE identity_id = 'root' AND revoked_at IS NOT NULL"
                         ) == [(0,)]
        # The operator still acts, and the bootstrap's break-glass token works.
        root.admin("ListPools", apb.ListPoolsRequest())
        again = Client(server.endpoint, bootstrap.ensure_root(server.conninfo))
        try:
            again.admin("ListPools", apb.ListPoolsRequest())
        finally:
            again.close()
    finally:
        world.close()


def test_no_new_agent_acts_for_an_offboarded_person_nor_inherits_reservations(world: World) -> None:
    person, _ = world.identity()
    heir, heir_client = world.identity()
    offboard(world.root, person, heir)
    agent = f"agent-for-gone-{person}"
    code, reason, details = refused(world.root.admin, "CreateIdentity", apb.CreateIdentityRequest(
        id=agent, kind="agent", tenant_ids=[world.tenant], delegation=apb.Delegation(person_identity_id=person)))
    assert (code, reason) == INVALID_STATE and details.get("personIdentityId") == person, details
    assert world.sql("SELECT count(*) FROM identities WHERE id = %s", (agent,)) == [(0,)]
    # So nothing can be handed to one: the heir's reservation stays with someone who can act.
    rsv = world.create(heir_client, count=1)
    assert outcome(world.root.admin, "RemoveMembership", apb.RemoveMembershipRequest(
        identity_id=heir, tenant_id=world.tenant, successor_identity_id=agent))[:2] == NOT_FOUND
    assert world.sql("SELECT owner_identity_id FROM reservations WHERE id = %s", (rsv.id,)) == [(heir,)]


def test_offering_a_pool_to_its_owner_is_refused_and_writes_nothing(world: World) -> None:
    code, reason, details = refused(world.root.admin, "OfferPool", apb.OfferPoolRequest(
        pool_id=world.pool_id, tenant_id=world.tenant))
    assert (code, reason) == INVALID_INPUT and details["field"] == "tenantId", details
    assert world.sql("SELECT count(*) FROM pool_offers WHERE pool_id = %s", (world.pool_id,)) == [(0,)]
    pool = next(p for p in world.root.admin("ListPools", apb.ListPoolsRequest(owner_tenant_id=world.tenant)).items
                if p.id == world.pool_id)
    assert list(pool.offered_to) == []


@pytest.mark.parametrize("call, request_, field", [
    ("GetQuotaUsage", apb.GetQuotaUsageRequest(tenant_id="no-such-tenant"), "tenantId"),
    ("ListTokens", apb.ListTokensRequest(identity_id="no-such-identity"), "identityId"),
    ("ListNodes", apb.ListNodesRequest(pool_id="pool_" + "0" * 26), "poolId"),
])
def test_reading_an_absent_tenant_identity_or_pool_is_not_found(world: World, call: str, request_, field: str) -> None:
    code, reason, details = refused(world.root.admin, call, request_)
    assert (code, reason) == NOT_FOUND, (call, details)
    assert field in details, details


def test_an_agent_is_never_its_own_person(world: World) -> None:
    world.policy(CONFIRM_DELEGATED)
    agent = f"agent-self-{world.tenant}"
    code, reason, details = refused(world.root.admin, "CreateIdentity", apb.CreateIdentityRequest(
        id=agent, kind="agent", tenant_ids=[world.tenant],
        delegation=apb.Delegation(person_identity_id=agent, confirm_actions=["compute:reservations:create"])))
    assert (code, reason) == INVALID_INPUT and details["field"] == "delegation.personIdentityId", details
    assert world.sql("SELECT count(*) FROM identities WHERE id = %s", (agent,)) == [(0,)]


def _waiting_on_locks(world: World, count: int, seconds: float = 10) -> None:
    """Until `count` backends of the world's database wait for a lock."""
    deadline = time.monotonic() + seconds
    while world.sql("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'")[0][0] < count:
        assert time.monotonic() < deadline, "the calls never queued on the locks"
        time.sleep(0.02)


def _remove(world: World, identity: str, successor: str = "") -> object:
    return outcome(world.root.admin, "RemoveMembership", apb.RemoveMembershipRequest(
        identity_id=identity, tenant_id=world.tenant, successor_identity_id=successor))


@pytest.mark.parametrize("how", ["RemoveMembership", "OffboardIdentity"])
def test_a_successor_removed_from_the_tenant_meanwhile_inherits_nothing(world: World, how: str) -> None:
    leaving, leaving_client = world.identity()
    heir, _ = world.identity()
    rsv = world.create(leaving_client, count=1)
    with psycopg.connect(world.conninfo) as blocker:  # holds the heir's membership row a moment
        blocker.execute("SELECT 1 FROM memberships WHERE tenant_id = %s AND identity_id = %s FOR UPDATE",
                        (world.tenant, heir))
        with ThreadPoolExecutor(2) as threads:
            heir_leaves = threads.submit(_remove, world, heir)  # locks the heir, waits for its membership
            _waiting_on_locks(world, 1)
            if how == "RemoveMembership":
                handing = threads.submit(_remove, world, leaving, heir)
            else:
                handing = threads.submit(outcome, offboard, world.root, leaving, heir)
            _waiting_on_locks(world, 2)  # it waits for the heir's identity row
            blocker.rollback()
            assert heir_leaves.result().changed
            answer = handing.result()
    assert isinstance(answer, tuple) and answer[:2] == INVALID_INPUT, answer
    assert answer[2]["field"] == "successorIdentityId", answer
    owner = world.sql("SELECT owner_identity_id FROM reservations WHERE id = %s", (rsv.id,))[0][0]
    members = {r[0] for r in world.sql("SELECT identity_id FROM memberships WHERE tenant_id = %s", (world.tenant,))}
    assert owner == leaving and owner in members


def test_a_grant_and_the_withdrawal_of_its_pools_offer_never_both_commit(world: World, sim: SimThread) -> None:
    """WithdrawPoolOffer is refused while the tenant holds a live grant on the pool, and a grant
    needs the pool offered to its grantee: at once, one of the two must lose."""
    v = make_vps(world, sim, total=4)
    guest = offered_guest(world)
    try:
        with psycopg.connect(world.conninfo) as blocker:  # the offer row, held a moment
            blocker.execute("SELECT 1 FROM pool_offers WHERE pool_id = %s AND tenant_id = %s FOR KEY SHARE",
                            (world.pool_id, guest.tenant))
            with ThreadPoolExecutor(1) as threads:
                withdrawing = threads.submit(outcome, world.root.admin, "WithdrawPoolOffer",
                                             apb.WithdrawPoolOfferRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
                _waiting_on_locks(world, 1)  # found no grant (or waits to look), waits to delete the offer
                granted = outcome(v.root, "grants", "Create", v.grant_request(tenant=guest.tenant))
                blocker.rollback()
                withdrawn = withdrawing.result()
        live = world.sql("SELECT id FROM reservation_grants WHERE pool_id = %s AND tenant_id = %s"
                         " AND state IN ('scheduled', 'active')", (world.pool_id, guest.tenant))
        offered = world.sql("SELECT 1 FROM pool_offers WHERE pool_id = %s AND tenant_id = %s",
                            (world.pool_id, guest.tenant))
        assert not (live and not offered), (granted, withdrawn)
        if live:  # the grant won: the withdrawal names it
            assert withdrawn[:2] == INVALID_STATE and withdrawn[2]["grantId"] == live[0][0], withdrawn
        else:  # the withdrawal won: the grant was refused as for a pool never offered
            assert granted[:2] == INVALID_INPUT and granted[2]["reason"] == "pool-not-offered", granted
    finally:
        guest.close()


def test_an_agent_created_while_its_person_is_offboarded_is_refused_or_disabled(world: World) -> None:
    person, _ = world.identity()
    heir, _ = world.identity()
    agent = f"agent-late-{world.tenant}"
    with psycopg.connect(world.conninfo) as blocker:  # the agent's id, taken a moment: its create waits
        blocker.execute("INSERT INTO identities (id, kind, name) VALUES (%s, 'user', %s)", (agent, agent))
        with ThreadPoolExecutor(2) as threads:
            creating = threads.submit(outcome, world.root.admin, "CreateIdentity", apb.CreateIdentityRequest(
                id=agent, kind="agent", tenant_ids=[world.tenant], delegation=apb.Delegation(person_identity_id=person)))
            _waiting_on_locks(world, 1)  # it read the person, and waits to write the agent
            offboarding = threads.submit(outcome, offboard, world.root, person, heir)
            deadline = time.monotonic() + 10
            while not offboarding.done() and world.sql(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'")[0][0] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            blocker.rollback()
            created, gone = creating.result(), offboarding.result()
    assert gone.changed, gone
    rows = world.sql("SELECT offboard_reason FROM identities WHERE id = %s", (agent,))
    assert rows in ([], [("delegator-offboarded",)]), (rows, created)
    if rows:  # made first: disabled with its person, and named in the answer
        assert list(gone.disabled_agent_ids) == [agent]
    else:
        assert created[:2] == INVALID_STATE, created
