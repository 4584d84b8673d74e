"""The unreachable sweeper: nodes not heard from within the grace become unreachable, and the
reservations with live allocations on them wake. Every gateway runs one; the SQL function makes
each change once (controlplane/migrations/0003_pki.sql: sweep_unreachable). A node becomes
connected again on its next hello or heartbeat (node_seen)."""

from __future__ import annotations

import asyncio

import structlog
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db

log = structlog.get_logger("gateway.sweeper")


async def sweep(pool: AsyncConnectionPool, grace_seconds: float) -> list[str]:
    """Mark stale nodes unreachable; the ids of those this call changed."""

    async def work(conn: AsyncConnection) -> list[str]:
        rows = await (await conn.execute("SELECT sweep_unreachable(%s) AS node_id", (grace_seconds,))).fetchall()
        return [r["node_id"] for r in rows]

    changed = await db.run_in_transaction(pool, work)
    for node_id in changed:
        log.info("node unreachable", node_id=node_id, grace_seconds=grace_seconds)
    return changed


async def run(pool: AsyncConnectionPool, grace_seconds: float, every_seconds: float, stopping: asyncio.Event) -> None:
    while not stopping.is_set():
        try:
            await sweep(pool, grace_seconds)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unreachable sweep failed")
        try:
            await asyncio.wait_for(stopping.wait(), timeout=every_seconds)
        except TimeoutError:
            pass
