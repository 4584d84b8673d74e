"""The printed figures: enrolment, memory, placement to active, CPU, and the fleet's health."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
from collections import Counter
from dataclasses import dataclass

import grpc
import psycopg

from bench.fleet import stages
from bench.fleet.measure import mib, percentile, slope
from bench.fleet.options import say
from bench.fleet.reserve import Latencies
from bench.fleet.start import Enrolment, Fleet, Run
from bench.report import server_log_summary

@dataclass
class Ending:
    final: Counter[str]
    end_age: float | None
    alive: dict[str, bool]
    gw_idle: int | None
    gw_end: int | None
    gw_peak: int | None
    ns_end: int | None
    unreachable_logged: int
    sessions_started: int
    sessions_ended: int

    def healthy(self, nodes: int) -> bool:
        return (self.final["ready"] == nodes and self.final.get("unreachable", 0) == 0
                and all(self.alive.values()) and self.unreachable_logged == 0)


def latency_table(lat: Latencies) -> str:
    head = f"{'seconds':<44}{'n':>6}{'p50':>8}{'p95':>8}{'p99':>8}{'max':>8}"
    lines = [head, "-" * len(head)]

    def row(label: str, values: list[float]) -> None:
        if not values:
            lines.append(f"{label:<44}{0:>6}{'-':>8}{'-':>8}{'-':>8}{'-':>8}")
            return
        lines.append(f"{label:<44}{len(values):>6}{percentile(values, 50):>8.2f}{percentile(values, 95):>8.2f}"
                     f"{percentile(values, 99):>8.2f}{max(values):>8.2f}")

    row("placed -> active (commit times)", lat.placed_active)
    row("  placed -> binding (worker starts it)", lat.placed_binding)
    row("  binding -> bound report stored (push, node)", lat.binding_report)
    row("  report stored -> active (worker verifies)", lat.report_active)
    row("placed -> active (events.time: tx starts)", lat.placed_active_starts)
    row("Create answered -> active seen on Watch", lat.client)
    row("Create call (client)", [c.seconds for c in lat.created])
    return "\n".join(lines)


def timeline_table(lat: Latencies) -> str:
    """Lifecycle events per time bucket (database clock): does activation keep up with placement?"""
    head = f"{'events, from the first placed':<32}{'placed':>8}{'binding':>9}{'active':>8}"
    lines = [head, "-" * len(head)]
    for start, placed, binding, active in lat.timeline:
        label = f"{start:5.0f}-{start + lat.timeline_step:.0f}s"
        lines.append(f"{label:<32}{placed:>8}{binding:>9}{active:>8}")
    return "\n".join(lines)


def machine_line(conninfo: str) -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        pass
    with psycopg.connect(conninfo) as conn:
        pg = conn.execute("SELECT current_setting('server_version')").fetchone()[0]
    return (f"machine: {os.cpu_count()} cores {model}; Python {platform.python_version()}, grpcio {grpc.__version__}, "
            f"PostgreSQL {pg} (embedded)")


def nodesim_connected_seconds(path: pathlib.Path) -> float | None:
    """nodesim's own measure: from its start until every node had a session up at once."""
    try:
        with path.open(errors="replace") as handle:
            for line in handle:
                if "all nodes connected" in line:
                    try:
                        return float(json.loads(line)["seconds"])
                    except (ValueError, KeyError, TypeError):
                        continue
    except OSError:
        return None
    return None


def log_count(path: pathlib.Path, event: str) -> int:
    count = 0
    try:
        with path.open(errors="replace") as handle:
            for line in handle:
                if event in line:
                    try:
                        if json.loads(line).get("event") == event:
                            count += 1
                    except ValueError:
                        continue
    except OSError:
        return 0
    return count


def report(args: argparse.Namespace, bench: Run, conninfo: str, fleet: Fleet, enrolment: Enrolment,
           lat: Latencies, ending: Ending) -> None:
    logs, n = bench.tmp / "logs", args.nodes
    placed = [c for c in lat.created if c.rid and c.state in ("placed", "binding", "active")]
    say("")
    say(machine_line(conninfo))
    say(f"fleet: nodesim --sim {n} (8 x H100-SXM5-80GB each, heartbeat {args.heartbeat:g}s), "
        f"one gateway, one control plane; reservations: {args.reservations}, {args.concurrency} in flight"
        + (f", paced at {args.rate:g}/s" if args.rate else ""))
    say("")
    say("enrolment")
    say(f"  join tokens (NodeAdmin.CreateJoinToken, one at a time)  {n} in {enrolment.token_seconds:.1f}s "
        f"({n / enrolment.token_seconds:.0f}/s)")
    say(f"  nodesim start -> all {n} connected (ListNodes)  {enrolment.connect_seconds:.1f}s "
        f"({n / enrolment.connect_seconds:.1f} nodes/s; first after {enrolment.first_connected:.1f}s)")
    own = nodesim_connected_seconds(logs / "nodesim.log")
    if own is not None:
        say(f"  the same, as nodesim counts it (sessions up)        {own:.1f}s ({n / own:.1f} nodes/s)")
    say("")
    before, connected = enrolment.gw_before, enrolment.gw_connected
    per_session = None if before is None or connected is None else (connected - before) / n
    marginal = slope([(x, y) for x, y in enrolment.samples if x >= max(1, n // 10)])
    say("memory (VmRSS)")
    say(f"  gateway  before nodes {mib(before)}, all connected {mib(connected)}, after the idle hold "
        f"{mib(ending.gw_idle)}, at the end {mib(ending.gw_end)}, peak {mib(ending.gw_peak)}")
    say(f"  gateway per session: {'-' if per_session is None else f'{per_session:.1f} KiB'} "
        f"((all connected - before) / {n}); marginal "
        f"{'-' if marginal is None else f'{marginal:.1f} KiB'} (slope of RSS over connected sessions)")
    say(f"  nodesim  all connected {mib(enrolment.ns_connected)} ({(enrolment.ns_connected or 0) / n:.0f} KiB "
        f"per node), at the end {mib(ending.ns_end)}")
    say("")
    say(f"placement -> active: {len(placed)} placed of {len(lat.created)} creates "
        f"({lat.create_seconds:.1f}s, {len(lat.created) / max(lat.create_seconds, 1e-9):.1f}/s); "
        f"{lat.active_within}/{len(placed)} active within {lat.waited_seconds:.1f}s of the first create")
    outcomes = Counter(c.state for c in lat.created)
    say("  Create answers: " + ", ".join(f"{k} {count}" for k, count in outcomes.most_common()))
    say("  in the database: " + ", ".join(f"{s} {count}" for s, count in lat.states)
        + (("; other events: " + ", ".join(f"{t} {count}" for t, count in lat.other_events))
           if lat.other_events else ""))
    say(latency_table(lat))
    say(stages.table(stages.collect(logs, stages.Window(lat.began_at, lat.ended_at))))
    say("")
    say(timeline_table(lat))
    say("")
    say(fleet.cpu.table())
    say("")
    final = ending.final
    healthy = ending.healthy(n)
    say(f"fleet health at the end: {final['ready']}/{n} connected with 8 GPUs, {final.get('unreachable', 0)} "
        f"unreachable; 'node unreachable' in the gateway log: {ending.unreachable_logged}; "
        f"sessions started {ending.sessions_started}, ended {ending.sessions_ended}")
    say(f"  oldest stored last_seen at the end {ending.end_age or 0:.1f}s, worst seen {fleet.worst_age:.1f}s "
        f"(it trails the last heartbeat by up to 7.5s + a 5s sweep round; unreachable after 30s); processes alive: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in ending.alive.items()))
    say(f"  verdict: {'HEALTHY' if healthy else 'UNHEALTHY'}")
    for path in (logs / "gateway.log", logs / "controlplane.log"):
        summary = server_log_summary([path])
        if summary:
            say("")
            say(summary)
    if not healthy:
        bench.problems.append("the fleet did not stay healthy")
    if lat.active_within < len(placed):
        bench.problems.append(f"only {lat.active_within} of {len(placed)} reservations became active "
                              f"within {args.active_timeout:.0f}s of the last create")
    if len(placed) < len(lat.created):
        bench.problems.append(f"{len(lat.created) - len(placed)} creates were not placed")
