"""`python -m bench` (`make bench`): see docs/benchmarks.md for what it measures and how to read it."""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import platform
import sys
import time
import uuid
from dataclasses import dataclass, field

import grpc

from bench import creates, diag, hostres, phases, pgstat, preload, procstat, report, stack
from bench import earliest as earliest_bench
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
                   help="skip ANALYZE after seeding, and with --rate half the VACUUM (ANALYZE) between the "
                        "closed and the open loop (statistics and vacuuming then left to autovacuum)")
    p.add_argument("--pg-statements", action="store_true",
                   help="diagnostic: log every SQL statement during the creates and summarise (slower)")
    p.add_argument("--pg-plans", action="store_true",
                   help="diagnostic: count planning too, nested statements included (pg_stat_statements "
                        "track = all, track_planning) and list the statements planned on most of their calls")
    p.add_argument("--profile-server", action="store_true",
                   help="diagnostic: run the control plane under cProfile and print its hot spots (slower)")
    p.add_argument("--placement-index", choices=["on", "off"], default="on",
                   help="plan creates with the in-memory capacity index, or with the SQL shortlist (off)")
    p.add_argument("--placer", choices=["inline", "lease"],
                   help="the pool's policy.placer (default: the server's); with lease a create answers "
                        "queued and counts when placed (Create with wait)")
    p.add_argument("--wait-ms", type=int,
                   help="Create asks the server to hold its answer until placed, up to this long "
                        "(default 30000 with --placer lease, else 0)")
    p.add_argument("--bookings", type=int, default=0,
                   help="preload this many bookings over the horizon before measuring (e.g. 1000000)")
    p.add_argument("--bookings-fill", type=float, default=0.25,
                   help="share of each node's time the preloaded bookings take (default 0.25)")
    p.add_argument("--bookings-tenant", choices=["other", "bench"], default="other",
                   help="whose quota the preloaded reservations charge (default: a second tenant)")
    p.add_argument("--rate", type=_rate,
                   help="open loop: calls started at R per second regardless of answers; 'half' first "
                        "measures the closed-loop maximum, then runs at half of it")
    p.add_argument("--replicas", type=int, default=1, help="control-plane processes on the one database")
    p.add_argument("--tenants", type=int, default=1,
                   help="tenants booking the pool (the first owns it, it is offered to the others; each has its "
                        "own identity, token and quota); create n is tenant n mod N's (default 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the echo floor, the raw-SQL floor and the closed-loop creates this many times "
                        "in turn and report each round's ratios and their median (default 1)")
    p.add_argument("--no-pg-stat", action="store_true",
                   help="do not load pg_stat_statements (saves a restart of PostgreSQL)")
    p.add_argument("--resources", action="store_true",
                   help="after the creates, the same on hosts with resources booked (reported next to them)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (database, server log)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 100 nodes, 5 s of creates, 3 s per baseline (flags given win)")
    gang_bench.add_args(p)
    earliest_bench.add_args(p)
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.tenants < 1:
        p.error("--tenants must be at least 1")
    if args.rounds > 1 and (args.no_baselines or isinstance(args.rate, float)):
        p.error("--rounds above 1 needs the floors and the closed loop (no --no-baselines, no numeric --rate)")
    if args.server == "inprocess" and (args.replicas > 1 or args.profile_server):
        p.error("--replicas and --profile-server need --server subprocess")
    if args.pg_plans and args.no_pg_stat:
        p.error("--pg-plans needs pg_stat_statements (no --no-pg-stat)")
    if args.wait_ms is None:
        args.wait_ms = 30_000 if args.placer == "lease" else 0
    defaults = (100, 5.0, 3.0) if args.quick else (1000, 25.0, 10.0)
    for name, value in zip(("nodes", "seconds", "baseline_seconds"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _rate(text: str) -> float | str:
    if text == "half":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("a number of calls per second, or 'half'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


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


# The measured phases start once each control plane has built its capacity index from rows.
INDEX_BUILT = "capacity index built"
INDEX_TIMEOUT_S = 300


@dataclass
class Run:
    seeded: Seeded
    results: list[Result]
    creates: list[Result]  # the create phases: closed loop and/or open loop
    create: Result  # the one the ratios use: the closed loop when it ran
    echo: Result | None
    sql: Result | None
    states: list[tuple]
    bookings: int
    server_logs: list[pathlib.Path]
    pg_log: pathlib.Path
    pg_log_offset: int
    startup: str
    preloaded: preload.Preloaded | None = None
    statements: dict[str, pgstat.Statements] = field(default_factory=dict)  # phase name -> counters
    profiled: tuple[list[pathlib.Path], int] | None = None  # profile files, creates they cover
    hostres: Result | None = None  # --resources: the create phase again with host resources booked
    gang: str = ""  # the gang phase's report (--gang)
    earliest: str = ""  # the earliest-fit phase's report (--earliest)
    rounds: list[phases.Round] = field(default_factory=list)  # --rounds: the first round and each after it
    # phase name -> each measured control plane's log lines written during it: (path, from byte, to byte)
    server_spans: dict[str, list[tuple[pathlib.Path, int, int]]] = field(default_factory=dict)


async def start_replicas(args: argparse.Namespace, tmp: pathlib.Path, conninfo: str) -> tuple[list, str]:
    """The measured control plane(s), started together on the seeded (and preloaded) database; the
    line says how long each took to answer gRPC and to build its capacity index from rows."""
    t0 = time.perf_counter()

    async def one(i: int) -> tuple[stack.Running, float, float | None]:
        profile_to = tmp / f"controlplane-{i}.prof" if args.profile_server else None
        server = await stack.start_controlplane(args.server, tmp, conninfo, profile_to=profile_to,
                                                name=f"controlplane-{i}")
        ready = time.perf_counter() - t0
        built = None
        if server.log_path is not None:
            waited = await stack.wait_log_event(server.log_path, INDEX_BUILT, timeout=INDEX_TIMEOUT_S)
            built = None if waited is None else time.perf_counter() - t0
        return server, ready, built

    started = await asyncio.gather(*(one(i) for i in range(1, args.replicas + 1)), return_exceptions=True)
    servers = [s[0] for s in started if not isinstance(s, BaseException)]
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        for server in servers:
            await server.stop()
        raise failed[0]
    ready = max(s[1] for s in started)
    built = [s[2] for s in started]
    index = (f"capacity index not seen built within {INDEX_TIMEOUT_S} s (no {INDEX_BUILT!r} log line)"
             if None in built
             else f"capacity index built after {max(built):.1f}s")  # type: ignore[type-var]
    return servers, (f"control plane start ({args.replicas} process{'es' if args.replicas > 1 else ''}, "
                     f"on the seeded database): gRPC ready after {ready:.1f}s, {index}")


async def run(args: argparse.Namespace, tmp: pathlib.Path, conninfo: str, root_token: str) -> Run:
    say(f"starting the control plane for seeding ({args.server})")
    seeder = await stack.start_controlplane(args.server, tmp, conninfo, name="controlplane-seed")
    preloaded = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{seeder.port}") as channel:
            say(f"seeding {args.nodes} nodes x 8 H100 through the Admin API")
            seeded = await seed(channel, root_token, nodes=args.nodes, concurrency=args.seed_concurrency,
                                placer=args.placer or "", tenants=args.tenants)
            if args.bookings:
                prepared = await preload.prepare(
                    channel, conninfo, root_token, pool_id=seeded.pool_id, bookings=args.bookings,
                    horizon_days=args.horizon_days, fill=args.bookings_fill, placer=args.placer or "",
                    charge_tenant=preload.TENANT if args.bookings_tenant == "other" else seeded.tenant_id)
    finally:
        await seeder.stop()
    if args.bookings:
        say(f"preloading {args.bookings} bookings over {args.horizon_days:.0f} days (no control plane up)")
        preloaded = preload.preload(conninfo, prepared)
        say(f"  preloaded {preloaded.bookings} bookings ({preloaded.reservations} reservations) "
            f"in {preloaded.seconds:.1f}s")
    if not args.no_analyze:
        stack.analyze(conninfo)  # fresh statistics, as autovacuum would give within a minute
    say(f"starting {args.replicas} control plane(s) ({args.server}) for the measured phases")
    servers, startup = await start_replicas(args, tmp, conninfo)
    say(f"  {startup}")
    out = Run(seeded, [], [], Result("Reservations.Create", 0), None, None, [], 0,
              [s.log_path for s in servers if s.log_path], tmp / "pgdata" / "log", 0, startup, preloaded)
    channels = []
    try:
        pg_pid = stack.postmaster_pid(tmp)
        inproc = args.server == "inprocess"
        pids = tuple(s.pid for s in servers if s.pid is not None)
        # The control plane is watched in the baselines too: idle there, but not "other".
        watch = procstat.watch_for(server_pid=(pids[0] if len(pids) == 1 else pids) if pids else None,
                                   postmaster_pid=pg_pid, in_process=inproc)
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
        work = creates.Workload(seeded.tenant_id, seeded.pool_id, f"bench-{uuid.uuid4().hex[:10]}",
                                horizon_days=args.horizon_days)
        if not args.no_baselines:
            out.echo = await phases.echo_phase(args, tmp, conninfo, watch)
            out.sql = await phases.sql_phase(args, conninfo, work, watch)
        out.pg_log_offset = diag.log_offset(out.pg_log)
        out.creates = await phases.create_phases(args, channels, seeded, work, conninfo, watch, servers, tmp, out)
        out.create = out.creates[0]
        if args.rounds > 1:
            assert out.echo and out.sql
            out.rounds.append(phases.Round(out.echo, out.sql, out.create))
            for n in range(2, args.rounds + 1):
                out.rounds.append(await phases.another_round(n, args, tmp, conninfo, channels, seeded, work, watch))
        if args.resources:
            out.hostres = await hostres.resources_phase(args, channels[0], seeded, work, conninfo, watch)
        if args.gang:
            out.gang = await gang_bench.gang_phase(args, channels[0], seeded, conninfo)
        if args.earliest:
            slot = preloaded.slot_hours if preloaded else 0.0
            out.earliest = await earliest_bench.earliest_phase(args, channels[0], seeded, conninfo, slot)
        out.states = stack.count_rows(
            conninfo,
            "SELECT state, count(*) FROM reservations WHERE tenant_id = ANY(%s) GROUP BY 1 ORDER BY 2 DESC",
            ([tenant for tenant, _ in seeded.callers],),
        )
        out.bookings = stack.count_rows(conninfo, "SELECT count(*) FROM bookings")[0][0]
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop()
    out.results = [*out.creates, *(r for r in (out.hostres, out.echo, out.sql) if r)]
    return out


def print_report(args: argparse.Namespace, conninfo: str, tmp: pathlib.Path, out: Run) -> None:
    seeded = out.seeded
    say("")
    say(machine_line(conninfo, args.server, args.fast_db))
    say(f"pool: {seeded.nodes} nodes, {seeded.gpus} GPUs, seeded in {seeded.seconds:.1f}s "
        f"({seeded.nodes / seeded.seconds:.0f} RegisterNode/s); "
        f"starts over {args.horizon_days:.0f} days, 1-8 h, 1/2/4/8 GPUs")
    say(f"placer: asked {args.placer or '(server default)'}, the pool has {seeded.placer or '(server default)'!r}"
        + (f"; Create waits up to {args.wait_ms} ms for placement" if args.wait_ms else ""))
    if len(seeded.callers) > 1:
        say(f"tenants: {len(seeded.callers)} ({seeded.tenant_id!r} owns the pool, offered to the others), "
            f"each with its own quota; create n is tenant n mod {len(seeded.callers)}'s")
    if args.placer and seeded.placer != args.placer:
        say(f"note: the server did not keep placer={args.placer!r} (a build without it): "
            "the figures are its default placer's")
    if out.preloaded:
        p = out.preloaded
        say(f"preloaded: {p.bookings} bookings in {p.reservations} reservations of tenant {p.tenant_id!r}, "
            f"{p.seconds:.1f}s; slots of {p.slot_hours:.1f} h per node, each booked {p.booked_hours:.2f} h")
        if p.slot_hours - p.booked_hours < creates.LONGEST_HOURS:
            say(f"note: the free gap between preloaded bookings ({p.slot_hours - p.booked_hours:.1f} h) is shorter "
                f"than the longest create ({creates.LONGEST_HOURS} h): some creates will be pending; "
                "more nodes or a lower --bookings-fill keep them placed")
    say(out.startup)
    blocks = [report.phase_table(out.results)]
    for res in out.creates:
        blocks.append(report.outcome_table(res))
    if out.hostres:
        blocks.append(report.outcome_table(out.hostres))
    blocks[-1] += ("\n  in the database (incl. warm-up): " + ", ".join(f"{s} {n}" for s, n in out.states)
                   + f"; {out.bookings} bookings in all")
    blocks.append(report.cpu_table(out.results))
    if out.create.name == "Reservations.Create":  # ratios of the closed loop's rate, the maximum
        blocks.append(report.ratios(out.create, out.echo, out.sql))
    if out.rounds:
        blocks.append(report.rounds_table(out.rounds))
    blocks += [pgstat.summary(stats, name=name, calls=next(r.calls for r in out.creates if r.name == name))
               for name, stats in out.statements.items()]
    blocks.append(report.server_log_summary(out.server_logs))
    blocks += [report.phase_split(name, spans) for name, spans in out.server_spans.items()]
    if args.pg_statements:
        blocks.append(diag.statement_summary(out.pg_log, out.pg_log_offset, calls=out.creates[0].calls))
    if out.profiled:
        blocks.append(diag.profile_summary(out.profiled[0], calls=out.profiled[1]))
    blocks.append(out.gang)
    blocks.append(out.earliest)
    for block in blocks:
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
        if not args.no_pg_stat:
            pgstat.enable(conninfo, plans=args.pg_plans)
            conninfo = stack.restart_database(tmp, fast=args.fast_db)
            if not pgstat.create_extension(conninfo):
                say("note: pg_stat_statements did not load: no statements per create in this run")
                args.no_pg_stat = True
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
