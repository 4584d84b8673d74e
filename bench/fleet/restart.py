"""The restart phase: with the whole fleet connected and the reservations active, stop the gateway
(SIGTERM: it closes its sessions) and start a new one on the same ports, then measure how long the
fleet takes to reconnect (every node with a session opened after the restart), and check that no
node was marked unreachable and no reservation released meanwhile. The phase holds until the new
gateway's sweeper has had its first full looks (the grace after its start, and two rounds after
the last node is back, whichever is later), so a false unreachable would show."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import psycopg

from bench.fleet.measure import mib, rss_kib
from bench.fleet.options import PROGRESS_SECONDS, say
from bench.fleet.report import log_count
from bench.fleet.start import Fleet, Run
from controlplane.devtools import devstack
from controlplane.devtools.dev import _signals_deferred

GRACE_SECONDS = 30.0  # BC_NODE_GRACE_SECONDS, the gateway's default
SWEEP_MARGIN = 12.0  # two sweeper rounds (BC_NODE_SWEEP_SECONDS, 5 s) and some

_STATE = """
SELECT count(*) FILTER (WHERE session_id IS NOT NULL AND session_started_at >= %(since)s) AS back,
       count(*) FILTER (WHERE connectivity = 'unreachable') AS unreachable
FROM nodes WHERE pool_id = %(pool)s
"""
_ACTIVE = "SELECT count(*) FROM reservations WHERE state = 'active'"
_RELEASED = "SELECT count(*) FROM events WHERE type = 'reservation.released' AND time >= %(since)s"


@dataclass
class Restart:
    seconds: float | None  # gateway stopped -> every node back (None: not within the bound)
    down_seconds: float  # SIGTERM -> the new gateway serving
    back: int
    worst_unreachable: int  # the most nodes unreachable at one poll
    unreachable_logged: int
    active_before: int
    active_after: int
    released: int
    gw_rss: int | None


def _scalar(conninfo: str, query: str, params: dict | None = None) -> int:
    with psycopg.connect(conninfo) as conn:
        return int(conn.execute(query, params or {}).fetchone()[0])


def restart_phase(args: argparse.Namespace, bench: Run, fleet: Fleet, conninfo: str) -> Restart:
    logs = bench.tmp / "logs"
    with psycopg.connect(conninfo) as conn:
        since = conn.execute("SELECT now()").fetchone()[0]
    active_before = _scalar(conninfo, _ACTIVE)
    say(f"restarting the gateway with {args.nodes} nodes connected and {active_before} reservations active")
    token = fleet.cpu.start(f"reconnect {args.nodes}")
    started = time.monotonic()
    fleet.gw.stop()
    with _signals_deferred():
        bench.processes.remove(fleet.gw)
        gw, _, _ = devstack.gateway(conninfo, logs / "gateway-restarted.log", bench.tmp / "ca-restarted.pem",
                                    listen=fleet.session_endpoint, enrol_listen=fleet.enrol_endpoint)
        bench.processes.append(gw)
    fleet.gw = gw
    fleet.cpu.watch["gateway"] = (gw.proc.pid, False)
    token[2]["gateway"] = 0.0  # the new process started inside the phase: all of its CPU counts
    down = time.monotonic() - started
    say(f"  new gateway serving {down:.1f}s after the SIGTERM")
    worst_unreachable, back, seconds = 0, 0, None
    last_progress = started
    hold_until = started + down + GRACE_SECONDS + SWEEP_MARGIN
    while True:
        with psycopg.connect(conninfo) as conn:
            row = conn.execute(_STATE, {"since": since, "pool": fleet.seeded.pool_id}).fetchone()
        back, unreachable = int(row[0]), int(row[1])
        worst_unreachable = max(worst_unreachable, unreachable)
        now = time.monotonic()
        if seconds is None and back >= args.nodes:
            seconds = now - started
            fleet.cpu.stop(token)
            # The sweeper holds while sessions wait for their hello: it looks only from now on.
            hold_until = max(hold_until, now + SWEEP_MARGIN)
            say(f"  all {args.nodes} reconnected {seconds:.1f}s after the SIGTERM; holding until the new "
                f"gateway's sweeper has looked ({GRACE_SECONDS:.0f}s grace after its start)")
        if seconds is not None and now >= hold_until:
            break
        if seconds is None and now - started > args.restart_timeout:
            fleet.cpu.stop(token)
            break
        if now - last_progress >= PROGRESS_SECONDS:
            say(f"  {now - started:5.0f}s: {back} reconnected, {unreachable} unreachable; "
                f"gateway {mib(rss_kib(gw.proc.pid))}")
            last_progress = now
        time.sleep(1.0)
    result = Restart(
        seconds=seconds, down_seconds=down, back=back, worst_unreachable=worst_unreachable,
        unreachable_logged=log_count(logs / "gateway.log", "node unreachable")
        + log_count(logs / "gateway-restarted.log", "node unreachable"),
        active_before=active_before, active_after=_scalar(conninfo, _ACTIVE),
        released=_scalar(conninfo, _RELEASED, {"since": since}), gw_rss=rss_kib(gw.proc.pid))
    say(f"  reconnect: {'all ' + str(args.nodes) if seconds is not None else f'only {back}'} back"
        + (f" in {seconds:.1f}s" if seconds is not None else f" within {args.restart_timeout:.0f}s")
        + f"; unreachable at worst {worst_unreachable}, 'node unreachable' logged {result.unreachable_logged}; "
        f"reservations active {active_before} -> {result.active_after}, released {result.released}; "
        f"new gateway {mib(result.gw_rss)}")
    if seconds is None:
        bench.problems.append(f"only {back} of {args.nodes} nodes reconnected within {args.restart_timeout:.0f}s "
                              "of the gateway restart")
    if worst_unreachable or result.unreachable_logged:
        bench.problems.append("nodes were marked unreachable across the gateway restart")
    if result.released or result.active_after < active_before:
        bench.problems.append(f"reservations released across the restart ({result.released} released, "
                              f"active {active_before} -> {result.active_after})")
    return result
