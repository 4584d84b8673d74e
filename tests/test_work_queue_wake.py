"""The work queue queries only when something is due: an item due later costs no claim until its
time (the NOTIFY says when), one due now costs one claim, a burst fans out over the drains, and a
moved clock is honoured.

Each test runs the queue as the app runs it (real database, pool and LISTEN) with its own handler
for the 'reservation' kind, and reads the runner's query counter (bc_work_queue_queries) from its
metrics registry. The runner reads the queue once when its listener connects; a test starts
counting after that read (next_due == 1), from when every notification is heard.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import psycopg

from controlplane import clock, db
from controlplane.config import Settings
from controlplane.runtime import Runtime
from controlplane.workers import queue

KIND = "reservation"
WAIT = 30.0


def sql(database: str, query: str, params: object = None) -> list[tuple]:
    with psycopg.connect(database, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def queries(rt: Runtime, query: str) -> int:
    return int(rt.metrics.registry.get_sample_value("bc_work_queue_queries_total", {"query": query}) or 0)


async def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, f"waited {WAIT}s for {what}"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def running(database: str, handler: queue.Handler, *, concurrency: int = 2,
                  **settings: object) -> AsyncIterator[Runtime]:
    """The queue running `handler`, once its first read of the queue is done."""
    stop = asyncio.Event()
    pool = await db.open_pool(database, size=concurrency + 2)
    rt = Runtime(pool, Settings(database_url=database, **settings))
    runner = asyncio.create_task(queue.run(rt, database, stop, {KIND: handler}, concurrency=concurrency))
    try:
        await wait_for("the first read of the queue", lambda: queries(rt, "next_due") >= 1)
        assert (queries(rt, "claim"), queries(rt, "next_due")) == (1, 1)
        yield rt
    finally:
        stop.set()
        await asyncio.wait_for(runner, WAIT)
        await pool.close()


def recorder(seen: list[tuple[str, int, int]]) -> Callable[..., Awaitable[None]]:
    """Record each subject handled with the runner's claims and next-due reads at that moment."""

    async def record(conn, rt, subject: str) -> None:
        seen.append((subject, queries(rt, "claim"), queries(rt, "next_due")))

    return record


def test_an_item_due_later_costs_no_claim_until_it_is_due(database: str) -> None:
    seen: list[tuple[str, int, int]] = []

    async def scenario() -> None:
        async with running(database, recorder(seen)) as rt:
            (due_at,), = sql(database, "SELECT epoch_ms(compute_now() + interval '1.5 seconds')")
            sql(database, "SELECT schedule_work('reservation', 'later', from_epoch_ms(%s))", (due_at,))
            # Other items of the same burst, of later times: none of them moves the timer or costs a query.
            sql(database, "SELECT schedule_work('reservation', 'much-later-' || g, compute_now() + g * interval '1 day')"
                          " FROM generate_series(1, 20) g")
            await wait_for("the item handled", lambda: bool(seen))
            (handled_at,), = sql(database, "SELECT epoch_ms(compute_now())")
            assert handled_at >= due_at
            # The timer fired, then one claim took the item and one read found the next (a day away).
            await wait_for("the next read", lambda: queries(rt, "next_due") == 2)

    asyncio.run(scenario())
    assert seen == [("later", 2, 1)]  # the startup claim, then only the one that took it


def test_an_item_due_now_costs_one_claim_and_no_read(database: str) -> None:
    seen: list[tuple[str, int, int]] = []

    async def scenario() -> None:
        async with running(database, recorder(seen)):
            sql(database, "SELECT schedule_work('reservation', 'first', compute_now())")
            await wait_for("the first item handled", lambda: len(seen) == 1)
            sql(database, "SELECT schedule_work('reservation', 'second', compute_now())")
            await wait_for("the second item handled", lambda: len(seen) == 2)

    asyncio.run(scenario())
    # No drain claimed again after the first item, none read the next due time.
    assert seen == [("first", 2, 1), ("second", 3, 1)]


def test_a_notification_of_another_kind_is_ignored(database: str) -> None:
    seen: list[tuple[str, int, int]] = []

    async def scenario() -> None:
        async with running(database, recorder(seen)):
            sql(database, "SELECT pg_notify('bc_work', 'metal 0')")  # a kind this runner does not serve
            sql(database, "SELECT schedule_work('reservation', 'mine', compute_now())")
            await wait_for("the item handled", lambda: bool(seen))

    asyncio.run(scenario())
    assert seen == [("mine", 2, 1)]


def test_a_burst_of_due_items_is_handled_by_every_drain_at_once(database: str) -> None:
    inside: set[str] = set()
    most = [0]

    async def meet(conn, rt, subject: str) -> None:  # each waits until all eight are in, or 20 s pass
        inside.add(subject)
        most[0] = max(most[0], len(inside))
        deadline = time.monotonic() + 20
        while len(inside) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        async with running(database, meet, concurrency=8):
            # One transaction, one notification (identical payloads collapse): the drains fan out.
            sql(database, "SELECT schedule_work('reservation', 'item-' || g, compute_now()) FROM generate_series(1, 8) g")
            await wait_for("all eight handled", lambda: not sql(database, "SELECT 1 FROM work_items"))

    asyncio.run(scenario())
    assert most[0] == 8


def test_a_clock_moved_forward_makes_a_later_item_due(database: str) -> None:
    seen: list[tuple[str, int, int]] = []

    async def scenario() -> None:
        async with running(database, recorder(seen), clock_control=True) as rt:
            sql(database, "SELECT schedule_work('reservation', 'tomorrow', compute_now() + interval '1 day')")
            sql(database, "SELECT schedule_work('reservation', 'next-week', compute_now() + interval '7 days')")
            await clock.advance(rt, 86_400_000 + 1000)
            await wait_for("the item handled", lambda: bool(seen))
            await wait_for("the next read", lambda: queries(rt, "next_due") == 2)

    asyncio.run(scenario())
    assert [s for s, _, _ in seen] == ["tomorrow"]
    assert sql(database, "SELECT subject FROM work_items") == [("next-week",)]
