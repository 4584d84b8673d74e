"""Delegated confirmation: the person an agent acts for approves or rejects a held request."""

from __future__ import annotations

import re
from typing import Any

from psycopg import AsyncConnection

from controlplane import db, errors
from controlplane.auth import Caller
from controlplane.common.names import TENANT_ID, match
from controlplane.runtime import Runtime

CONFIRMATION_ID = re.compile(r"^conf_[0-9a-hjkmnp-tv-z]{26}$")

_SELECT = """
SELECT c.*, epoch_ms(c.expires_at) AS expires_ms, (c.expires_at <= compute_now()) AS past_deadline
FROM confirmations c WHERE c.id = %(id)s AND c.tenant_id = %(tenant_id)s
"""


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
        await conn.execute(
            "UPDATE confirmations SET state = %s, decided_at = compute_now() WHERE id = %s",
            ("approved" if approve else "rejected", cid),
        )
        return await _visible(conn, caller, tenant_id, cid, lock=False)

    return await db.run_in_transaction(rt.pool, work)
