"""Where a call's database time went (controlplane.db.Spent): the wait for a pooled connection and
the time holding one, per task, as each unary RPC's log line reports them."""

from __future__ import annotations

import asyncio

import psycopg
import structlog

from controlplane import db
from tests.support import World


async def _sleep_on(conn: psycopg.AsyncConnection, seconds: float) -> None:
    await conn.execute("SELECT pg_sleep(%s)", (seconds,))


def test_a_task_counts_its_own_waits_and_holds_and_no_one_elses(database: str) -> None:
    async def scenario() -> None:
        pool = await db.open_pool(database, size=1)
        try:
            async def holder() -> db.Spent:
                spent = db.spent_here()
                await db.run_autocommit(pool, lambda c: _sleep_on(c, 0.3))
                return spent

            async def waiter() -> db.Spent:
                spent = db.spent_here()
                await asyncio.sleep(0.05)  # the holder has the pool's one connection by now
                await db.run_in_transaction(pool, lambda c: _sleep_on(c, 0.1))
                async with db.read_only(pool) as conn:
                    await conn.execute("SELECT 1")
                return spent

            held, waited = await asyncio.gather(holder(), waiter())
            assert held.lent == 1 and held.held >= 0.3 and held.waited < 0.1
            assert waited.lent == 2 and waited.waited >= 0.2, "the wait behind the holder was not counted"
            assert 0.1 <= waited.held < 0.3, "the holder's time was counted in the waiter's"
            assert db.spent() is None  # this task never asked: nothing is counted for it
            await db.run_autocommit(pool, lambda c: _sleep_on(c, 0))
            assert db.spent() is None
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_the_rpc_line_says_where_a_create_spent_its_time(world: World) -> None:
    with structlog.testing.capture_logs() as logs:
        world.create(count=1)
    lines = [e for e in logs if e.get("event") == "rpc" and e["method"].endswith("/Create")]
    assert len(lines) == 1
    line = lines[0]
    assert line["db_lent"] >= 2, "a create lends a connection at least twice (its draft, its placement)"
    assert line["db_ms"] > 0 and line["db_wait_ms"] >= 0
    assert line["db_wait_ms"] + line["db_ms"] <= line["duration_ms"] + 0.05  # rounding of each figure
