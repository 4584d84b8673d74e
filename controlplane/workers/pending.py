"""Pending reservations retry every 30 seconds, and at once when their pool frees capacity
(release, cancel, a BookingRepair or a binding failure, a node made ready, new inventory), woken by
NOTIFY bc_pool_freed; a pool's wake-ups are paced (at most one retry per BC_PENDING_WAKE_SECONDS,
the wake-ups in between coalesced into the next).

Each retry is one transaction per reservation: plan (reads only), pool lock, row lock, re-check
that it is still pending, place. Replicas may race on the same reservation: the row lock and the
state check make the loser skip it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
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
    now_ms = max(now_ms, await db.fresh_now_ms(conn))
    # A victim's cut may have come while the retry waited: planned again at this clock its window
    # would be the request's whole length (ask_for caps it at the cut only when it begins before).
    if preemption.notice_over(row, now_ms):
        await lifecycle.end_pending_victim(conn, row)
        return False
    return await placing.place_locked(conn, rt, row, placing.at_clock(prepared, row, now_ms), now_ms) is not None


async def retry_all(rt: Runtime) -> None:
    async with db.read_only(rt.pool) as conn:
        pools = [r["pool_id"] for r in await (await conn.execute(queries.POOLS_WITH_PENDING)).fetchall()]
    for pool_id in pools:
        await retry_pool(rt, pool_id)


class Pacer:
    """When each woken pool is retried: COALESCE_SECONDS after its wake-up, but never sooner than
    `interval` after its previous retry began. A wake-up while one is due joins it; one that comes
    during or after a retry is due again, so the last wake-up is never lost (the retry it gets
    reads after it). A node flipping its inventory or capabilities in a loop woke its pool's retry
    once per applied message; now the pool is retried at most once per interval, whoever wakes it."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = max(0.0, interval)
        self._clock = clock
        self._due: dict[str, float] = {}  # woken pool -> when to retry it
        self._began: dict[str, float] = {}  # pool -> when its last retry began (within interval)

    def wake(self, pool_id: str) -> None:
        if pool_id not in self._due:
            since = self._began.get(pool_id)
            at = self._clock() + COALESCE_SECONDS
            self._due[pool_id] = at if since is None else max(at, since + self.interval)

    def take_due(self) -> list[str]:
        """The pools to retry now (marked as begun now)."""
        now = self._clock()
        self._began = {p: t for p, t in self._began.items() if now - t < self.interval}
        ready = [p for p, at in self._due.items() if at <= now]
        for pool_id in ready:
            del self._due[pool_id]
            self._began[pool_id] = now
        return ready

    def next_due(self) -> float | None:
        return min(self._due.values(), default=None)


async def run(rt: Runtime, conninfo: str, stop: asyncio.Event) -> None:
    """Listen for freed pools, each retried as `Pacer` says; retry everything every
    pending_retry_seconds as the safety net, whatever wakes meanwhile (a stream of wake-ups never
    holds it off), and after every (re)connect (a pool freed while no one listened)."""
    quiet = rt.settings.pending_retry_seconds
    pacer = Pacer(rt.settings.pending_wake_seconds)
    async with listen(conninfo, [CHANNEL], stop, name="pending", timeout=quiet) as listener:
        next_all = 0.0
        async for item in listener:
            if isinstance(item, psycopg.Notify):
                pacer.wake(item.payload)
            try:
                if item is RECONNECTED or time.monotonic() >= next_all:  # missed while disconnected, or the safety net
                    next_all = time.monotonic() + quiet
                    await retry_all(rt)
                for pool_id in pacer.take_due():
                    await retry_pool(rt, pool_id)
            except Exception:
                log.exception("pending worker failed; continuing")
                await listener.reset()  # re-read everything once reconnected
            due = pacer.next_due()
            wake_at = next_all if due is None else min(next_all, due)
            listener.timeout = max(0.001, wake_at - time.monotonic())
