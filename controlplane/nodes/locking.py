"""Locking a node for a change that affects placement: its pool's lock first, then its row
(the lock order of controlplane.common.locks)."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane.common.locks import pool_lock
from controlplane.nodes import queries


async def lock_for_placement_change(conn: AsyncConnection, node_id: str) -> dict[str, Any] | None:
    """The node row (id, pool_id, name, state, labels, revoked marks), locked under its pool's lock;
    None when there is no such node."""
    found = await (await conn.execute(queries.POOL_OF, {"node_id": node_id})).fetchone()
    if found is None:
        return None
    await pool_lock(conn, found["pool_id"])
    return await (await conn.execute(queries.LOCK, {"node_id": node_id})).fetchone()
