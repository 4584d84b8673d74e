"""A transaction, or a statement in autocommit, that PostgreSQL ends with a deadlock or a
serialization failure runs again (controlplane.db); any other error is raised at once."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from controlplane import db

# A statement that fails with the given SQLSTATE, as the server would end it.
FAIL = "DO $$ BEGIN RAISE EXCEPTION 'as if' USING ERRCODE = '{code}'; END $$"


def attempts_until_done(database: str, run, fail_times: int, code: str) -> int:
    calls = [0]

    async def work(conn: psycopg.AsyncConnection) -> str:
        calls[0] += 1
        if calls[0] <= fail_times:
            await conn.execute(FAIL.format(code=code))
        return (await (await conn.execute("SELECT 'done' AS r")).fetchone())["r"]

    async def scenario() -> None:
        pool = await db.open_pool(database, size=2)
        try:
            assert await run(pool, work) == "done"
        finally:
            await pool.close()

    asyncio.run(scenario())
    return calls[0]


@pytest.mark.parametrize("run", [db.run_in_transaction, db.run_autocommit], ids=["transaction", "autocommit"])
@pytest.mark.parametrize("code", ["40P01", "40001"])
def test_a_deadlock_or_serialization_failure_runs_again(database: str, run, code: str) -> None:
    assert attempts_until_done(database, run, fail_times=2, code=code) == 3


@pytest.mark.parametrize("run", [db.run_in_transaction, db.run_autocommit], ids=["transaction", "autocommit"])
def test_any_other_error_is_raised_at_once(database: str, run) -> None:
    with pytest.raises(psycopg.errors.UniqueViolation):
        attempts_until_done(database, run, fail_times=1, code="23505")


def test_the_last_attempt_raises(database: str) -> None:
    with pytest.raises(psycopg.errors.DeadlockDetected):
        attempts_until_done(database, db.run_autocommit, fail_times=5, code="40P01")


def test_the_pool_checks_a_live_connection_without_a_round_trip_and_a_dead_one_with_one(
    database: str, tmp_path
) -> None:
    """Before lending a connection the pool calls db.check_lent: a live idle connection is judged
    by one poll of its socket (nothing goes to the server: libpq's protocol trace stays empty),
    and one whose backend the server ended is found dead (the check raises, so the pool replaces
    it) after its empty query."""

    async def scenario() -> None:
        conn = await psycopg.AsyncConnection.connect(database, autocommit=True)
        trace = tmp_path / "trace"
        try:
            with open(trace, "w") as out:
                conn.pgconn.trace(out.fileno())
                for _ in range(3):
                    await db.check_lent(conn)
                conn.pgconn.untrace()
            assert trace.read_text() == "", "a live connection's check went to the server"
            pid = conn.info.backend_pid
            with psycopg.connect(database, autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
            with pytest.raises(psycopg.OperationalError):
                await db.check_lent(conn)
        finally:
            await conn.close()

    asyncio.run(scenario())
