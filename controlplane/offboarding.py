"""Offboarding: an identity leaves and names a successor, in one transaction.

- The agents acting for the identity are disabled with it (reason `delegator-offboarded`): an
  agent must not act for a person who is gone, and the schema keeps an agent tied to its person.
- Their open confirmations (asked of the person, or asked by an agent) are withdrawn, and the
  requests they held expire with reason `confirmation-withdrawn`, as at a confirmation's deadline.
- Their drafts are deleted, as the draft sweeper does: a draft's key is its creator's, and a
  create deciding one right now finds it gone (CONFLICT) instead of placing it for a gone owner.
- Their live reservations (pending, queued, placed, binding, active) pass to the successor, with
  a `reservation.reassigned` event each. Terminal ones stay with their owner, as history.
- Their tokens are revoked and they are marked offboarded: no authentication, no new token.

Repeating the call with the same successor changes nothing; with another it is INVALID_STATE.
Lock order: identity rows (by id), confirmation rows, reservation rows (by id); no pool lock, as
no booking changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane import bootstrap, confirmations, db, errors, events, tokens
from controlplane.reservations import queries as reservation_queries
from controlplane.reservations import states
from controlplane.reservations.transitions import move
from controlplane.common.names import match
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

OFFBOARDED = "offboarded"
DELEGATOR_OFFBOARDED = "delegator-offboarded"
WITHDRAWN_REASON = "confirmation-withdrawn"
REASSIGNABLE = sorted({states.PENDING, states.QUEUED} | states.BOOKED)

# The identities locked first, then read in a statement of their own: under READ COMMITTED a
# statement that waited for a row lock answers from the snapshot it began with, so memberships a
# call holding the row removed meanwhile would still be read (and a successor no longer in the
# tenant handed its reservations).
_LOCK_IDENTITIES = "SELECT id FROM identities WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE"
# tenant_ids: where the identity can act. An agent acts only where its person is a member too
# (controlplane.auth), so a successor agent's tenants are the two memberships' intersection.
_IDENTITIES = """
SELECT i.id, i.kind, i.delegator_id, i.successor_id, epoch_ms(i.offboarded_at) AS offboarded_ms,
       coalesce(array(SELECT m.tenant_id FROM memberships m WHERE m.identity_id = i.id
                        AND (i.delegator_id IS NULL
                             OR EXISTS (SELECT 1 FROM memberships d
                                        WHERE d.identity_id = i.delegator_id AND d.tenant_id = m.tenant_id))),
                '{}') AS tenant_ids
FROM identities i WHERE i.id = ANY(%(ids)s) ORDER BY i.id
"""

LOCK_AGENTS = """
SELECT id FROM identities WHERE delegator_id = %(id)s AND offboarded_at IS NULL ORDER BY id FOR UPDATE
"""

_MARK_OFFBOARDED = """
UPDATE identities SET offboarded_at = now(), successor_id = %(successor)s, offboard_reason = %(reason)s
WHERE id = ANY(%(ids)s)
"""

_OFFBOARDED_AT = "SELECT epoch_ms(offboarded_at) AS ms FROM identities WHERE id = %s"


async def lock_identities(conn: AsyncConnection, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The identities of `ids` that exist, by id, locked (in id order) and read after the locks."""
    await conn.execute(_LOCK_IDENTITIES, {"ids": list(ids)})
    return {r["id"]: r for r in await (await conn.execute(_IDENTITIES, {"ids": list(ids)})).fetchall()}


async def offboard(rt: Runtime, identity_id: str, successor_id: str) -> dict[str, Any]:
    match("identityId", identity_id, tokens.IDENTITY_ID)
    match("successorIdentityId", successor_id, tokens.IDENTITY_ID)
    if successor_id == identity_id:
        raise errors.InvalidInput("successorIdentityId", "must be another identity than the one offboarded")
    if identity_id == bootstrap.ROOT_IDENTITY:  # bootstrap's break-glass token is this identity's
        raise errors.InvalidInput("identityId", "the platform's root identity cannot be offboarded")
    result = await db.run_in_transaction(rt.pool, lambda conn: _offboard(conn, identity_id, successor_id))
    if result["changed"]:
        log.info("identity offboarded", identity_id=identity_id, successor_id=successor_id,
                 reassigned=len(result["reassigned_reservation_ids"]),
                 disabled_agents=len(result["disabled_agent_ids"]))
    return result


async def _offboard(conn: AsyncConnection, identity_id: str, successor_id: str) -> dict[str, Any]:
    found = await lock_identities(conn, [identity_id, successor_id])
    leaving, successor = found.get(identity_id), found.get(successor_id)
    if leaving is None:
        raise errors.NotFound("no such identity", identityId=identity_id)
    if successor is None:
        raise errors.NotFound("no such successor identity", successorIdentityId=successor_id)
    if leaving["offboarded_ms"] is not None:
        if leaving["successor_id"] != successor_id:
            raise errors.InvalidState("this identity was offboarded to another successor", identityId=identity_id,
                                      state=OFFBOARDED, successorIdentityId=leaving["successor_id"])
        return _answer(identity_id, successor_id, leaving["offboarded_ms"], changed=False)
    if successor["offboarded_ms"] is not None:
        raise errors.InvalidState("the successor is offboarded", successorIdentityId=successor_id, state=OFFBOARDED)
    agents = [r["id"] for r in await (await conn.execute(LOCK_AGENTS, {"id": identity_id})).fetchall()]
    if successor_id in agents:
        raise errors.InvalidInput("successorIdentityId", "is an agent acting for the identity offboarded, "
                                  "and is disabled with it")
    ids = [identity_id, *agents]

    # Drafts are locked too: a create placing one right now is waited for, and its row is read as
    # it committed (placed: it moves below; still a draft: it is deleted below). The rows before
    # their confirmations, as a release locks them: the other way round the two deadlocked.
    owned = await (await conn.execute(reservation_queries.OWNED_BY_FOR_UPDATE, {
        "ids": ids, "states": [states.DRAFT, states.AWAITING_CONFIRMATION, *REASSIGNABLE]})).fetchall()
    withdrawn = await confirmations.withdraw_of_identities(conn, ids)
    moving = [r for r in owned if r["state"] in REASSIGNABLE]
    missing = sorted({r["tenant_id"] for r in moving} - set(successor["tenant_ids"]))
    if missing:
        raise errors.InvalidInput("successorIdentityId", "is not a member of every tenant where the identity "
                                  "owns live reservations", tenantIds=missing)

    expired = await hand_over(conn, owned, moving, successor_id, lambda owner: (
        OFFBOARDED if owner == identity_id else DELEGATOR_OFFBOARDED))
    await conn.execute(reservation_queries.DELETE_DRAFTS_OF, {"ids": ids})

    await conn.execute(_MARK_OFFBOARDED, {"ids": [identity_id], "successor": successor_id, "reason": OFFBOARDED})
    if agents:
        await conn.execute(_MARK_OFFBOARDED, {"ids": agents, "successor": successor_id,
                                              "reason": DELEGATOR_OFFBOARDED})
    revoked = await tokens.revoke_identities(conn, ids)
    at = (await (await conn.execute(_OFFBOARDED_AT, (identity_id,))).fetchone())["ms"]
    return _answer(identity_id, successor_id, at, changed=True, reassigned=[r["id"] for r in moving],
                   expired=expired, withdrawn=withdrawn, revoked=[r["id"] for r in revoked], agents=agents)



async def hand_over(conn: AsyncConnection, owned: Sequence[dict[str, Any]], moving: Sequence[dict[str, Any]],
                    successor_id: str, reason: Callable[[str], str]) -> list[str]:
    """What leaving does to the rows an identity and its agents owned (locked by the caller): the
    requests awaiting confirmation expire (their confirmations were withdrawn), and the live
    reservations `moving` pass to the successor with a `reservation.reassigned` event whose reason
    is `reason(owner)`. Returns the ids expired. Offboarding and the removal of one membership."""
    expired = []
    for row in owned:
        if row["state"] == states.AWAITING_CONFIRMATION:
            await move(conn, row, states.EXPIRED, operation_state="failed", end_reason=WITHDRAWN_REASON)
            await events.emit_reservation(conn, row, "reservation.expired", reason=WITHDRAWN_REASON)
            expired.append(row["id"])
    for row in moving:
        await conn.execute(reservation_queries.REASSIGN_OWNER, {"id": row["id"], "to": successor_id})
        await events.emit_reservation(conn, row, "reservation.reassigned", reservationId=row["id"], **{
            "from": row["owner_identity_id"], "to": successor_id, "reason": reason(row["owner_identity_id"])})
    return expired

def _answer(identity_id: str, successor_id: str, at_ms: int, *, changed: bool, reassigned: Sequence[str] = (),
            expired: Sequence[str] = (), withdrawn: Sequence[str] = (), revoked: Sequence[str] = (),
            agents: Sequence[str] = ()) -> dict[str, Any]:
    return {"identity_id": identity_id, "successor_identity_id": successor_id, "offboarded_at": at_ms,
            "changed": changed, "reassigned_reservation_ids": list(reassigned),
            "expired_reservation_ids": list(expired), "withdrawn_confirmation_ids": list(withdrawn),
            "revoked_token_ids": list(revoked), "disabled_agent_ids": list(agents)}
