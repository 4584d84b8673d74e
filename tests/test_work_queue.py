"""The durable work queue: two replicas never handle one wake-up twice; a failing handler is
retried with back-off and loses nothing; one that keeps failing is dead after work_max_attempts
and never retried; only kinds the schema lists can be queued; the queue is handed its handlers.

The queue runs here as the app runs it, on a real database with real connection pools and LISTEN,
but handed the test's own handler for the 'reservation' kind (subjects that name no reservation).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import psycopg
import pytest
from structlog.testing import capture_logs

from controlplane import db
from controlplane.config import Settings
from controlplane.runtime import Runtime
from controlplane.workers import queue

KIND = "reservation"


def sql(database: str, query: str, params: object = None) -> list[tuple]:
    with psycopg.connect(database, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


async def run_queues(database: str, handler: queue.Handler, done: Callable[[], bool], *, replicas: int = 1,
                     seconds: float = 60, **settings: object) -> None:
    """Run `replicas` queues (each with its own pool and listener) until `done()` or `seconds`."""
    stop = asyncio.Event()
    pools = [await db.open_pool(database, size=4) for _ in range(replicas)]
    runners = [asyncio.create_task(queue.run(Runtime(pool, Settings(database_url=database, **settings)),
                                             database, stop, {KIND: handler}))
               for pool in pools]
    try:
        deadline = time.monotonic() + seconds
        while not await asyncio.to_thread(done) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*runners)
        for pool in pools:
            await pool.close()


def recording(flaky_until: int = 0) -> Callable[..., Awaitable[None]]:
    """Record each subject handled; subjects 'flaky-…' fail until their item has that many attempts."""

    async def record(conn, rt, subject: str) -> None:
        await conn.execute("INSERT INTO handled (subject) VALUES (%s)", (subject,))
        await asyncio.sleep(0.002)  # widen the window in which a second replica could interfere
        if subject.startswith("flaky-"):
            attempts = (await (await conn.execute(
                "SELECT attempts FROM work_items WHERE subject = %s", (subject,))).fetchone())["attempts"]
            if attempts < flaky_until:
                raise RuntimeError("transient failure")

    return record


def test_two_replicas_handle_each_wake_up_exactly_once(database: str) -> None:
    sql(database, "CREATE TABLE handled (subject text NOT NULL)")
    sql(database, "INSERT INTO work_items (kind, subject, run_at)"
                  " SELECT 'reservation', 'item-' || g, compute_now() FROM generate_series(1, 300) g")

    def left() -> int:
        return sql(database, "SELECT count(*) FROM work_items")[0][0]

    asyncio.run(run_queues(database, recording(), lambda: left() == 0, replicas=2))
    counts = sql(database, "SELECT subject, count(*) FROM handled GROUP BY subject")
    assert left() == 0
    assert len(counts) == 300 and all(n == 1 for _, n in counts)


def test_a_failing_handler_is_retried_with_back_off_and_its_effects_rolled_back(database: str) -> None:
    sql(database, "CREATE TABLE handled (subject text NOT NULL)")
    sql(database, "INSERT INTO work_items (kind, subject, run_at) VALUES ('reservation', 'flaky-1', compute_now())")

    def gone() -> bool:
        return not sql(database, "SELECT 1 FROM work_items WHERE subject = 'flaky-1'")

    asyncio.run(run_queues(database, recording(flaky_until=2), gone, seconds=30))
    assert gone()  # done on the third attempt (back-off 1 s, then 2 s)
    assert sql(database, "SELECT count(*) FROM handled")[0][0] == 1  # the failed attempts' writes rolled back


def test_a_handler_that_always_fails_dead_letters_the_item_after_max_attempts(database: str) -> None:
    calls: list[str] = []

    async def broken(conn, rt, subject: str) -> None:
        calls.append(subject)
        if subject == "doomed":
            raise RuntimeError("this handler always fails")

    sql(database, "INSERT INTO work_items (kind, subject, run_at) VALUES ('reservation', 'doomed', compute_now())")

    def dead() -> bool:
        return bool(sql(database, "SELECT 1 FROM dead_work_items WHERE subject = 'doomed'"))

    def marker_handled() -> bool:
        return "marker" in calls

    async def scenario() -> None:
        await run_queues(database, broken, dead, seconds=30, work_max_attempts=3)
        # A dead item stays due at once (run_at is its time of death, before the marker's), so a
        # queue that still claimed it would handle it before the marker.
        sql(database, "UPDATE work_items SET run_at = dead_at WHERE subject = 'doomed'")
        sql(database, "INSERT INTO work_items (kind, subject, run_at) VALUES ('reservation', 'marker', compute_now())")
        await run_queues(database, broken, marker_handled, seconds=30, work_max_attempts=3)

    with capture_logs() as logs:
        asyncio.run(scenario())
    assert dead() and marker_handled()
    assert calls == ["doomed"] * 3 + ["marker"]  # three attempts, then never again
    (attempts, error), = sql(database, "SELECT attempts, last_error FROM dead_work_items WHERE subject = 'doomed'")
    assert attempts == 3 and "this handler always fails" in error
    died = [e for e in logs if e["event"] == "work item dead"]
    assert len(died) == 1 and died[0]["subject"] == "doomed" and died[0]["attempts"] == 3
    assert died[0]["log_level"] == "error" and died[0]["kind"] == "reservation"


def test_a_handler_that_lost_a_deadlock_runs_again_at_once(database: str) -> None:
    """A deadlock (or serialization failure) a handler lost is run again in the same claim, as API
    calls are, not failed with a back-off of seconds; one lost every time fails as any error does."""
    sql(database, "CREATE TABLE handled (subject text NOT NULL)")
    calls: list[str] = []

    async def racing(conn, rt, subject: str) -> None:
        calls.append(subject)
        await conn.execute("INSERT INTO handled (subject) VALUES (%s)", (subject,))
        if subject == "always" or (subject == "twice" and calls.count(subject) <= 2):
            raise (psycopg.errors.DeadlockDetected if len(calls) % 2 else psycopg.errors.SerializationFailure)(
                "lost a race")

    sql(database, "INSERT INTO work_items (kind, subject, run_at) VALUES ('reservation', 'twice', compute_now()),"
                  " ('reservation', 'always', compute_now())")

    def settled() -> bool:
        return not sql(database, "SELECT 1 FROM work_items WHERE dead_at IS NULL")

    with capture_logs() as logs:
        asyncio.run(run_queues(database, racing, settled, seconds=30, work_max_attempts=1))
    assert settled()
    assert calls.count("twice") == 3 and calls.count("always") == queue.AT_ONCE_ATTEMPTS
    assert sql(database, "SELECT subject FROM handled") == [("twice",)]  # the lost attempts rolled back
    assert sql(database, "SELECT subject FROM dead_work_items") == [("always",)]
    failed = [e["subject"] for e in logs if e["event"] in ("work item failed", "work item dead")]
    assert failed == ["always"]  # 'twice' never counted as a failure
    again = [(e["subject"], e["attempt"]) for e in logs if e["event"] == "work item retried at once"]
    assert sorted(again) == [("always", 1), ("always", 2), ("twice", 1), ("twice", 2)]


@pytest.mark.parametrize("insert", [
    "INSERT INTO work_items (kind, subject, run_at) VALUES ('pool', 'p-1', compute_now())",
    "SELECT schedule_work('webhook', 'w-1', compute_now())",
    "SELECT schedule_work('no-such-kind', 'x-1', compute_now())",
])
def test_an_item_of_a_kind_no_handler_serves_cannot_be_inserted(database: str, insert: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as exc:
        sql(database, insert)
    assert exc.value.diag.constraint_name == "work_items_kind_check"
    assert sql(database, "SELECT count(*) FROM work_items")[0][0] == 0


def test_the_queue_is_handed_its_handlers_and_imports_none() -> None:
    probe = ("import sys, controlplane.workers.queue as q; "
             "print(sorted(m for m in sys.modules if m.startswith('controlplane.reservations')), hasattr(q, 'HANDLERS'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "False"]


def test_every_served_kind_can_be_inserted(database: str) -> None:
    """The kind constraint and the app's handlers agree: each migration that adds a kind keeps the
    kinds before it (a later one rewriting the list must not drop another's)."""
    from controlplane.app import WORK_HANDLERS

    for kind in WORK_HANDLERS:
        sql(database, "SELECT schedule_work(%s, 'k-1', compute_now())", (kind,))
    assert sorted(r[0] for r in sql(database, "SELECT kind FROM work_items")) == sorted(WORK_HANDLERS)


def test_a_process_handles_work_concurrency_items_at_once(database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A burst of creates queues a pass per reservation: two at a time, then eight, left placed ->
    # active seconds behind (docs/benchmarks-fleet.md), so the app runs BC_WORK_CONCURRENCY of
    # them, as many as its pool has connections.
    defaults = Settings(database_url=database)
    assert defaults.work_concurrency == defaults.db_pool_size == 16
    monkeypatch.setenv("BC_WORK_CONCURRENCY", "5")
    settings = Settings(database_url=database)
    assert settings.work_concurrency == 5
    sql(database, "INSERT INTO work_items (kind, subject, run_at)"
                  " SELECT 'reservation', 'item-' || g, compute_now() FROM generate_series(1, 5) g")
    inside: set[str] = set()
    most = [0]

    async def meet(conn, rt, subject: str) -> None:  # each waits until all five are in, or 20 s pass
        inside.add(subject)
        most[0] = max(most[0], len(inside))
        deadline = time.monotonic() + 20
        while len(inside) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def run() -> None:
        stop = asyncio.Event()
        pool = await db.open_pool(database, size=8)
        runner = asyncio.create_task(queue.run(Runtime(pool, settings), database, stop, {KIND: meet},
                                               concurrency=settings.work_concurrency))
        try:
            deadline = time.monotonic() + 60
            while most[0] < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await runner
            await pool.close()

    asyncio.run(run())
    assert most[0] == 5
