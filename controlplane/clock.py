"""The one clock, compute_now(): the database's now() plus an offset only dev/test mode moves."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import db, errors, tokens
from controlplane.runtime import Runtime

_READ = "SELECT epoch_ms(compute_now()) AS now, offset_ms FROM clock"


async def read(rt: Runtime) -> dict[str, Any]:
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(_READ)).fetchone()


async def advance(rt: Runtime, by_ms: int) -> dict[str, Any]:
    """Move compute_now() forward and wake the workers. Refused unless clock control is on."""
    if not rt.settings.clock_control:
        raise errors.InvalidState("clock control is disabled (dev and test only: BC_CLOCK_CONTROL=1)")
    if not 0 < by_ms <= 366 * 86_400_000:
        raise errors.InvalidInput("byMs", "must be 1 ms to 366 days")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute("UPDATE clock SET offset_ms = offset_ms + %s", (by_ms,))
        await conn.execute("SELECT pg_notify('bc_work', 'clock')")
        await tokens.notify_expired_by_clock(conn, by_ms)
        return await (await conn.execute(_READ)).fetchone()

    return await db.run_in_transaction(rt.pool, work)
