"""Removing an identity from one tenant: what offboarding does for every tenant, done for one.

The identity stays in its other tenants with its tokens; from the commit those tokens no longer
act in this tenant (the caller lookup reads memberships per request; an open Watch stream and a
create's wait re-check membership before they answer). In the tenant:

- The agents acting for the identity are removed with it: an agent acts only where its person is
  a member too (controlplane.auth), so their membership there gave them nothing any more, and
  keeping it would hand it back silently if the person were added again.
- Their open confirmations there are withdrawn, and the requests they held expire with reason
  `confirmation-withdrawn`, as offboarding does.
- Their drafts there are deleted (a create deciding one finds it gone: CONFLICT).
- Their live reservations there (pending, queued, placed, binding, active) pass to the successor,
  with a `reservation.reassigned` event each (reason `membership-removed`, or
  `delegator-membership-removed` for an agent's). Terminal ones keep their owner, as history.

A successor is needed only when something moves; it must be able to act in the tenant. Removing
an identity that is not a member changes nothing (`changed: false`). Lock order: identity rows
(by id), membership rows, reservation rows (by id), confirmation rows, as offboarding; a draft
insert locks the identity row and then its membership (migrations 0013, 0052), so a create in
flight either got in first (and is handled here) or finds the membership gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane import admin_queries as q
from controlplane import authorize, bootstrap, confirmations, db, errors
from controlplane.common.names import IDENTITY_ID, TENANT_ID, match
from controlplane.offboarding import LOCK_AGENTS, OFFBOARDED, REASSIGNABLE, hand_over, lock_identities
from controlplane.reservations import queries as reservation_queries
from controlplane.reservations import states
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

REMOVED = "membership-removed"
DELEGATOR_REMOVED = "delegator-membership-removed"


async def remove(rt: Runtime, identity_id: str, tenant_id: str, successor_id: str = "") -> dict[str, Any]:
    match("identityId", identity_id, IDENTITY_ID)
    match("tenantId", tenant_id, TENANT_ID)
    if successor_id:
        match("successorIdentityId", successor_id, IDENTITY_ID)
        if successor_id == identity_id:
            raise errors.InvalidInput("successorIdentityId", "must be another identity than the one removed")
    if (identity_id, tenant_id) == (bootstrap.ROOT_IDENTITY, bootstrap.ROOT_TENANT):
        raise errors.InvalidInput("identityId", "the platform's root identity stays in the root tenant",
                                  tenantId=tenant_id)
    result = await db.run_in_transaction(rt.pool, lambda conn: _remove(conn, identity_id, tenant_id, successor_id))
    if result["changed"]:
        log.info("membership removed", identity_id=identity_id, tenant_id=tenant_id, successor_id=successor_id,
                 reassigned=len(result["reassigned_reservation_ids"]), removed_agents=len(result["removed_agent_ids"]))
    return result


async def _remove(conn: AsyncConnection, identity_id: str, tenant_id: str, successor_id: str) -> dict[str, Any]:
    if await (await conn.execute(q.TENANT, {"id": tenant_id})).fetchone() is None:
        raise errors.NotFound("no such tenant", tenantId=tenant_id)
    named = [identity_id, successor_id] if successor_id else [identity_id]
    found = await lock_identities(conn, named)
    if identity_id not in found:
        raise errors.NotFound("no such identity", identityId=identity_id)
    successor = found.get(successor_id) if successor_id else None
    if successor_id and successor is None:
        raise errors.NotFound("no such successor identity", successorIdentityId=successor_id)
    agents = [r["id"] for r in await (await conn.execute(LOCK_AGENTS, {"id": identity_id})).fetchall()]
    ids = [identity_id, *agents]
    members = {r["identity_id"] for r in await (await conn.execute(
        q.LOCK_MEMBERSHIPS, {"tenant_id": tenant_id, "ids": ids})).fetchall()}
    if identity_id not in members:
        return _answer(identity_id, tenant_id, successor_id, changed=False)
    if successor is not None:
        if successor["offboarded_ms"] is not None:
            raise errors.InvalidState("the successor is offboarded", successorIdentityId=successor_id,
                                      state=OFFBOARDED)
        if successor_id in agents:
            raise errors.InvalidInput("successorIdentityId", "is an agent acting for the identity removed, "
                                      "and is removed from the tenant with it")

    owned = await (await conn.execute(reservation_queries.OWNED_BY_IN_TENANT_FOR_UPDATE, {
        "ids": ids, "tenant_id": tenant_id,
        "states": [states.DRAFT, states.AWAITING_CONFIRMATION, *REASSIGNABLE]})).fetchall()
    moving = [r for r in owned if r["state"] in REASSIGNABLE]
    if moving and successor is None:
        raise errors.InvalidInput("successorIdentityId", "is required: the identity owns live reservations in "
                                  "the tenant", reservationIds=sorted(r["id"] for r in moving))
    if moving and tenant_id not in successor["tenant_ids"]:
        raise errors.InvalidInput("successorIdentityId", "cannot act in the tenant the reservations stay in",
                                  tenantIds=[tenant_id])
    withdrawn = await confirmations.withdraw_of_identities(conn, ids, tenant_id)

    expired = await hand_over(conn, owned, moving, successor_id, lambda owner: (
        REMOVED if owner == identity_id else DELEGATOR_REMOVED))
    await conn.execute(reservation_queries.DELETE_DRAFTS_OF_IN_TENANT, {"ids": ids, "tenant_id": tenant_id})
    await conn.execute(q.DELETE_MEMBERSHIPS, {"tenant_id": tenant_id, "ids": ids})
    await authorize.access_changed(conn, tenant_id)  # their open streams end before their next event
    return _answer(identity_id, tenant_id, successor_id, changed=True, reassigned=[r["id"] for r in moving],
                   expired=expired, withdrawn=withdrawn, agents=sorted(members - {identity_id}))


def _answer(identity_id: str, tenant_id: str, successor_id: str, *, changed: bool, reassigned: Sequence[str] = (),
            expired: Sequence[str] = (), withdrawn: Sequence[str] = (), agents: Sequence[str] = ()) -> dict[str, Any]:
    return {"identity_id": identity_id, "tenant_id": tenant_id, "successor_identity_id": successor_id,
            "changed": changed, "reassigned_reservation_ids": list(reassigned),
            "expired_reservation_ids": list(expired), "withdrawn_confirmation_ids": list(withdrawn),
            "removed_agent_ids": list(agents)}
