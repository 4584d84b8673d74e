"""Hostile review, round 22b: a hostile tenant member, node and webhook receiver against Watch,
webhooks, the node gateway, grants, instances, usage, confirmations, admin calls and
idempotency keys. Each test reproduces a broken promise on the current code (real control plane
on loopback, embedded PostgreSQL).

- reservationGrants.create looks its idempotency key up before IAM: an agent the root policy
  refuses reads a grant (or its id, through CONFLICT) by replaying root's key.
- Webhooks.ListDeliveries decides only compute:webhooks:manage: a member refused
  compute:events:read reads the tenant's event ids, types and subjects through another member's
  webhook.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc as egrpc
from bettercompute.v1 import grants_pb2 as gpb
from tests.conftest import module_stack
from tests.support import PERMISSIVE, Client, ServerThread, World, make_world
from tests.vps_support import HOUR, SimThread, Stubs, Vps, outcome, own_stack, sim, v, world_of  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from own_stack(pg_uri)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    yield from world_of(stack)


# An agent acting for a root member, which the root policy refuses --------------------------------


def _refused_root_agent(v: Vps) -> Stubs:
    """An agent for a person of the root tenant; the root policy refuses every delegated call
    (DESIGN/decisions: provider accounts and grants "stay the policy's to refuse" for an agent,
    which is refused every Admin call outright, so it cannot lift the policy either)."""
    person_id, _ = v.world.identity(tenants=["root"])
    _, agent = v.world.identity(kind="agent", tenants=["root"], person_identity_id=person_id)
    v.world.root.admin("PutPolicy", apb.PutPolicyRequest(
        tenant_id="root", cedar="permit(principal, action, resource) unless { context.delegated };"))
    return Stubs(agent)


def test_an_agent_the_root_policy_refuses_cannot_read_a_grant_by_replaying_its_key(v: Vps) -> None:
    """reservationGrants.create is decided as compute:providers:manage on the provider account
    (spec 001, create: "Who. Decided as compute:providers:manage on the provider account. ...
    anyone else is ACCESS_DENIED"). An agent the root policy refuses is ACCESS_DENIED on get, list,
    end and on a create under a fresh key, yet a create under a key root already used answers the
    whole grant (same request) or CONFLICT naming the grant's id (another request) with no
    decision at all: grants.create looks the key up before IAM."""
    start = v.now() + HOUR
    g = v.grant(slots=2, starts_at=start, key="q3-commit")
    spy = _refused_root_agent(v)
    denied = (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    # The policy holds everywhere else.
    assert outcome(lambda: spy("grants", "Get", gpb.GetReservationGrantRequest(
        tenant_id="root", grant_id=g.id)))[:2] == denied
    assert outcome(lambda: spy("grants", "List", gpb.ListReservationGrantsRequest(
        tenant_id="root", all=True)))[:2] == denied
    assert outcome(lambda: spy("grants", "End", gpb.EndReservationGrantRequest(
        tenant_id="root", account_id=v.account_id, grant_id=g.id)))[:2] == denied
    assert outcome(lambda: spy("grants", "Create", v.grant_request(slots=1, starts_at=start)))[:2] == denied
    # The same key: the grant is answered (same request) or its id told (another request).
    same = outcome(lambda: spy("grants", "Create", v.grant_request(slots=2, starts_at=start, key="q3-commit")))
    assert not isinstance(same, gpb.ReservationGrant), \
        f"a refused agent read the grant by replaying its key: {same.id} for {same.tenant_id}, {same.slots} slots"
    assert same[:2] == denied, same
    other = outcome(lambda: spy("grants", "Create", v.grant_request(slots=3, starts_at=start, key="q3-commit")))
    assert other[:2] == denied, f"a refused agent learns the key's grant: {other}"


# A member allowed to manage webhooks but refused the tenant's events ------------------------------

LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)


@pytest.fixture(scope="module")
def hook_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=1)


def test_a_member_refused_the_events_cannot_read_them_through_another_members_webhook_deliveries(
        hook_stack: tuple[ServerThread, Client]) -> None:
    """A webhook is held to what Watch would be allowed (events.proto: Create "also needs what
    Events.Watch with the same event types needs (compute:events:read)"; docs/decisions.md: an
    identity allowed webhooks:manage and refused compute:events:read must not receive the
    tenant's events through a webhook). A member the policy allows webhooks:manage and refuses
    compute:events:read is ACCESS_DENIED on Watch and on creating a webhook, yet ListDeliveries of
    a webhook another member made answers the tenant's event stream: every event's id, type and
    subject (which reservation was placed, released, ...). ListDeliveries decides only
    compute:webhooks:manage."""
    server, root = hook_stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=1)
    try:
        spy_id, spy = w.identity()
        w.policy(f'{PERMISSIVE}\nforbid(principal == Identity::"{spy_id}", '
                 'action == Action::"compute:events:read", resource);')
        hooks = egrpc.WebhooksStub(w.user.channel)
        hook = hooks.Create(epb.CreateWebhookRequest(tenant_id=w.tenant, url="http://127.0.0.1:9/hook"),
                            metadata=w.user.metadata, timeout=30)
        r = w.create(count=1)
        assert r.state == "placed", r
        # The policy holds where events are read.
        watch = egrpc.EventsStub(spy.channel).Watch(epb.WatchRequest(tenant_id=w.tenant), metadata=spy.metadata,
                                                     timeout=10)
        assert outcome(lambda: next(iter(watch)))[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
        spy_hooks = egrpc.WebhooksStub(spy.channel)
        assert outcome(lambda: spy_hooks.Create(epb.CreateWebhookRequest(
            tenant_id=w.tenant, url="http://127.0.0.1:9/spy"), metadata=spy.metadata, timeout=30))[:2] == \
            (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
        # Through the deliveries of the user's webhook, the events.
        seen = outcome(lambda: spy_hooks.ListDeliveries(epb.ListDeliveriesRequest(
            tenant_id=w.tenant, webhook_id=hook.id), metadata=spy.metadata, timeout=30))
        if isinstance(seen, epb.ListDeliveriesResponse):
            told = [(d.event_id, d.event_type, d.subject) for d in seen.items]
            assert not any(r.id in subject for _, _, subject in told), \
                f"a member refused compute:events:read reads the tenant's events through ListDeliveries: {told}"
        else:
            assert seen[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED"), seen
    finally:
        w.close()
