"""Delegated confirmation: the person an agent acts for approves or rejects a held request.

This module owns the confirmations table: it alone writes it; admission and the reservation
lifecycle call the functions below."""

from __future__ import annotations

import re
from typing import Any

from psycopg import AsyncConnection

from controlplane import db, errors, iam
from controlplane.auth import Caller
from controlplane.common.names import TENANT_ID, match
from controlplane.runtime import Runtime

CONFIRMATION_ID = re.compile(r"^conf_[0-9a-hjkmnp-tv-z]{26}$")

_SELECT = """
SELECT c.*, epoch_ms(c.expires_at) AS expires_ms, epoch_ms(c.until_at) AS until_ms,
       (c.expires_at <= compute_now()) AS past_deadline
FROM confirmations c WHERE c.id = %(id)s AND c.tenant_id = %(tenant_id)s
"""
_DECIDE = "UPDATE confirmations SET state = %(state)s, decided_at = compute_now() WHERE id = %(id)s"
_OPEN = """
INSERT INTO confirmations (id, tenant_id, reservation_id, request_hash, action,
                           agent_identity_id, person_identity_id, expires_at, until_at)
VALUES (%(id)s, %(tenant_id)s, %(reservation_id)s, %(request_hash)s, %(action)s,
        %(agent)s, %(person)s, from_epoch_ms(%(expires_ms)s), from_epoch_ms(%(until_ms)s))
"""
# A change to an existing reservation (an extend) is confirmed per request: the agent's own, of
# this hash (its change and key), newest first; and the reservation's open one of the action,
# whoever asked it, which holds the one slot (confirmations_open). Locked: the caller decides.
_OF_REQUEST = """
SELECT id, state, epoch_ms(expires_at) AS expires_ms, (expires_at <= compute_now()) AS past_deadline
FROM confirmations
WHERE reservation_id = %(reservation_id)s AND action = %(action)s AND agent_identity_id = %(agent)s
  AND request_hash = %(request_hash)s
ORDER BY created_at DESC, id DESC LIMIT 1
"""
_OPEN_OF_ACTION = """
SELECT id, state, request_hash, agent_identity_id, epoch_ms(expires_at) AS expires_ms,
       (expires_at <= compute_now()) AS past_deadline
FROM confirmations
WHERE reservation_id = %(reservation_id)s AND action = %(action)s AND state IN ('pending', 'approved')
FOR UPDATE
"""
_USE = "UPDATE confirmations SET state = 'used' WHERE id = %(id)s AND state = 'approved'"
_LATEST = """
SELECT id, state, epoch_ms(expires_at) AS expires_ms,
       (state IN ('pending', 'approved') AND expires_at <= compute_now()) AS expired
FROM confirmations WHERE reservation_id = %(reservation_id)s AND action = %(action)s
ORDER BY created_at DESC LIMIT 1
"""
# An approval is for a retry before the deadline: one kept past it expires with its request, so
# the request is never placed at a time the person did not see.
_DUE = """
SELECT id FROM confirmations
WHERE reservation_id = %(reservation_id)s AND state IN ('pending', 'approved') AND expires_at <= compute_now()
FOR UPDATE
"""
_EXPIRE = "UPDATE confirmations SET state = 'expired' WHERE id = %(id)s"
# An open confirmation dies with its request, so nobody approves a withdrawn reservation.
_WITHDRAW = """
UPDATE confirmations SET state = 'expired'
WHERE reservation_id = %(reservation_id)s AND state IN ('pending', 'approved')
"""

# The open confirmations of identities leaving (a tenant, or every tenant): pending ones, and
# approved ones not yet used (a create's while its reservation awaits it; an extend's until its
# retry uses it): an approval must not outlive its person, nor hold the reservation's one slot.
_WITHDRAW_OF_IDENTITIES = """
UPDATE confirmations c SET state = 'withdrawn', decided_at = compute_now()
WHERE c.id IN (
    SELECT c2.id FROM confirmations c2 JOIN reservations r ON r.id = c2.reservation_id
    WHERE (c2.agent_identity_id = ANY(%(ids)s) OR c2.person_identity_id = ANY(%(ids)s))
      AND (%(tenant_id)s::text IS NULL OR c2.tenant_id = %(tenant_id)s)
      AND (c2.state = 'pending'
           OR (c2.state = 'approved' AND (r.state = 'awaiting-confirmation'
                                          OR c2.action = %(extend)s)))
    ORDER BY c2.id FOR UPDATE OF c2
)
RETURNING c.id
"""


async def open_confirmation(
    conn: AsyncConnection, *, confirmation_id: str, row: dict[str, Any], action: str, agent: str, person: str | None,
    expires_ms: int, request_hash: str | None = None, until_ms: int | None = None,
) -> None:
    """A pending confirmation of `action` on the reservation `row`, decided by `person`: of the
    row's own request (a create), or of `request_hash` asking for the end `until_ms` (an extend)."""
    await conn.execute(_OPEN, {"id": confirmation_id, "tenant_id": row["tenant_id"], "reservation_id": row["id"],
                               "request_hash": request_hash or row["request_hash"], "action": action,
                               "agent": agent, "person": person, "expires_ms": expires_ms, "until_ms": until_ms})


async def of_request(conn: AsyncConnection, reservation_id: str, action: str, agent: str,
                     digest: str) -> dict[str, Any] | None:
    """The agent's newest confirmation of this very change (`digest`) to the reservation."""
    return await (await conn.execute(_OF_REQUEST, {"reservation_id": reservation_id, "action": action,
                                                   "agent": agent, "request_hash": digest})).fetchone()


async def lock_open(conn: AsyncConnection, reservation_id: str, action: str) -> dict[str, Any] | None:
    """The reservation's open (pending or approved) confirmation of `action`, locked; None if none."""
    return await (await conn.execute(_OPEN_OF_ACTION, {"reservation_id": reservation_id,
                                                       "action": action})).fetchone()


async def use(conn: AsyncConnection, confirmation_id: str) -> None:
    """The retry it approved was applied: closed, so it authorises nothing more."""
    await conn.execute(_USE, {"id": confirmation_id})


async def latest(conn: AsyncConnection, reservation_id: str, action: str) -> dict[str, Any] | None:
    """The newest confirmation of `action` on the reservation (with `expired` when open past its deadline)."""
    return await (await conn.execute(_LATEST, {"reservation_id": reservation_id, "action": action})).fetchone()


async def lock_due(conn: AsyncConnection, reservation_id: str) -> str | None:
    """The open (pending or approved) confirmation of the reservation whose deadline passed, locked;
    None if none."""
    row = await (await conn.execute(_DUE, {"reservation_id": reservation_id})).fetchone()
    return row["id"] if row else None


async def expire(conn: AsyncConnection, confirmation_id: str) -> None:
    await conn.execute(_EXPIRE, {"id": confirmation_id})


async def withdraw(conn: AsyncConnection, reservation_id: str) -> None:
    """Expire the reservation's open (pending or approved) confirmations."""
    await conn.execute(_WITHDRAW, {"reservation_id": reservation_id})


async def _visible(conn: AsyncConnection, caller: Caller, tenant_id: str, cid: str, *, lock: bool) -> dict[str, Any]:
    match("tenantId", tenant_id, TENANT_ID)
    match("confirmationId", cid, CONFIRMATION_ID)
    caller.require_member(tenant_id)
    row = await (await conn.execute(_SELECT + (" FOR UPDATE" if lock else ""),
                                    {"id": cid, "tenant_id": tenant_id})).fetchone()
    if row is None or caller.identity_id not in (row["person_identity_id"], row["agent_identity_id"]):
        raise errors.NotFound("no such confirmation", confirmationId=cid)
    return row


async def get(rt: Runtime, caller: Caller, tenant_id: str, cid: str) -> dict[str, Any]:
    async with db.read_only(rt.pool) as conn:
        return await _visible(conn, caller, tenant_id, cid, lock=False)


async def decide(rt: Runtime, caller: Caller, tenant_id: str, cid: str, approve: bool) -> dict[str, Any]:
    """Only the person may decide, once, before the deadline."""

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        row = await _visible(conn, caller, tenant_id, cid, lock=True)
        if caller.identity_id != row["person_identity_id"]:
            raise errors.AccessDenied("only the person the agent acts for can decide", confirmationId=cid)
        if row["state"] != "pending":
            raise errors.InvalidState(f"this confirmation is {row['state']}", confirmationId=cid,
                                      state=row["state"])
        if row["past_deadline"]:
            raise errors.InvalidState("this confirmation has expired", confirmationId=cid, state="expired")
        await conn.execute(_DECIDE, {"state": "approved" if approve else "rejected", "id": cid})
        return await _visible(conn, caller, tenant_id, cid, lock=False)

    return await db.run_in_transaction(rt.pool, work)


async def withdraw_of_identities(conn: AsyncConnection, identity_ids: list[str],
                                 tenant_id: str | None = None) -> list[str]:
    """Withdraw the open confirmations asked of, or asked by, these identities (offboarding; in
    `tenant_id` only when given, for a membership removed): the pending ones, and the approved
    ones whose request was not retried yet. Their ids."""
    rows = await (await conn.execute(_WITHDRAW_OF_IDENTITIES, {"ids": identity_ids, "tenant_id": tenant_id,
                                                               "extend": iam.EXTEND})).fetchall()
    return [r["id"] for r in rows]
