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

An event of a reservation (subject `reservation/<id>`) is delivered only when the creator may
also read that reservation, decided as Reservations.Get decides it: compute:reservations:read on
the reservation's row as the claim read it (its tenant, owner, pool and state). One that is gone
or a draft (get: NOT_FOUND) is refused too. The claimed deliveries are decided together: one
Cedar batch per tenant and creator (`iam.allowed_each`, as Reservations.List decides its rows),
on a policy text kept per tenant and version. ListDeliveries leaves out the deliveries of
reservations its caller may not read the same way (`reads.readable_events`), so a listing names no
reservation its caller could not get.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from psycopg_pool import AsyncConnectionPool

from controlplane import authorize, db, errors
from controlplane.auth import Caller
from controlplane.reservations import reads
from controlplane.watch import EVENTS_READ

REFUSED = "refused by IAM: the webhook's creator may no longer read these events (compute:events:read)"
CREATOR_GONE = "refused: the webhook's creator is offboarded or no longer a member of the tenant"
RESERVATION_REFUSED = ("refused by IAM: the webhook's creator may not read this reservation "
                       "(compute:reservations:read)")

_POLICIES = "SELECT tenant_id, cedar, version FROM policies WHERE tenant_id = ANY(%(tenant_ids)s)"


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

    def __init__(self, entries: int = 4096, policy_entries: int = 256) -> None:
        self.entries = entries
        self.policy_entries = policy_entries
        self.decided = 0  # events:read decisions taken (each one a Cedar evaluation)
        self.batches = 0  # reservation batches decided (each one a Cedar batch)
        self._cache: OrderedDict[tuple[Any, ...], bool] = OrderedDict()
        self._policies: OrderedDict[str, tuple[str | None, Any]] = OrderedDict()  # tenant: (text, version)

    def _get(self, key: tuple[Any, ...]) -> bool | None:
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
        return found

    def _put(self, key: tuple[Any, ...], allowed: bool) -> None:
        self._cache[key] = allowed
        while len(self._cache) > self.entries:
            self._cache.popitem(last=False)

    async def refusals(self, pool: AsyncConnectionPool, rows: list[dict[str, Any]]) -> list[str]:
        """Why each claimed delivery must not be sent ("" when it may): the claim returns the
        webhook's filter, its creator's standing, the tenant's policy version and, for an event
        of a reservation, the reservation's row. At most one policy read for the lot (none while
        the policies stay), one events:read decision per webhook, creator and policy version, and
        one Cedar batch per tenant and creator for the reservations."""
        out = ["" if row["creator_active"] else CREATOR_GONE for row in rows]
        wanted = {row["tenant_id"]: row["policy_version"] for i, row in enumerate(rows)
                  if not out[i] and (about_reservation(row) or self._get(_key(row, row["policy_version"])) is None)}
        policies = await self._read_policies(pool, wanted)
        for i, row in enumerate(rows):
            if out[i]:
                continue
            allowed = self._get(_key(row, row["policy_version"]))
            if allowed is None:
                if row["tenant_id"] not in policies:  # its decision left the cache meanwhile
                    policies.update(await self._read_policies(pool, {row["tenant_id"]: row["policy_version"]}))
                cedar, version = policies[row["tenant_id"]]
                allowed = authorize.decide(cedar, _creator(row), EVENTS_READ, "Tenant", row["tenant_id"],
                                           attributes(row["event_types"]), tenant_id=row["tenant_id"]).allowed
                self.decided += 1
                # Under the version read with the policy: a newer one than the claim saw holds at once.
                self._put(_key(row, version), allowed)
            if not allowed:
                out[i] = REFUSED
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, row in enumerate(rows):
            if not out[i] and about_reservation(row):
                groups.setdefault((row["tenant_id"], row["created_by"], row["creator_kind"],
                                   row["creator_delegator_id"]), []).append(i)
        for (tenant_id, *_), members in groups.items():
            chosen = [rows[i] for i in members]
            readable = reads.readable_events(policies[tenant_id][0], _creator(chosen[0]), tenant_id, chosen)
            self.batches += 1
            for i, allowed in zip(members, readable):
                if not allowed:
                    out[i] = RESERVATION_REFUSED
        return out

    async def _read_policies(self, pool: AsyncConnectionPool,
                             wanted: dict[str, Any]) -> dict[str, tuple[str | None, Any]]:
        """Each tenant's policy text and version: kept while the claim shows the version kept,
        otherwise read (the lot in one statement). A tenant without a policy has (None, None)."""
        found: dict[str, tuple[str | None, Any]] = {}
        stale = []
        for tenant_id, version in wanted.items():
            kept = self._policies.get(tenant_id)
            if kept is not None and kept[1] == version:
                self._policies.move_to_end(tenant_id)
                found[tenant_id] = kept
            else:
                stale.append(tenant_id)
        if stale:
            async with db.read_only(pool) as conn:
                read = await (await conn.execute(_POLICIES, {"tenant_ids": stale})).fetchall()
            for tenant_id in stale:
                found[tenant_id] = (None, None)
            for row in read:
                found[row["tenant_id"]] = (row["cedar"], row["version"])
            for tenant_id in stale:
                self._policies[tenant_id] = found[tenant_id]
                self._policies.move_to_end(tenant_id)
            while len(self._policies) > self.policy_entries:
                self._policies.popitem(last=False)
        return found


def _key(row: dict[str, Any], version: Any) -> tuple[Any, ...]:
    return (row["webhook_id"], row["created_by"], row["creator_kind"], row["creator_delegator_id"], version)


def _creator(row: dict[str, Any]) -> Caller:
    """The webhook's creator as the caller its deliveries are decided for."""
    return Caller(identity_id=row["created_by"], kind=row["creator_kind"], tenant_ids=frozenset([row["tenant_id"]]),
                  delegator_id=row["creator_delegator_id"], delegator_kind=row["creator_delegator_kind"] or "user")


def about_reservation(row: dict[str, Any]) -> bool:
    """Whether the delivery's event is a reservation's (subject `reservation/<id>`)."""
    return reads.subject_of(row) is not None


DECISIONS = Decisions()
