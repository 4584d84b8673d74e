"""The durable work queue runner.

A due item is claimed with FOR UPDATE SKIP LOCKED inside the transaction that handles it and is
deleted there: the handler's effects and the item's removal commit together. Two replicas never
handle one item at once (the row lock), and a replica killed mid-handler rolls back, leaving the
item for the next one. A failing handler is rolled back to a savepoint and the item is retried
with exponential back-off; after work_max_attempts failures it is dead (dead_at set, the
dead_work_items view, a "work item dead" log line) and never claimed again. Workers sleep until
the next item is due or a NOTIFY bc_work (new work, clock moved) wakes them; the poll is only a
safety net.

The queue knows no handler of its own: whoever runs it (controlplane/app.py) hands it one handler
per kind, and it claims only items of those kinds. Kinds are refused at insert unless the schema
lists them (work_items_kind_check).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import psycopg
import structlog

from controlplane.listen import listen
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

Handler = Callable[[psycopg.AsyncConnection, Runtime, str], Awaitable[None]]
Handlers = Mapping[str, Handler]  # kind -> the handler of its items

CHANNEL = "bc_work"
SAFETY_POLL_S = 5.0
MAX_BACKOFF_S = 300

_CLAIM = """
SELECT id, kind, subject, attempts FROM work_items
WHERE run_at <= compute_now() AND dead_at IS NULL AND kind = ANY(%(kinds)s)
ORDER BY run_at, id
LIMIT 1
FOR UPDATE SKIP LOCKED
"""
_DONE = "DELETE FROM work_items WHERE id = %(id)s"
# One statement: the next attempt after back-off, or dead once max_attempts failures are reached.
_FAILED = """
UPDATE work_items
SET attempts = attempts + 1, last_error = %(error)s,
    run_at = compute_now() + least(%(max_backoff)s, power(2, attempts)) * interval '1 second',
    dead_at = CASE WHEN attempts + 1 >= %(max_attempts)s THEN compute_now() END
WHERE id = %(id)s
RETURNING attempts, dead_at IS NOT NULL AS dead
"""
_NEXT_DUE_S = """
SELECT extract(epoch FROM min(run_at) - compute_now())::float AS s FROM work_items
WHERE dead_at IS NULL AND kind = ANY(%(kinds)s)
"""


async def run_one(rt: Runtime, handlers: Handlers) -> bool:
    """Handle one due item of a kind in `handlers`; False when none is due."""
    async with rt.pool.connection() as conn:
        async with conn.transaction():
            item = await (await conn.execute(_CLAIM, {"kinds": list(handlers)})).fetchone()
            if item is None:
                return False
            try:
                async with conn.transaction():  # savepoint: a failure undoes only the handler
                    await handlers[item["kind"]](conn, rt, item["subject"])
            except Exception as exc:
                await _failed(conn, rt, item, exc)
                return True
            await conn.execute(_DONE, {"id": item["id"]})
    return True


async def _failed(conn: psycopg.AsyncConnection, rt: Runtime, item: dict, exc: Exception) -> None:
    outcome = await (await conn.execute(_FAILED, {
        "id": item["id"], "error": repr(exc)[:2000], "max_backoff": MAX_BACKOFF_S,
        "max_attempts": rt.settings.work_max_attempts,
    })).fetchone()
    facts = {"work_item_id": item["id"], "kind": item["kind"], "subject": item["subject"],
             "attempts": outcome["attempts"], "error": repr(exc)[:500]}
    if outcome["dead"]:
        log.error("work item dead", **facts)  # operators: SELECT * FROM dead_work_items
    else:
        log.warning("work item failed", **facts)


async def _next_due(rt: Runtime, handlers: Handlers) -> float:
    async with rt.pool.connection() as conn:
        row = await (await conn.execute(_NEXT_DUE_S, {"kinds": list(handlers)})).fetchone()
        await conn.commit()
    return SAFETY_POLL_S if row["s"] is None else max(0.0, min(SAFETY_POLL_S, row["s"]))


async def run(rt: Runtime, conninfo: str, stop: asyncio.Event, handlers: Handlers, *, concurrency: int = 2) -> None:
    """Run the queue for the kinds in `handlers` until `stop` is set."""
    if not handlers:
        raise ValueError("the work queue needs at least one handler")
    wake = asyncio.Event()

    async def wake_on_notify() -> None:
        async with listen(conninfo, [CHANNEL], stop, name="work-queue") as listener:
            async for _ in listener:
                wake.set()  # a NOTIFY, or RECONNECTED: the drain re-reads every due item either way

    async def drain() -> None:
        while not stop.is_set():
            try:
                while await run_one(rt, handlers):
                    pass
                wake.clear()
                timeout = await _next_due(rt, handlers)  # before creating the wait, which a cancel here would orphan
                try:
                    await asyncio.wait_for(wake.wait(), timeout=timeout)
                except TimeoutError:
                    pass
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("work runner failed; continuing")
                await asyncio.sleep(1)

    tasks = [asyncio.create_task(wake_on_notify())] + [asyncio.create_task(drain()) for _ in range(concurrency)]
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
