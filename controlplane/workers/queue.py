"""The durable work queue runner.

A due item is claimed with FOR UPDATE SKIP LOCKED inside the transaction that handles it and is
deleted there: the handler's effects and the item's removal commit together. Two replicas never
handle one item at once (the row lock), and a replica killed mid-handler rolls back, leaving the
item for the next one. A failing handler is rolled back to a savepoint and the item is retried
with exponential back-off. Workers sleep until the next item is due or a NOTIFY bc_work (new
work, clock moved) wakes them; the poll is only a safety net.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import psycopg
import structlog

from controlplane.reservations import reconciler
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

Handler = Callable[[psycopg.AsyncConnection, Runtime, str], Awaitable[None]]
HANDLERS: dict[str, Handler] = {"reservation": reconciler.reconcile}

SAFETY_POLL_S = 5.0
MAX_BACKOFF_S = 300

_CLAIM = """
SELECT id, kind, subject, attempts FROM work_items
WHERE run_at <= compute_now()
ORDER BY run_at, id
LIMIT 1
FOR UPDATE SKIP LOCKED
"""
_DONE = "DELETE FROM work_items WHERE id = %s"
_RETRY = """
UPDATE work_items
SET attempts = attempts + 1, last_error = %s,
    run_at = compute_now() + least(%s, power(2, attempts)) * interval '1 second'
WHERE id = %s
"""
_NEXT_DUE_S = "SELECT extract(epoch FROM min(run_at) - compute_now())::float AS s FROM work_items"


async def run_one(rt: Runtime) -> bool:
    """Handle one due item; False when none is due."""
    async with rt.pool.connection() as conn:
        async with conn.transaction():
            item = await (await conn.execute(_CLAIM)).fetchone()
            if item is None:
                return False
            handler = HANDLERS.get(item["kind"])
            try:
                async with conn.transaction():  # savepoint: a failure undoes only the handler
                    if handler is not None:
                        await handler(conn, rt, item["subject"])
            except Exception as exc:
                log.warning("work item failed", kind=item["kind"], subject=item["subject"],
                            attempts=item["attempts"] + 1, error=repr(exc)[:500])
                await conn.execute(_RETRY, (repr(exc)[:2000], MAX_BACKOFF_S, item["id"]))
                return True
            await conn.execute(_DONE, (item["id"],))
    return True


async def _next_due(rt: Runtime) -> float:
    async with rt.pool.connection() as conn:
        row = await (await conn.execute(_NEXT_DUE_S)).fetchone()
        await conn.commit()
    return SAFETY_POLL_S if row["s"] is None else max(0.0, min(SAFETY_POLL_S, row["s"]))


async def run(rt: Runtime, conninfo: str, stop: asyncio.Event, *, concurrency: int = 2) -> None:
    wake = asyncio.Event()

    async def listen() -> None:
        while not stop.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                    await conn.execute("LISTEN bc_work")
                    wake.set()
                    async for _ in conn.notifies():
                        wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("work listener failed; reconnecting")
                await asyncio.sleep(1)

    async def drain() -> None:
        while not stop.is_set():
            try:
                while await run_one(rt):
                    pass
                wake.clear()
                timeout = await _next_due(rt)  # before creating the wait, which a cancel here would orphan
                try:
                    await asyncio.wait_for(wake.wait(), timeout=timeout)
                except TimeoutError:
                    pass
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("work runner failed; continuing")
                await asyncio.sleep(1)

    tasks = [asyncio.create_task(listen())] + [asyncio.create_task(drain()) for _ in range(concurrency)]
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
