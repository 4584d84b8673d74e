"""Pending reservations retry every 30 seconds, and at once when their pool frees capacity
(release, cancel, a BookingRepair or a binding failure, a node made ready), woken by NOTIFY
bc_pool_freed.

Each retry is one transaction per reservation: plan (reads only), pool lock, row lock, re-check
that it is still pending, place. Replicas may race on the same reservation: the row lock and the
state check make the loser skip it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import structlog

from controlplane import db
from controlplane.common.locks import pool_lock
from controlplane.listen import RECONNECTED, listen
from controlplane.reservations import lifecycle, placing, preemption, queries, states
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

BATCH = 100
CHANNEL = "bc_pool_freed"
COALESCE_SECONDS = 0.05  # wake-ups this close after the first are handled with it


async def retry_pool(rt: Runtime, pool_id: str) -> int:
    """Try to place the pool's pending reservations, oldest first, a page of BATCH at a time until
    every one was tried (a page alone let a tenant's hopeless pending reservations, older than
    another's, keep that one from ever being retried); the number placed. The pool lock comes
    first: a transaction holding it (a lease batch, an inline create) that is about to leave a
    reservation pending commits before the read, so the wake-up of capacity freed meanwhile is not
    spent while that reservation is still queued."""
    placed = tried = 0
    after: dict[str, Any] = {"after_at": None, "after_id": None}
    while True:
        async with db.read_only(rt.pool) as conn:
            if not tried:
                await pool_lock(conn, pool_id)
            rows = await (await conn.execute(
                queries.PENDING_IN_POOL, {"pool_id": pool_id, "limit": BATCH, **after})).fetchall()
        for row in rows:
            if await db.run_in_transaction(rt.pool, lambda c, rid=row["id"]: _retry_one(c, rt, rid)):
                placed += 1
        tried += len(rows)
        if len(rows) < BATCH:
            break
        after = {"after_at": rows[-1]["created_at"], "after_id": rows[-1]["id"]}
    if tried:
        log.info("pending retried", pool_id=pool_id, tried=tried, placed=placed)
    return placed


async def _retry_one(conn: psycopg.AsyncConnection, rt: Runtime, rid: str) -> bool:
    now_ms = await db.now_ms(conn)
    row = await (await conn.execute(queries.BY_ID, {"id": rid})).fetchone()
    if row is None or row["state"] != states.PENDING:
        return False
    if preemption.notice_over(row, now_ms):  # a victim with nothing left to place: it ends, preempted
        await lifecycle.end_pending_victim(conn, row)
        return False
    prepared = await placing.prepare(conn, rt, row, now_ms)
    row = await (await conn.execute(queries.BY_ID_FOR_UPDATE, {"id": rid})).fetchone()
    if row is None or row["state"] != states.PENDING:
        return False
    # Placed at the clock once both locks are held, not the one read before the waits (as inline
    # create and the lease batch): time (or the dev clock) moved on while the retry waited, and a
    # window without a start, or one whose start passed meanwhile, begins at placement.
    fresh = await (await conn.execute(queries.CLOCK_MS_FRESH)).fetchone()
    now_ms = max(now_ms, fresh["now_ms"])
    return await placing.place_locked(conn, rt, row, placing.at_clock(prepared, row, now_ms), now_ms) is not None


async def retry_all(rt: Runtime) -> None:
    async with db.read_only(rt.pool) as conn:
        pools = [r["pool_id"] for r in await (await conn.execute(queries.POOLS_WITH_PENDING)).fetchall()]
    for pool_id in pools:
        await retry_pool(rt, pool_id)


async def run(rt: Runtime, conninfo: str, stop: asyncio.Event) -> None:
    """Listen for freed pools; retry everything every pending_retry_seconds as the safety net, and
    after every (re)connect (a pool freed while no one listened)."""
    quiet = rt.settings.pending_retry_seconds
    async with listen(conninfo, [CHANNEL], stop, name="pending", timeout=quiet) as listener:
        woken: set[str] = set()
        coalesce_until = 0.0
        async for item in listener:
            if isinstance(item, psycopg.Notify):
                if not woken:
                    coalesce_until = time.monotonic() + COALESCE_SECONDS
                woken.add(item.payload)
                if time.monotonic() < coalesce_until:
                    listener.timeout = coalesce_until - time.monotonic()
                    continue  # coalesce a burst of wake-ups for the same pools
            try:
                if item is RECONNECTED or not woken:  # missed while disconnected, or the safety net
                    await retry_all(rt)
                else:  # the burst, once its window closed
                    for pool_id in woken:
                        await retry_pool(rt, pool_id)
            except Exception:
                log.exception("pending worker failed; continuing")
                await listener.reset()  # re-read everything once reconnected
            woken.clear()
            listener.timeout = quiet
