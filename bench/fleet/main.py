"""One run of the fleet benchmark: start the stack and the fleet, hold idle, run the reservations,
report, and stop every process and remove the temp dir whatever happened."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from typing import Any

from bench import diag, stack
from bench.fleet.measure import rss_kib
from bench.fleet.options import parse_args, say
from bench.fleet.report import Ending, log_count, machine_line, report
from bench.fleet.reserve import reservations_phase
from bench.fleet.restart import restart_phase
from bench.fleet.start import Run, raise_open_files, start_database, start_fleet

def run(args: argparse.Namespace, bench: Run, conninfo: str, root_token: str) -> None:
    say(machine_line(conninfo))
    fleet, enrolment = start_fleet(args, bench, conninfo, root_token)
    fleet.sample_age(conninfo)
    if not args.no_analyze:
        stack.analyze(conninfo)  # fresh planner statistics, as autovacuum would give within a minute

    say(f"holding {args.hold:g}s with the fleet connected and idle")
    token = fleet.cpu.start(f"idle {args.nodes} connected")
    hold_end = time.monotonic() + args.hold
    while time.monotonic() < hold_end:
        time.sleep(min(1.0, max(0.0, hold_end - time.monotonic())))
        fleet.sample_age(conninfo)
    fleet.cpu.stop(token)
    gw_idle = rss_kib(fleet.gw.proc.pid)

    pg_log = bench.tmp / "pgdata" / "log"
    offset = diag.log_offset(pg_log)
    if args.pg_statements:
        diag.enable_statement_log(conninfo)
    token = fleet.cpu.start(f"{args.reservations} reservations")
    try:
        lat = asyncio.run(reservations_phase(args, fleet.endpoint, conninfo, fleet.seeded))
    finally:
        if args.pg_statements:
            diag.disable_statement_log(conninfo)
    fleet.cpu.stop(token)
    fleet.worst_age = max(fleet.worst_age, lat.worst_heartbeat_age)

    gateway_log = bench.tmp / "logs" / "gateway.log"
    gw_pid = fleet.gw.proc.pid
    ending = Ending(
        final=fleet.nodes.counts(), end_age=fleet.sample_age(conninfo),
        alive={what: process.alive for process, what in fleet.processes()},
        gw_idle=gw_idle, gw_end=rss_kib(gw_pid), gw_peak=rss_kib(gw_pid, "VmHWM"), ns_end=rss_kib(fleet.ns.proc.pid),
        unreachable_logged=log_count(gateway_log, "node unreachable"),
        sessions_started=log_count(gateway_log, "session started"),
        sessions_ended=log_count(gateway_log, "session ended"))
    report(args, bench, conninfo, fleet, enrolment, lat, ending)
    if args.restart:
        say("")
        restart_phase(args, bench, fleet, conninfo)
        say("")
        say(fleet.cpu.table())
    if args.pg_statements:
        say("")
        say(diag.statement_summary(pg_log, offset, calls=len(lat.created), top=20))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    raise_open_files(args.nodes)
    tmp = stack.make_tmpdir()
    say(f"temp dir {tmp}")
    bench = Run(tmp)
    try:
        conninfo = start_database(tmp)
        root_token = stack.ensure_root(conninfo)  # migrate, then the root token
        run(args, bench, conninfo, root_token)
    except KeyboardInterrupt:
        say("interrupted: stopping")
        return 130
    except RuntimeError as exc:
        say(f"FAILED: {exc}")
        return 1
    finally:
        bench.stop()
        stack.stop_database(tmp)
        if args.keep:
            say(f"kept {tmp} (logs in {tmp / 'logs'})")
        else:
            stack.remove_tmpdir(tmp)
    for problem in bench.problems:
        say(f"FAILED: {problem}")
    return 1 if bench.problems else 0
