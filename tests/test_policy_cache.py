"""A tenant's Cedar policy is parsed once per version, and a new version decides at once."""

from __future__ import annotations

import uuid

from controlplane import iam
from controlplane.auth import Caller

PERMIT = "permit(principal, action, resource);"
FORBID_BIG = PERMIT + ' forbid(principal, action, resource) when { resource.gpus > 4 };'


def _decide(tenant: str, policy: str, gpus: int) -> iam.Decision:
    caller = Caller("u1", "user", frozenset({tenant}))
    return iam.decide(policy, caller, iam.CREATE, "Reservation", "r1", {"gpus": gpus}, tenant_id=tenant)


def test_a_policy_is_parsed_once_per_version() -> None:
    tenant = f"t-{uuid.uuid4().hex}"
    before = iam.POLICIES.parses
    assert all(_decide(tenant, PERMIT, 8).allowed for _ in range(5))
    assert iam.POLICIES.parses == before + 1
    assert not _decide(tenant, FORBID_BIG, 8).allowed  # the new version, parsed once
    assert _decide(tenant, FORBID_BIG, 2).allowed
    assert iam.POLICIES.parses == before + 2


def test_the_cache_keeps_its_bound() -> None:
    cache = iam.PolicyCache(2)
    for n in range(4):
        cache.get(f"t{n}", PERMIT)
    cache.get("t3", PERMIT)
    assert cache.parses == 4
    cache.get("t0", PERMIT)  # evicted: parsed again
    assert cache.parses == 5


def test_an_unparsable_stored_policy_still_denies() -> None:
    assert not _decide(f"t-{uuid.uuid4().hex}", "permit(principal, action, resource", 1).allowed
