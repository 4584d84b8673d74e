"""`python -m bench` (`make bench`): see docs/benchmarks.md for what it measures and how to read it."""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import platform
import sys
import uuid
from dataclasses import dataclass

import grpc

from bench import creates, diag, phases, procstat, report, stack
from bench import gang as gang_bench
from bench.load import Result
from bench.phases import say
from bench.seed import Seeded, seed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--nodes", type=int, help="nodes in the pool, 8 H100 each (default 1000)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="calls in flight in every phase (default 16)")
    p.add_argument("--seconds", type=float, help="time bound of the create phase (default 25)")
    p.add_argument("--baseline-seconds", type=float, help="time bound of each baseline (default 10)")
    p.add_argument("--max-calls", type=int, default=200_000,
                   help="count bound of every phase (default 200000)")
    p.add_argument("--server", choices=["subprocess", "inprocess"], default="subprocess",
                   help="control plane (and echo server) as a child process or in this process")
    p.add_argument("--fast-db", action="store_true",
                   help="fsync, synchronous_commit and full_page_writes off")
    p.add_argument("--no-baselines", action="store_true", help="measure only the creates")
    p.add_argument("--sql-pool-lock", action="store_true",
                   help="raw SQL baseline: take one advisory lock in Tx 3, like a one-pool placer")
    p.add_argument("--horizon-days", type=float, default=60,
                   help="reservation starts spread over this many days (default 60)")
    p.add_argument("--seed-concurrency", type=int, default=16,
                   help="RegisterNode calls in flight (default 16)")
    p.add_argument("--no-analyze", action="store_true",
                   help="skip ANALYZE after seeding (planner statistics then depend on autovacuum)")
    p.add_argument("--pg-statements", action="store_true",
                   help="diagnostic: log every SQL statement during the creates and summarise (slower)")
    p.add_argument("--profile-server", action="store_true",
                   help="diagnostic: run the control plane under cProfile and print its hot spots (slower)")
    p.add_argument("--placement-index", choices=["on", "off"], default="on",
                   help="plan creates with the in-memory capacity index, or with the SQL shortlist (off)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (database, server log)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 100 nodes, 5 s of creates, 3 s per baseline (flags given win)")
    gang_bench.add_args(p)
    args = p.parse_args(argv)
    defaults = (100, 5.0, 3.0) if args.quick else (1000, 25.0, 10.0)
    for name, value in zip(("nodes", "seconds", "baseline_seconds"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def machine_line(conninfo: str, mode: str, fast_db: bool) -> str:
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    pg = stack.count_rows(conninfo, "SELECT current_setting('server_version')")[0][0]
    return (f"machine: {os.cpu_count()} cores {model}; Python {platform.python_version()}, "
            f"grpcio {grpc.__version__}, PostgreSQL {pg} (embedded{', fsync off' if fast_db else ''}); "
            f"server: {mode}")


@dataclass
class Run:
    seeded: Seeded
    results: list[Result]
    create: Result
    echo: Result | None
    sql: Result | None
    states: list[tuple]
    bookings: int
    server_log: pathlib.Path | None
    pg_log: pathlib.Path
    pg_log_offset: int
    gang: str = ""  # the gang phase's report (--gang)


async def run(args: argparse.Namespace, tmp: pathlib.Path, conninfo: str, root_token: str) -> Run:
    say(f"starting the control plane ({args.server})")
    python_args = diag.profile_args(tmp) if args.profile_server else None
    server = await stack.start_controlplane(args.server, tmp, conninfo, python_args=python_args)
    try:
        pg_pid = stack.postmaster_pid(tmp)
        inproc = args.server == "inprocess"
        # The control plane is watched in the baselines too: idle there, but not "other".
        watch = procstat.watch_for(server_pid=server.pid, postmaster_pid=pg_pid, in_process=inproc)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            say(f"seeding {args.nodes} nodes x 8 H100 through the Admin API")
            seeded = await seed(channel, root_token, nodes=args.nodes, concurrency=args.seed_concurrency)
            if not args.no_analyze:
                stack.analyze(conninfo)  # fresh statistics, as autovacuum would give within a minute
            work = creates.Workload(seeded.tenant_id, seeded.pool_id, f"bench-{uuid.uuid4().hex[:10]}",
                                    horizon_days=args.horizon_days)
            echo_res = sql_res = None
            if not args.no_baselines:
                echo_res = await phases.echo_phase(args, tmp, conninfo, watch)
                sql_res = await phases.sql_phase(args, conninfo, work, watch)
            pg_log = tmp / "pgdata" / "log"
            offset = diag.log_offset(pg_log)
            create_res = await phases.create_phase(args, channel, seeded, work, conninfo, pg_log, watch)
            gang_report = await gang_bench.gang_phase(args, channel, seeded, conninfo) if args.gang else ""
        states = stack.count_rows(
            conninfo,
            "SELECT state, count(*) FROM reservations WHERE tenant_id = %s GROUP BY 1 ORDER BY 2 DESC",
            (seeded.tenant_id,),
        )
        bookings = stack.count_rows(conninfo, "SELECT count(*) FROM bookings")[0][0]
    finally:
        await server.stop()
    results = [create_res, *(r for r in (echo_res, sql_res) if r)]
    return Run(seeded, results, create_res, echo_res, sql_res, states, bookings,
               server.log_path, pg_log, offset, gang=gang_report)


def print_report(args: argparse.Namespace, conninfo: str, tmp: pathlib.Path, out: Run) -> None:
    seeded = out.seeded
    say("")
    say(machine_line(conninfo, args.server, args.fast_db))
    say(f"pool: {seeded.nodes} nodes, {seeded.gpus} GPUs, seeded in {seeded.seconds:.1f}s "
        f"({seeded.nodes / seeded.seconds:.0f} RegisterNode/s); "
        f"starts over {args.horizon_days:.0f} days, 1-8 h, 1/2/4/8 GPUs")
    for block in (
        report.phase_table(out.results),
        report.outcome_table(out.create) + "\n  in the database (incl. warm-up): "
        + ", ".join(f"{s} {n}" for s, n in out.states) + f"; {out.bookings} bookings",
        report.cpu_table(out.results),
        report.ratios(out.create, out.echo, out.sql),
        report.server_log_summary(out.server_log),
        diag.statement_summary(out.pg_log, out.pg_log_offset, calls=out.create.calls)
        if args.pg_statements else "",
        diag.profile_summary(tmp) if args.profile_server else "",
        out.gang,
    ):
        if block:
            say("")
            say(block)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["BC_PLACEMENT_INDEX"] = args.placement_index  # the control plane's setting, in either server mode
    tmp = stack.make_tmpdir()
    say(f"temp dir {tmp}")
    try:
        conninfo = stack.start_database(tmp, fast=args.fast_db)
        root_token = stack.ensure_root(conninfo)
        out = asyncio.run(run(args, tmp, conninfo, root_token))
        print_report(args, conninfo, tmp, out)
    except KeyboardInterrupt:
        say("interrupted: stopping")
        return 130
    finally:
        stack.stop_database(tmp)
        if args.keep:
            say(f"kept {tmp}")
        else:
            stack.remove_tmpdir(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
