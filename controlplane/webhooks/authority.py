"""What a webhook may deliver: what its creator could read with Events.Watch, now.

A webhook reads a tenant's events, so it is held to Watch's decision: compute:events:read on the
tenant, with Watch's attributes for the same filter (`types`: the webhook's event types, `[]` for
all; `subject`: "", as a webhook has no subject filter). Create decides it for the caller beside
compute:webhooks:manage (ACCESS_DENIED naming the entries refused). Each delivery attempt decides
it again with the creator's authority (the webhook acts as `created_by`), as Watch decides again
per batch: a refused delivery is dead at once, with a reason, and nothing is sent. The creator
must still be an active member of the tenant (an agent: its person too), as authentication asks
of a Watch caller. Decisions are cached per webhook, creator and policy version, so a delivery
costs no policy read and no Cedar evaluation while the policy stays (docs/decisions.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from psycopg_pool import AsyncConnectionPool

from controlplane import authorize, db, errors
from controlplane.auth import Caller
from controlplane.watch import EVENTS_READ

REFUSED = "refused by IAM: the webhook's creator may no longer read these events (compute:events:read)"
CREATOR_GONE = "refused: the webhook's creator is offboarded or no longer a member of the tenant"

_POLICY = "SELECT cedar, version FROM policies WHERE tenant_id = %(tenant_id)s"


def attributes(event_types: list[str]) -> dict[str, Any]:
    """Watch's attributes for a Watch with this type filter and no subject."""
    return {"types": list(event_types), "subject": ""}


def check_create(policy: str | None, caller: Caller, tenant_id: str, event_types: list[str]) -> None:
    """ACCESS_DENIED unless `caller` could Watch `event_types` (all types when empty) on the tenant.
    Refused, each entry is decided alone to name the ones refused (all, when only together)."""
    decision = authorize.decide(policy, caller, EVENTS_READ, "Tenant", tenant_id, attributes(event_types),
                                tenant_id=tenant_id)
    if decision.allowed:
        return
    refused = [t for t in event_types
               if not authorize.decide(policy, caller, EVENTS_READ, "Tenant", tenant_id, attributes([t]),
                                       tenant_id=tenant_id).allowed] or list(event_types)
    raise errors.AccessDenied(
        "IAM refused reading the events this webhook would deliver: a webhook needs what Events.Watch "
        "with the same event types needs", tenantId=tenant_id, action=EVENTS_READ,
        eventTypes=refused or ["*"])


class Decisions:
    """Delivery decisions by (webhook, creator, policy version); least recently used leave first."""

    def __init__(self, entries: int = 4096) -> None:
        self.entries = entries
        self.decided = 0  # decisions taken (each one a policy read and a Cedar evaluation)
        self._cache: OrderedDict[tuple[Any, ...], bool] = OrderedDict()

    def _get(self, key: tuple[Any, ...]) -> bool | None:
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
        return found

    def _put(self, key: tuple[Any, ...], allowed: bool) -> None:
        self._cache[key] = allowed
        while len(self._cache) > self.entries:
            self._cache.popitem(last=False)

    async def refusal(self, pool: AsyncConnectionPool, row: dict[str, Any]) -> str:
        """Why the claimed delivery `row` must not be sent ("" when it may): the claim returns the
        webhook's filter, its creator's standing and the tenant's policy version."""
        if not row["creator_active"]:
            return CREATOR_GONE
        creator = (row["created_by"], row["creator_kind"], row["creator_delegator_id"])
        allowed = self._get((row["webhook_id"], *creator, row["policy_version"]))
        if allowed is None:
            async with db.read_only(pool) as conn:
                policy = await (await conn.execute(_POLICY, {"tenant_id": row["tenant_id"]})).fetchone()
            caller = Caller(identity_id=row["created_by"], kind=row["creator_kind"],
                            tenant_ids=frozenset([row["tenant_id"]]), delegator_id=row["creator_delegator_id"])
            allowed = authorize.decide(policy["cedar"] if policy else None, caller, EVENTS_READ, "Tenant",
                                       row["tenant_id"], attributes(row["event_types"]),
                                       tenant_id=row["tenant_id"]).allowed
            self.decided += 1
            # Under the version read with the policy: a newer one than the claim saw holds at once.
            self._put((row["webhook_id"], *creator, policy["version"] if policy else None), allowed)
        return "" if allowed else REFUSED


DECISIONS = Decisions()
