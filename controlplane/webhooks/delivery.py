"""The webhook delivery worker: an asyncio task per process; replicas share the work only through
PostgreSQL (FOR UPDATE SKIP LOCKED on webhook_deliveries).

Each claimed delivery is POSTed on the event loop (`sender`) under one total deadline
(Settings.webhook_attempt_seconds), to an address checked again at every attempt (`targets`).
A process runs at most Settings.webhook_concurrency attempts at a time, and a tenant at most
Settings.webhook_tenant_concurrency across all processes (the claim counts its leases), so one
tenant's slow receivers cannot hold every slot. A 2xx answer marks it delivered. Anything else is retried with exponential back-off and jitter
until `max_attempts`, then the delivery is dead and the next event of its subject may go.
A delivery is claimed only once every smaller event id has committed or never will (migration
0050), as Watch streams: an event committing after a client got a larger id by webhook would be
behind the point where that client resumes Watch. While one waits for a writer still open, the
worker re-checks at RECHECK_SECONDS.
Before sending, the attempt is decided as a Watch by the webhook's creator would be, and an event
of a reservation as the creator's Reservations.Get of it would be (`authority`, the claimed rows
together): refused, the delivery is dead at once with the refusal as its error, and nothing is
sent.
Woken by NOTIFY bc_webhooks (the fan-out trigger) and by its own timer for retries.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog

from controlplane import db
from controlplane.listen import listen
from controlplane.runtime import Runtime
from controlplane.webhooks import authority, queries, sender, signing

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 20  # 45 to 60 minutes of retries with the defaults below
    base_seconds: float = 1.0  # the first retry waits 0.5 to 1 s; each later one doubles
    cap_seconds: float = 300.0
    poll_seconds: float = 30.0  # the safety net when no NOTIFY comes

    def backoff(self, attempts: int) -> float:
        """The wait after `attempts` failed attempts: capped doubling, jittered within its upper half."""
        delay = min(self.cap_seconds, self.base_seconds * 2 ** (attempts - 1))
        return delay / 2 + random.uniform(0, delay / 2)


# Read at every use, so a test (or an operator's embedding) can replace it.
POLICY = RetryPolicy()


LEASE_MARGIN_SECONDS = 5.0  # beyond the attempt's deadline: recording the outcome


def lease_seconds(rt: Runtime) -> float:
    """How long a claimed attempt owns its row before another worker may try again."""
    return rt.settings.webhook_attempt_seconds + LEASE_MARGIN_SECONDS


async def claim(rt: Runtime, limit: int) -> list[dict[str, Any]]:
    params = {"limit": limit, "lease_seconds": lease_seconds(rt),
              "tenant_limit": rt.settings.webhook_tenant_concurrency}

    async def work(conn: psycopg.AsyncConnection) -> list[dict[str, Any]]:
        await conn.execute(queries.CLAIM_LOCK)
        return await (await conn.execute(queries.CLAIM, params)).fetchall()

    return await db.run_in_transaction(rt.pool, work)


async def attempt(rt: Runtime, row: dict[str, Any], refusal: str) -> sender.Outcome:
    """POST one claimed delivery and record the outcome; one its creator may no longer read
    (`refusal`, decided by `authority` with the rest of its claim) is dead at once, unsent."""
    policy = POLICY
    if refusal:
        outcome = sender.Outcome(None, refusal)
    else:
        payload = signing.body(row)
        headers = signing.headers(row["secret"], row["event_id"], int(time.time()), payload)
        outcome = await sender.post(row["url"], payload, headers, deadline=rt.settings.webhook_attempt_seconds,
                                    allow=rt.settings.webhook_allow, tenant_id=row["tenant_id"])
    key = {"webhook_id": row["webhook_id"], "event_id": row["event_id"], "attempt": row["attempts"],
           "status": outcome.status}
    if refusal:
        query, params = queries.FAILED, {**key, "error": refusal, "dead": True, "delay_seconds": 0.0}
        log.info("webhook delivery refused", webhook_id=row["webhook_id"], event_id=row["event_id"],
                 created_by=row["created_by"], reason=refusal)
    elif outcome.delivered:
        query, params = queries.DELIVERED, key
    else:
        dead = row["attempts"] >= policy.max_attempts
        query, params = queries.FAILED, {**key, "error": outcome.error, "dead": dead,
                                         "delay_seconds": 0.0 if dead else policy.backoff(row["attempts"])}
        log.info("webhook attempt failed", webhook_id=row["webhook_id"], event_id=row["event_id"],
                 attempt=row["attempts"], status=outcome.status, error=outcome.error, detail=outcome.detail,
                 dead=dead)

    async def work(conn: psycopg.AsyncConnection) -> None:
        await conn.execute(query, params)
        # Its own statement: it must see a later delivery whose fan-out waited for this outcome.
        await conn.execute(queries.PROMOTE, {"webhook_id": row["webhook_id"], "subject": row["subject"]})

    await db.run_in_transaction(rt.pool, work)
    rt.metrics.webhook("delivered" if outcome.delivered else "dead" if params.get("dead") else "failed")
    return outcome


# While a delivery waits for an event writer still open (queries._FINAL), re-check at this pace,
# backing off: the writer's end wakes no worker.
RECHECK_SECONDS = (0.02, 0.5)


async def seconds_until_due(rt: Runtime) -> tuple[float | None, bool]:
    """Seconds until a claim may find something (None: nothing pending), and whether a delivery
    waits for an event writer still open (a smaller event id not yet final)."""
    async with db.read_only(rt.pool) as conn:
        row = await (await conn.execute(queries.NEXT_DUE, {
            "tenant_limit": rt.settings.webhook_tenant_concurrency})).fetchone()
    assert row is not None
    return (None if row["seconds"] is None else max(0.0, row["seconds"])), row["held"]


class Worker:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.wake = asyncio.Event()
        self.in_flight: set[asyncio.Task] = set()
        self.recheck = RECHECK_SECONDS[0]

    async def run(self, conninfo: str, stop: asyncio.Event) -> None:
        listener = asyncio.create_task(self._listen(conninfo, stop), name="webhook-listen")
        try:
            while not stop.is_set():
                try:
                    await self._fill()
                    await self._sleep()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("webhook worker failed; continuing")
                    await asyncio.sleep(1)
        finally:
            listener.cancel()
            for task in self.in_flight:
                task.cancel()  # their rows are leased: another attempt follows when the lease ends
            await asyncio.gather(listener, *self.in_flight, return_exceptions=True)

    async def _fill(self) -> None:
        """Claim as many due deliveries as there are free slots and start them."""
        self.wake.clear()  # before claiming: a NOTIFY during the claim is kept
        free = self.rt.settings.webhook_concurrency - len(self.in_flight)
        if free <= 0:
            return
        rows = await claim(self.rt, free)
        # Decided together (`authority`): one Cedar batch per tenant and creator for the
        # reservations. Should this fail, the rows are leased and due again when the lease ends.
        refusals = await authority.DECISIONS.refusals(self.rt.pool, rows) if rows else []
        for row, refusal in zip(rows, refusals):
            task = asyncio.create_task(attempt(self.rt, row, refusal), name=f"webhook-{row['event_id']}")
            self.in_flight.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.in_flight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook attempt crashed", exc_info=task.exception())
        self.wake.set()  # a free slot, and maybe the next event of that subject

    async def _sleep(self) -> None:
        if len(self.in_flight) >= self.rt.settings.webhook_concurrency:
            timeout: float | None = None  # only a finished attempt frees a slot
        else:
            due, held = await seconds_until_due(self.rt)
            timeout = POLICY.poll_seconds if due is None else min(POLICY.poll_seconds, max(due, 0.02))
            if held:
                timeout = min(timeout, self.recheck)
                self.recheck = min(self.recheck * 2, RECHECK_SECONDS[1])
            else:
                self.recheck = RECHECK_SECONDS[0]
        try:
            await asyncio.wait_for(self.wake.wait(), timeout)
        except TimeoutError:
            pass

    async def _listen(self, conninfo: str, stop: asyncio.Event) -> None:
        async with listen(conninfo, ["bc_webhooks"], stop, name="webhooks") as listener:
            async for _ in listener:
                self.wake.set()  # a NOTIFY, or RECONNECTED: the next claim re-reads every due delivery


async def run(rt: Runtime, conninfo: str, stop: asyncio.Event) -> None:
    await Worker(rt).run(conninfo, stop)
