"""The durable work queue: two replicas never handle one wake-up twice; a failing handler is
retried with back-off and loses nothing."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest

from controlplane.workers import queue
from tests.support import ServerThread


@pytest.fixture
def recording_handler():
    """Handle 'pool' items by recording them (the queue's own extension point, not a mock)."""
    previous = queue.HANDLERS.get("pool")

    async def record(conn, rt, subject: str) -> None:
        await conn.execute("INSERT INTO handled (subject) VALUES (%s)", (subject,))
        await asyncio.sleep(0.002)  # widen the window in which a second replica could interfere
        if subject.startswith("flaky-"):
            attempts = (await (await conn.execute(
                "SELECT attempts FROM work_items WHERE subject = %s", (subject,))).fetchone())["attempts"]
            if attempts < 2:
                raise RuntimeError("transient failure")

    queue.HANDLERS["pool"] = record
    yield
    if previous is None:
        queue.HANDLERS.pop("pool", None)
    else:
        queue.HANDLERS["pool"] = previous


def test_two_replicas_handle_each_wake_up_exactly_once(database: str, recording_handler) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE handled (subject text NOT NULL)")
        conn.execute("INSERT INTO work_items (kind, subject, run_at)"
                     " SELECT 'pool', 'item-' || g, compute_now() FROM generate_series(1, 300) g")
    replicas = [ServerThread(database) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while True:
            with psycopg.connect(database) as conn:
                left = conn.execute("SELECT count(*) FROM work_items WHERE kind = 'pool'").fetchone()[0]
            if left == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        with psycopg.connect(database) as conn:
            counts = conn.execute("SELECT subject, count(*) FROM handled GROUP BY subject").fetchall()
        assert left == 0
        assert len(counts) == 300 and all(n == 1 for _, n in counts)
    finally:
        for r in replicas:
            r.stop()


def test_a_failing_handler_is_retried_with_back_off_and_its_effects_rolled_back(
    database: str, recording_handler
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE handled (subject text NOT NULL)")
        conn.execute("INSERT INTO work_items (kind, subject, run_at) VALUES ('pool', 'flaky-1', compute_now())")
    server = ServerThread(database)
    try:
        deadline = time.monotonic() + 30
        while True:
            with psycopg.connect(database) as conn:
                item = conn.execute("SELECT attempts, last_error FROM work_items WHERE subject = 'flaky-1'").fetchone()
                handled = conn.execute("SELECT count(*) FROM handled").fetchone()[0]
            if item is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert item is None  # done on the third attempt (back-off 1 s, then 2 s)
        assert handled == 1  # the two failed attempts' writes were rolled back with them
    finally:
        server.stop()
