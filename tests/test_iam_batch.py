"""iam.allowed_each (a listing's items decided in one Cedar batch) answers what `decide` answers
item by item, for users and for delegated agents whose person is refused some items."""

from __future__ import annotations

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane import iam
from controlplane.auth import Caller

POLICIES = [
    "permit(principal, action, resource);",
    'permit(principal, action, resource);\nforbid(principal == Identity::"person", action, resource) '
    'when { resource.ownerIdentityId == "o2" };',
    'permit(principal, action, resource) when { resource.ownerIdentityId == principal.kind || '
    'resource.poolId == "p1" };',
    'permit(principal, action, resource);\nforbid(principal, action, resource) when { context.delegated && '
    'resource.state == "active" };',
    'permit(principal, action, resource);\nforbid(principal, action == Action::"compute:reservations:read", '
    'resource == Reservation::"r-3");',
]
CALLERS = [
    Caller("user-1", "user", frozenset({"t"})),
    Caller("agent-1", "agent", frozenset({"t"}), delegator_id="person"),
    Caller("person", "user", frozenset({"t"})),
]
ROWS = st.lists(st.tuples(st.sampled_from(["o1", "o2", "user", "agent"]), st.sampled_from(["p1", "p2"]),
                          st.sampled_from(["placed", "active"])), max_size=12)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(POLICIES), caller=st.sampled_from(CALLERS), rows=ROWS)
def test_a_batch_answers_what_decide_answers_item_by_item(policy: str, caller: Caller, rows) -> None:
    tenant = "t"
    resources = [(f"r-{i}", {"tenantId": tenant, "ownerIdentityId": owner, "poolId": pool, "state": state})
                 for i, (owner, pool, state) in enumerate(rows)]
    one_by_one = [iam.decide(policy, caller, iam.READ, "Reservation", rid, attrs, tenant_id=tenant).allowed
                  for rid, attrs in resources]
    assert iam.allowed_each(policy, caller, iam.READ, "Reservation", resources, tenant_id=tenant) == one_by_one


def test_no_policy_or_a_refused_person_allows_nothing() -> None:
    tenant = f"t-{uuid.uuid4().hex}"
    resources = [("r-1", {"ownerIdentityId": "o1"}), ("r-2", {"ownerIdentityId": "o2"})]
    agent = CALLERS[1]
    assert iam.allowed_each(None, agent, iam.READ, "Reservation", resources, tenant_id=tenant) == [False, False]
    assert iam.allowed_each(POLICIES[1], agent, iam.READ, "Reservation", resources,
                            tenant_id=tenant) == [True, False]
    assert iam.allowed_each(POLICIES[1], CALLERS[0], iam.READ, "Reservation", resources,
                            tenant_id=tenant) == [True, True]
