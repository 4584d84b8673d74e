"""The durable work queue runner.

A due item is claimed with FOR UPDATE SKIP LOCKED inside the transaction that handles it and is
deleted there: the handler's effects and the item's removal commit together. Two replicas never
handle one item at once (the row lock), and a replica killed mid-handler rolls back, leaving the
item for the next one. A failing handler is rolled back to a savepoint and the item is retried
with exponential back-off (a handler that lost a deadlock or serialization race is first run again
at once, AT_ONCE_ATTEMPTS times in all); after work_max_attempts failures it is dead (dead_at set, the
dead_work_items view, a "work item dead" log line) and never claimed again.

The runner queries only when something is due. Every new item comes with a NOTIFY bc_work whose
payload is '<kind> <seconds until run_at>' (schedule_work, migration 0027; the seconds as the
database's clock, compute_now(), counts them). The runner keeps one timer for the earliest item of
its kinds it knows of: a notification of another kind is ignored, one due now wakes a drain, one
due later only moves the timer earlier, and costs no query. It re-reads the queue (claims what is
due, then reads when the next item is due) when that timer fires, on a payload without seconds
('clock' when a test moved the clock, an empty NOTIFY bc_work from an operator), after every
(re)connect of its listener, the first included (a notification sent meanwhile is lost), and at
least every work_safety_poll_seconds. A failed item's back-off moves the timer of the runner that
ran it. A due item another replica holds is looked at again every HELD_RETRY_S until it is gone;
the item of a replica killed mid-handler (rolled back, due, no NOTIFY) is claimed at the next
re-read, at the latest the safety poll.

Of the `concurrency` drains, one wakes per wake-up. The claim also says whether another item is
due; if so the drain wakes one more idle drain before running its handler and claims again after
it: a backlog fans out to every drain, a single item costs one claim. A wake-up that finds every
drain busy is kept for the next drain to finish. bc_work_queue_queries counts the claims and the
next-due reads.

The queue knows no handler of its own: whoever runs it (controlplane/app.py) hands it one handler
per kind, and it claims only items of those kinds. Kinds are refused at insert unless the schema
lists them (work_items_kind_check).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog
from psycopg import Notify

from controlplane.listen import listen
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

Handler = Callable[[psycopg.AsyncConnection, Runtime, str], Awaitable[None]]
Handlers = Mapping[str, Handler]  # kind -> the handler of its items

CHANNEL = "bc_work"
MAX_BACKOFF_S = 300
# A handler that lost a deadlock or a serialization race is run again at once, in the same claim
# (its savepoint rolled back, so the other side has gone on), as API calls are: only a race lost
# this many times counts as a failure with back-off.
AT_ONCE_ATTEMPTS = 3
_RACES = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
_RACE_PAUSE_S = 0.01
HELD_RETRY_S = 1.0  # a due item another replica's handler holds is looked at again this often

# The first due item nobody holds, and whether another is due (held or not): then more drains help.
_CLAIM = """
WITH claimed AS (
    SELECT id, kind, subject, attempts FROM work_items
    WHERE run_at <= compute_now() AND dead_at IS NULL AND kind = ANY(%(kinds)s)
    ORDER BY run_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
SELECT c.*, EXISTS (SELECT 1 FROM work_items w
                    WHERE w.run_at <= compute_now() AND w.dead_at IS NULL AND w.kind = ANY(%(kinds)s)
                      AND w.id <> c.id) AS more
FROM claimed c
"""
_DONE = "DELETE FROM work_items WHERE id = %(id)s"
# One statement: the next attempt after back-off, or dead once max_attempts failures are reached.
_FAILED = """
UPDATE work_items
SET attempts = attempts + 1, last_error = %(error)s,
    run_at = compute_now() + least(%(max_backoff)s, power(2, attempts)) * interval '1 second',
    dead_at = CASE WHEN attempts + 1 >= %(max_attempts)s THEN compute_now() END
WHERE id = %(id)s
RETURNING attempts, dead_at IS NOT NULL AS dead, extract(epoch FROM run_at - compute_now())::float AS retry_s
"""
# Seconds until the next live item of these kinds, but those this runner's drains hold now.
_NEXT_DUE_S = """
SELECT extract(epoch FROM min(run_at) - compute_now())::float AS s FROM work_items
WHERE dead_at IS NULL AND kind = ANY(%(kinds)s) AND id <> ALL(%(held)s::bigint[])
"""


@dataclass(frozen=True)
class _Outcome:
    more: bool  # another item was due at the claim
    retry_s: float | None  # the handler failed: the item is due again in this many seconds (None: dead)


async def run_one(rt: Runtime, handlers: Handlers) -> bool:
    """Handle one due item of a kind in `handlers`; False when none is due."""
    return await _run_one(rt, handlers, lambda item: None) is not None


async def _run_one(rt: Runtime, handlers: Handlers, claimed: Callable[[dict[str, Any]], None]) -> _Outcome | None:
    """Claim a due item, tell `claimed` (before its handler runs), handle it; None when none is due."""
    async with rt.pool.connection() as conn:
        async with conn.transaction():
            item = await (await conn.execute(_CLAIM, {"kinds": list(handlers)})).fetchone()
            rt.metrics.work_queries.labels("claim").inc()
            if item is None:
                return None
            claimed(item)
            for attempt in range(1, AT_ONCE_ATTEMPTS + 1):
                try:
                    async with conn.transaction():  # savepoint: a failure undoes only the handler
                        await handlers[item["kind"]](conn, rt, item["subject"])
                    break
                except _RACES as exc:  # the other side went on once ours rolled back: again, now
                    if attempt == AT_ONCE_ATTEMPTS:
                        return _Outcome(item["more"], await _failed(conn, rt, item, exc))
                    log.info("work item retried at once", kind=item["kind"], subject=item["subject"],
                             sqlstate=exc.sqlstate, attempt=attempt)
                    await asyncio.sleep(_RACE_PAUSE_S * attempt)
                except Exception as exc:
                    return _Outcome(item["more"], await _failed(conn, rt, item, exc))
            await conn.execute(_DONE, {"id": item["id"]})
    return _Outcome(item["more"], None)


async def _failed(conn: psycopg.AsyncConnection, rt: Runtime, item: dict, exc: Exception) -> float | None:
    outcome = await (await conn.execute(_FAILED, {
        "id": item["id"], "error": repr(exc)[:2000], "max_backoff": MAX_BACKOFF_S,
        "max_attempts": rt.settings.work_max_attempts,
    })).fetchone()
    facts = {"work_item_id": item["id"], "kind": item["kind"], "subject": item["subject"],
             "attempts": outcome["attempts"], "error": repr(exc)[:500]}
    if outcome["dead"]:
        log.error("work item dead", **facts)  # operators: SELECT * FROM dead_work_items
        return None
    log.warning("work item failed", **facts)
    return outcome["retry_s"]


class _Runner:
    """The drains of one process, their wake-ups and the timer of the next due item."""

    def __init__(self, rt: Runtime, handlers: Handlers) -> None:
        self.rt, self.handlers, self.kinds = rt, handlers, list(handlers)
        self.loop = asyncio.get_running_loop()
        self.stale = True  # the next due time must be read from the database
        self.due_at = math.inf  # loop time the earliest item known of is due
        self.checked_at = self.loop.time()  # the last read of the next due time
        self.pending = False  # a wake-up came while no drain was idle: the next to finish takes it
        self.idle: deque[asyncio.Future[None]] = deque()
        self.held: set[int] = set()  # ids of the items this process's drains hold
        self.timer: asyncio.TimerHandle | None = None

    def heard(self, payload: str) -> None:
        kind, _, seconds = payload.partition(" ")
        if not seconds:
            self.recheck()  # 'clock', a bare kind, an empty NOTIFY
            return
        if kind not in self.handlers:
            return
        try:
            due_in = float(seconds)
        except ValueError:
            self.recheck()
            return
        self.due_in(due_in)

    def recheck(self) -> None:
        self.stale = True
        self.wake_one()

    def due_in(self, seconds: float) -> None:
        if seconds <= 0:
            self.wake_one()
        elif self.loop.time() + seconds < self.due_at:
            self.due_at = self.loop.time() + seconds
            self._arm()

    def wake_one(self) -> None:
        while self.idle:
            waiter = self.idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.pending = True

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        deadline = min(self.due_at, self.checked_at + self.rt.settings.work_safety_poll_seconds)
        self.timer = self.loop.call_at(deadline, self._fire)

    def _fire(self) -> None:
        self.timer, self.due_at = None, math.inf  # what comes after it is unknown: read it
        self.recheck()

    async def drain(self) -> None:
        while True:
            if self.pending:
                self.pending = False
            else:
                waiter = self.loop.create_future()
                self.idle.append(waiter)
                await waiter
            try:
                await self._sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("work runner failed; continuing")
                await asyncio.sleep(1)
                self.recheck()

    async def _sweep(self) -> None:
        """Claim while items are due, then read the next due time if the timer is not to be trusted."""
        while True:
            held: list[int] = []

            def claimed(item: dict[str, Any]) -> None:
                held.append(item["id"])
                self.held.add(item["id"])
                if item["more"]:
                    self.wake_one()

            try:
                outcome = await _run_one(self.rt, self.handlers, claimed)
            finally:
                self.held.difference_update(held)
            if outcome is not None and outcome.retry_s is not None:
                self.due_in(outcome.retry_s)
            if outcome is not None and outcome.more:
                continue
            if not self.stale:
                return
            self.stale = False
            seconds = await self._next_due()
            if seconds is not None:  # if due already, another replica holds it (or it was just committed)
                self.due_at = min(self.due_at, self.loop.time() + max(seconds, HELD_RETRY_S if seconds <= 0 else 0))
            self._arm()  # the safety poll counts from this read
            return

    async def _next_due(self) -> float | None:
        self.due_at, self.checked_at = math.inf, self.loop.time()  # notifications from now on lower it
        async with self.rt.pool.connection() as conn:
            row = await (await conn.execute(_NEXT_DUE_S, {"kinds": self.kinds, "held": list(self.held)})).fetchone()
            await conn.commit()
        self.rt.metrics.work_queries.labels("next_due").inc()
        return row["s"]

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


async def run(rt: Runtime, conninfo: str, stop: asyncio.Event, handlers: Handlers, *, concurrency: int = 2) -> None:
    """Run the queue for the kinds in `handlers` until `stop` is set."""
    if not handlers:
        raise ValueError("the work queue needs at least one handler")
    runner = _Runner(rt, handlers)

    async def wake_on_notify() -> None:
        async with listen(conninfo, [CHANNEL], stop, name="work-queue") as listener:
            async for note in listener:
                if isinstance(note, Notify):
                    runner.heard(note.payload)
                else:
                    runner.recheck()  # RECONNECTED: what was sent while no one listened is lost

    tasks = [asyncio.create_task(wake_on_notify())] + [asyncio.create_task(runner.drain()) for _ in range(concurrency)]
    try:
        await stop.wait()
    finally:
        runner.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
