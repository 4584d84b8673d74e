"""Whether a node is heard from: a hello or heartbeat makes it connected (node_seen), the
unreachable sweep marks the silent ones unreachable (sweep_unreachable; both SQL functions in
controlplane/migrations/0003_pki.sql), and an operator may set it. Each change wakes the
reservations with live allocations on the node.

Liveness takes no pool lock (controlplane.common.locks); the operator's override does."""

from __future__ import annotations

from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db, errors
from controlplane.nodes import queries, registry
from controlplane.nodes.locking import lock_for_placement_change

log = structlog.get_logger("nodes.connectivity")


async def seen(pool: AsyncConnectionPool, node_id: str, applied_generation: int | None = None) -> bool:
    """The node was heard from (and, from a heartbeat, converged to `applied_generation`).
    True when that made it connected again."""

    async def work(conn: AsyncConnection) -> bool:
        changed = (await (await conn.execute(queries.SEEN, {"node_id": node_id})).fetchone())["changed"]
        if applied_generation is not None:
            await conn.execute(queries.SET_APPLIED_GENERATION, {"generation": applied_generation, "node_id": node_id})
        return changed

    changed = await db.run_in_transaction(pool, work)
    if changed:
        log.info("node connected", node_id=node_id)
    return changed


async def sweep(pool: AsyncConnectionPool, grace_seconds: float) -> list[str]:
    """Mark nodes not heard from within the grace unreachable; the ids of those this call changed.
    Safe with several gateways: the SQL function makes each change once."""

    async def work(conn: AsyncConnection) -> list[str]:
        rows = await (await conn.execute(queries.SWEEP_UNREACHABLE, {"grace_seconds": grace_seconds})).fetchall()
        return [r["node_id"] for r in rows]

    changed = await db.run_in_transaction(pool, work)
    for node_id in changed:
        log.info("node unreachable", node_id=node_id, grace_seconds=grace_seconds)
    return changed


async def set_by_operator(pool: AsyncConnectionPool, node_id: str, connectivity: str) -> dict[str, Any]:
    """`connected` (seen now, by the database's clock) or `unreachable`, under the pool lock."""

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        if await lock_for_placement_change(conn, node_id) is None:
            raise errors.NotFound("no such node", nodeId=node_id)
        await conn.execute(queries.SET_CONNECTIVITY, {"connectivity": connectivity, "node_id": node_id})
        await conn.execute(queries.WAKE_RESERVATIONS, {"node_id": node_id})
        return await registry.node(conn, node_id)

    return await db.run_in_transaction(pool, work)
