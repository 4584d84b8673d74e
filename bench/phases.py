"""The three measured phases: the gRPC echo, the raw SQL write path, and the creates."""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import grpc

from bench import creates, diag, echo, procstat, sqlpath, stack
from bench.load import Result, drive, warm_up
from bench.seed import Seeded


def say(text: str) -> None:
    print(text, flush=True)


async def echo_phase(args: argparse.Namespace, tmp: pathlib.Path, conninfo: str,
                     watch: procstat.Watch) -> Result:
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

            await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 20, first_call=0)
            say(f"echo baseline: {args.concurrency} in flight, up to {args.baseline_seconds:.0f}s")
            return await drive("grpc echo (bytes)", call, concurrency=args.concurrency,
                               max_calls=args.max_calls, max_seconds=args.baseline_seconds, cpu_of=watch)
    finally:
        await server.stop()


async def sql_phase(args: argparse.Namespace, conninfo: str, work: creates.Workload,
                    watch: procstat.Watch) -> Result:
    sqlpath.setup(conninfo)
    pool = await sqlpath.open_pool(conninfo, args.concurrency)
    try:
        call = sqlpath.sql_call(pool, work, nodes=args.nodes, gpus_per_node=8,
                                now_ms=int(time.time() * 1000), pool_lock=args.sql_pool_lock)
        await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 5, first_call=90_000_000)
        say(f"raw SQL baseline: 3 transactions per create, {args.concurrency} in flight, "
            f"up to {args.baseline_seconds:.0f}s{' (pool lock)' if args.sql_pool_lock else ''}")
        name = "raw SQL 3-tx create" + (" +lock" if args.sql_pool_lock else "")
        return await drive(name, call, concurrency=args.concurrency, max_calls=args.max_calls,
                           max_seconds=args.baseline_seconds, cpu_of=watch)
    finally:
        await pool.close()
        sqlpath.teardown(conninfo)


async def create_phase(args: argparse.Namespace, channel: grpc.aio.Channel, seeded: Seeded,
                       work: creates.Workload, conninfo: str, pg_log: pathlib.Path,
                       watch: procstat.Watch) -> Result:
    call = creates.create_call(channel, seeded.token, work)
    await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 5, first_call=90_000_000)
    say(f"creates: {args.concurrency} in flight, up to {args.seconds:.0f}s or {args.max_calls} calls")
    if args.pg_statements:
        diag.enable_statement_log(conninfo)
    try:
        return await drive("Reservations.Create", call, concurrency=args.concurrency,
                           max_calls=args.max_calls, max_seconds=args.seconds, cpu_of=watch)
    finally:
        if args.pg_statements:
            diag.disable_statement_log(conninfo)
