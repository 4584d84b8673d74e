"""The three measured phases: the gRPC echo, the raw SQL write path, and the creates."""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import time
from dataclasses import dataclass
from typing import Any

import grpc

from bench import creates, diag, echo, pgstat, procstat, sqlpath, stack
from bench.load import Result, drive, drive_open, warm_up
from bench.seed import Seeded


# Call numbers make idempotency keys and requests: round n's calls start at (n - 1) * ROUND_CALLS,
# each phase's warm-up WARM_UP_OFFSET above that, so no two calls of a run share a number.
ROUND_CALLS = 100_000_000
WARM_UP_OFFSET = 90_000_000


def say(text: str) -> None:
    print(text, flush=True)


def round_first_call(n: int) -> int:
    """The first call number of round n (1-based): 0 for the first round, as without --rounds."""
    return (n - 1) * ROUND_CALLS


@dataclass
class Round:
    """One turn of the two floors and the closed-loop creates (--rounds): the ratios of each turn
    come from phases run minutes apart at most, so a machine whose speed drifts shows as spread."""
    echo: Result
    sql: Result
    create: Result


async def echo_phase(args: argparse.Namespace, tmp: pathlib.Path, conninfo: str,
                     watch: procstat.Watch, first_call: int = 0) -> Result:
    server = await stack.start_echo(args.server, tmp, conninfo)
    try:
        if server.pid is not None:
            watch = {**watch, "echo server": (server.pid, False)}
        payload = os.urandom(creates.request_size())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            method = echo.echo_call(channel)

            async def call(_: int) -> str:
                reply = await method(payload, timeout=30)
                return "ok" if reply == payload else "mismatch"

            await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 20,
                          first_call=first_call + WARM_UP_OFFSET)
            say(f"echo baseline: {args.concurrency} in flight, up to {args.baseline_seconds:.0f}s")
            return await drive("grpc echo (bytes)", call, concurrency=args.concurrency, first_call=first_call,
                               max_calls=args.max_calls, max_seconds=args.baseline_seconds, cpu_of=watch)
    finally:
        await server.stop()


async def sql_phase(args: argparse.Namespace, conninfo: str, work: creates.Workload,
                    watch: procstat.Watch, first_call: int = 0) -> Result:
    sqlpath.setup(conninfo)
    pool = await sqlpath.open_pool(conninfo, args.concurrency)
    try:
        call = sqlpath.sql_call(pool, work, nodes=args.nodes, gpus_per_node=8,
                                now_ms=int(time.time() * 1000), pool_lock=args.sql_pool_lock)
        await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 5,
                      first_call=first_call + WARM_UP_OFFSET)
        say(f"raw SQL baseline: 3 transactions per create, {args.concurrency} in flight, "
            f"up to {args.baseline_seconds:.0f}s{' (pool lock)' if args.sql_pool_lock else ''}")
        name = "raw SQL 3-tx create" + (" +lock" if args.sql_pool_lock else "")
        return await drive(name, call, concurrency=args.concurrency, max_calls=args.max_calls,
                           max_seconds=args.baseline_seconds, first_call=first_call, cpu_of=watch)
    finally:
        await pool.close()
        sqlpath.teardown(conninfo)


async def create_phases(args: argparse.Namespace, channels: list[grpc.aio.Channel], seeded: Seeded,
                        work: creates.Workload, conninfo: str, watch: procstat.Watch,
                        servers: list[stack.Running], tmp: pathlib.Path, out: Any) -> list[Result]:
    """The closed loop (unless --rate is a number), then the open loop (with --rate)."""
    results: list[Result] = []
    call = creates.create_call(channels, seeded.token, work, wait_ms=args.wait_ms, callers=seeded.callers)
    stat = not args.no_pg_stat
    await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 5, first_call=WARM_UP_OFFSET)

    async def measured(name: str, drive_it) -> Result:
        if stat:
            pgstat.reset(conninfo)
        profiling = args.profile_server and out.profiled is None
        if profiling:
            for server in servers:
                os.kill(server.pid, signal.SIGUSR1)
        if args.pg_statements and not results:
            diag.enable_statement_log(conninfo)
        logs = [s.log_path for s in servers if s.log_path]
        before = [_size(path) for path in logs]
        try:
            res = await drive_it()
        finally:
            out.server_spans[name] = [(path, start, _size(path)) for path, start in zip(logs, before)]
            if args.pg_statements and not results:
                diag.disable_statement_log(conninfo)
            if profiling:
                paths = [tmp / f"controlplane-{i}.prof" for i in range(1, len(servers) + 1)]
                for server in servers:
                    os.kill(server.pid, signal.SIGUSR2)
        if profiling:
            await _written(paths)
            out.profiled = (paths, res.calls)
        if stat:
            out.statements[name] = pgstat.collect(conninfo)
        results.append(res)
        return res

    closed = None
    if not isinstance(args.rate, float):
        say(f"creates: {args.concurrency} in flight, up to {args.seconds:.0f}s or {args.max_calls} calls")
        closed = await measured("Reservations.Create", lambda: drive(
            "Reservations.Create", call, concurrency=args.concurrency, max_calls=args.max_calls,
            max_seconds=args.seconds, cpu_of=watch))
    if args.rate is not None:
        rate = args.rate if isinstance(args.rate, float) else max(1.0, closed.rate / 2)  # type: ignore[union-attr]
        name = f"Create open loop {rate:.0f}/s"
        say(f"creates, open loop: {rate:.1f} calls/s{' (half the closed-loop rate)' if args.rate == 'half' else ''}, "
            f"up to {args.seconds:.0f}s")
        if closed is not None and not args.no_analyze:
            # The closed loop has just filled tables that were empty (thousands of reservations,
            # bookings, charges): autovacuum would visit each within its next minute, in the
            # middle of the open loop, and every backend then plans its statements again under
            # the pool lock. A table of a running fleet is large and visited once per tenth of
            # growth (hours apart at these rates): done here, as ANALYZE after seeding is.
            started = time.perf_counter()
            stack.vacuum_analyze(conninfo)
            say(f"  VACUUM (ANALYZE) after the closed loop: {time.perf_counter() - started:.1f}s")
        await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 2, first_call=91_000_000)
        await measured(name, lambda: drive_open(name, call, rate=rate, max_calls=args.max_calls,
                                                max_seconds=args.seconds, first_call=50_000_000, cpu_of=watch))
    return results


async def another_round(n: int, args: argparse.Namespace, tmp: pathlib.Path, conninfo: str,
                        channels: list[grpc.aio.Channel], seeded: Seeded, work: creates.Workload,
                        watch: procstat.Watch) -> Round:
    """Round n (2 and on) of --rounds: the echo floor, the raw-SQL floor, then the closed-loop
    creates, as in the first round, each phase numbering its calls apart from every other round's
    (a create repeated with the same idempotency key would be a replay, not a create)."""
    first = round_first_call(n)
    say(f"round {n} of {args.rounds}")
    echo_result = await echo_phase(args, tmp, conninfo, watch, first_call=first)
    sql_result = await sql_phase(args, conninfo, work, watch, first_call=first)
    call = creates.create_call(channels, seeded.token, work, wait_ms=args.wait_ms, callers=seeded.callers)
    await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 5, first_call=first + WARM_UP_OFFSET)
    say(f"creates: {args.concurrency} in flight, up to {args.seconds:.0f}s or {args.max_calls} calls")
    create = await drive("Reservations.Create", call, concurrency=args.concurrency, max_calls=args.max_calls,
                         max_seconds=args.seconds, first_call=first, cpu_of=watch)
    return Round(echo_result, sql_result, create)


async def _written(paths: list[pathlib.Path], timeout: float = 30) -> None:
    """Until every profile file exists and stopped growing (the dump follows the signal)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    sizes: list[int] = []
    while loop.time() < deadline:
        now = [p.stat().st_size if p.exists() else -1 for p in paths]
        if -1 not in now and now == sizes:
            return
        sizes = now
        await asyncio.sleep(0.3)


def _size(path: pathlib.Path) -> int:
    return path.stat().st_size if path.exists() else 0
