"""`python -m bench.fleet`: a simulated fleet against one gateway, and placement-to-active latency.

What docs/benchmarks-fleet.md describes: an embedded PostgreSQL, the control plane, one node
gateway and `nodesim --sim N` as real processes on loopback (started by controlplane.devstack, as
`make dev` and the end-to-end tests start them). The tenant, pool, quota and policy are seeded
through the Admin API; the N nodes enrol with one-time join tokens and hold mutual-TLS sessions.
Measured: the time until all N are connected, the gateway's resident memory per session, the
time from `reservation.placed` to `reservation.active` of reservations that start now (node bind
and signed report included), and whether the fleet stayed healthy throughout.

    .venv/bin/python -m bench.fleet                 # 1,000 nodes, 300 reservations (a few minutes)
    .venv/bin/python -m bench.fleet --quick         # 50 nodes, 50 reservations (about 25 s)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import resource
import signal
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# As in controlplane.dev: gRPC's fork handlers are of no use here (this process forks only to
# run pg_ctl and the children) and must be off before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402
import psycopg  # noqa: E402

from bench import diag, procstat, stack  # noqa: E402
from bench.creates import MIX, error_label  # noqa: E402
from bench.report import server_log_summary  # noqa: E402
from bettercompute.v1 import admin_pb2 as a  # noqa: E402
from bettercompute.v1 import admin_pb2_grpc, events_pb2, events_pb2_grpc, reservations_pb2_grpc  # noqa: E402
from bettercompute.v1 import reservations_pb2 as r  # noqa: E402
from controlplane import devstack  # noqa: E402
from controlplane.dev import _signals_deferred  # noqa: E402

TENANT = "fleet"
IDENTITY = "fleet-user"
POLICY = "permit(principal, action, resource);"
GPUS_PER_NODE = 8  # nodesim's default inventory: 8 x H100-SXM5-80GB on two NUMA nodes
RPC_TIMEOUT = 30.0
POLL_SECONDS = 2.0  # ListNodes of 1,000 nodes costs the control plane ~0.2 s: poll gently
QUICK_POLL_SECONDS = 0.5  # up to 100 nodes
PROGRESS_SECONDS = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, help="simulated nodes, 8 H100 each (default 1000; 50 with --quick)")
    p.add_argument("--reservations", type=int, help="reservations to create (default 300; 50 with --quick)")
    p.add_argument("--concurrency", type=int, default=8, help="Create calls in flight (default 8)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="pace the creates at this many per second (default 0: as fast as --concurrency allows)")
    p.add_argument("--connect-timeout", type=float,
                   help="seconds for the whole fleet to connect (default 60 + 0.25 s per node)")
    p.add_argument("--active-timeout", type=float, default=120.0,
                   help="seconds after the last create for every reservation to be active (default 120)")
    p.add_argument("--hold", type=float, help="idle seconds with the fleet connected, before the creates "
                   "(steady-state CPU; default 10; 3 with --quick)")
    p.add_argument("--heartbeat", type=float, default=5.0, help="nodesim heartbeat period (default 5 s)")
    p.add_argument("--connect-rate", type=float, default=100.0,
                   help="nodes nodesim starts per second (default 100, its own default)")
    p.add_argument("--no-analyze", action="store_true",
                   help="skip the ANALYZE after the fleet connected (planner statistics then lag the enrolment)")
    p.add_argument("--pg-statements", action="store_true",
                   help="diagnostic: log every SQL statement while the reservations run and print the top ones "
                   "(lock waits included; slows the run)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (database, logs, sandbox)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 50 nodes, 50 reservations, 3 s hold (flags given win)")
    args = p.parse_args(argv)
    defaults = {"nodes": 50, "reservations": 50, "hold": 3.0} if args.quick else \
               {"nodes": 1000, "reservations": 300, "hold": 10.0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.connect_timeout is None:
        args.connect_timeout = 60.0 + 0.25 * args.nodes
    if args.nodes < 1 or args.reservations < 0 or args.concurrency < 1 or args.rate < 0:
        p.error("--nodes and --concurrency must be at least 1, --reservations and --rate at least 0")
    return args


def say(text: str = "") -> None:
    print(text, flush=True)


# -- measurements of processes ---------------------------------------------------------------

def rss_kib(pid: int, field_name: str = "VmRSS") -> int | None:
    """Resident set size (or VmHWM, the peak) of a process in KiB, from /proc/<pid>/status."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


def percentile(values: list[float], q: float) -> float:
    """Nearest rank, as bench.load does."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of RSS (KiB) over connected sessions."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / var


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)


class CpuMeter:
    def __init__(self, watch: procstat.Watch) -> None:
        self.watch = watch
        self.phases: list[Phase] = []

    def start(self, name: str) -> tuple[str, float, dict[str, float]]:
        return name, time.perf_counter(), procstat.sample(self.watch)

    def stop(self, token: tuple[str, float, dict[str, float]]) -> Phase:
        name, t0, before = token
        phase = Phase(name, time.perf_counter() - t0, procstat.delta(before, procstat.sample(self.watch)))
        self.phases.append(phase)
        return phase

    def table(self) -> str:
        labels: list[str] = []
        for phase in self.phases:
            labels += [k for k in phase.cpu if k not in labels]
        head = f"{'CPU, % of one core':<24}{'secs':>7}" + "".join(f"{k:>14}" for k in labels)
        lines = [head, "-" * len(head)]
        for phase in self.phases:
            cells = "".join(f"{'-':>14}" if phase.cpu.get(k) is None
                            else f"{100 * phase.cpu[k] / max(phase.seconds, 1e-9):>13.0f}%" for k in labels)
            lines.append(f"{phase.name:<24}{phase.seconds:>7.1f}{cells}")
        return "\n".join(lines)


# -- the stack -------------------------------------------------------------------------------

@dataclass
class Seeded:
    token: str
    pool_id: str


def seed(endpoint: str, root_token: str) -> Seeded:
    """Tenant, user and token, one exclusive pool (no nodes: the fleet enrols into it), a quota
    that never binds and a permit-all policy, all through the Admin API."""
    md = (("authorization", f"Bearer {root_token}"),)
    with grpc.insecure_channel(endpoint) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        admin.CreateTenant(a.CreateTenantRequest(id=TENANT, name="Fleet benchmark"), metadata=md, timeout=RPC_TIMEOUT)
        admin.CreateIdentity(a.CreateIdentityRequest(id=IDENTITY, kind="user", name="Fleet benchmark user",
                                                     tenant_ids=[TENANT]), metadata=md, timeout=RPC_TIMEOUT)
        token = admin.CreateToken(a.CreateTokenRequest(identity_id=IDENTITY), metadata=md, timeout=RPC_TIMEOUT).secret
        admin.SetQuota(a.SetQuotaRequest(tenant_id=TENANT, resource="gpu", limit=10**12), metadata=md,
                       timeout=RPC_TIMEOUT)
        admin.PutPolicy(a.PutPolicyRequest(tenant_id=TENANT, cedar=POLICY), metadata=md, timeout=RPC_TIMEOUT)
        pool = admin.CreatePool(a.CreatePoolRequest(
            owner_tenant_id=TENANT, name="fleet-h100", region="bench-1",
            policy=a.PoolPolicy(sharing=a.SharingPolicy(mode="exclusive"))), metadata=md, timeout=RPC_TIMEOUT)
    return Seeded(token, pool.id)


def node_name(index: int, width: int) -> str:
    return f"sim-{index:0{width}d}"


class Nodes:
    """Admin.ListNodes of the pool, counted by connectivity."""

    def __init__(self, endpoint: str, root_token: str, pool_id: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.md = (("authorization", f"Bearer {root_token}"),)
        self.pool_id = pool_id

    def counts(self) -> Counter[str]:
        items = self.admin.ListNodes(a.ListNodesRequest(pool_id=self.pool_id), metadata=self.md,
                                     timeout=RPC_TIMEOUT).items
        counts: Counter[str] = Counter(n.connectivity or "unknown" for n in items)
        counts["ready"] = sum(1 for n in items if n.connectivity == "connected" and n.gpu_count == GPUS_PER_NODE)
        counts["registered"] = len(items)
        return counts

    def close(self) -> None:
        self.channel.close()


def heartbeat_age_s(conninfo: str, pool_id: str) -> float | None:
    """How long ago the least recently heard-from connected node was heard from (the gateway
    marks a node unreachable past BC_NODE_GRACE_SECONDS, 30 s by default)."""
    with psycopg.connect(conninfo) as conn:
        row = conn.execute("SELECT extract(epoch FROM now() - min(last_seen))::float FROM nodes"
                           " WHERE pool_id = %s AND connectivity = 'connected'", (pool_id,)).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def raise_open_files(nodes: int) -> None:
    """One TLS connection per node in the gateway (and nodesim): the children inherit this limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = nodes * 2 + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


# -- the reservations ------------------------------------------------------------------------

@dataclass
class Created:
    number: int
    rid: str = ""
    state: str = ""
    answered: float = 0.0  # time.monotonic() when the Create answer arrived
    seconds: float = 0.0  # the Create call's own latency


def create_request(seeded_pool: str, run_id: str, number: int) -> r.CreateReservationRequest:
    rng = random.Random(f"fleet/{number}")
    gpus = rng.choices([g for g, _ in MIX], weights=[w for _, w in MIX])[0]
    return r.CreateReservationRequest(  # no start: the window begins now
        tenant_id=TENANT, pool_id=seeded_pool, duration="1h", idempotency_key=f"{run_id}-{number:06d}",
        devices=[r.DeviceRequest(device_class="gpu", count=gpus)])


async def watch_active(endpoint: str, token: str, after_id: int, seen: dict[str, float]) -> None:
    """Events.Watch of the tenant's reservation.active events: when this client heard of each."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = events_pb2_grpc.EventsStub(channel)
        call = stub.Watch(events_pb2.WatchRequest(tenant_id=TENANT, after_id=after_id,
                                                  types=["reservation.active"]),
                          metadata=(("authorization", f"Bearer {token}"),))
        async for event in call:
            seen.setdefault(event.subject.removeprefix("reservation/"), time.monotonic())


def active_count(conninfo: str, ids: list[str]) -> int:
    with psycopg.connect(conninfo) as conn:
        return conn.execute("SELECT count(DISTINCT subject) FROM events WHERE type = 'reservation.active'"
                            " AND subject = ANY(%s)", ([f"reservation/{i}" for i in ids],)).fetchone()[0]


async def create_all(endpoint: str, token: str, pool_id: str, run_id: str, count: int,
                     concurrency: int, rate: float) -> list[Created]:
    """`count` creates, `concurrency` in flight; with `rate`, call n starts no earlier than n / rate."""
    results: list[Created] = []
    numbers = iter(range(count))
    md = (("authorization", f"Bearer {token}"),)
    started = time.monotonic()
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = reservations_pb2_grpc.ReservationsStub(channel)

        async def worker() -> None:
            for number in numbers:
                if rate:
                    await asyncio.sleep(max(0.0, started + number / rate - time.monotonic()))
                made = Created(number)
                t0 = time.monotonic()
                try:
                    reply = await stub.Create(create_request(pool_id, run_id, number), metadata=md, timeout=RPC_TIMEOUT)
                    made.rid, made.state = reply.id, reply.state or "(no state)"
                except grpc.aio.AioRpcError as exc:
                    made.state = error_label(exc)
                made.answered = time.monotonic()
                made.seconds = made.answered - t0
                results.append(made)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


@dataclass
class Latencies:
    created: list[Created]
    create_seconds: float
    active_within: int
    waited_seconds: float
    # seconds per reservation, from the commit times of the events (database clock)
    placed_active: list[float] = field(default_factory=list)
    # the same from the events' `time` column: the start of each transaction
    placed_active_starts: list[float] = field(default_factory=list)
    placed_binding: list[float] = field(default_factory=list)
    binding_report: list[float] = field(default_factory=list)
    report_active: list[float] = field(default_factory=list)
    # seconds per reservation: Create answered -> Events.Watch delivered reservation.active
    client: list[float] = field(default_factory=list)
    states: list[tuple[str, int]] = field(default_factory=list)
    # (seconds since the first placed event, placed, binding, active) per bucket
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    timeline_step: float = 1.0
    worst_heartbeat_age: float = 0.0  # seconds, sampled while the reservations ran
    other_events: list[tuple[str, int]] = field(default_factory=list)


def db_latencies(conninfo: str, ids: list[str], out: Latencies) -> None:
    subjects = [f"reservation/{i}" for i in ids]
    with psycopg.connect(conninfo) as conn:
        # Each event row's commit time (its inserting transaction's), and its `time` column:
        # compute_now() is now(), the start of that transaction. A report's commit time is lost
        # (the worker updates the row when it judges it): received_at is the start of the
        # gateway's short intake transaction.
        rows = conn.execute(
            "SELECT subject, type, extract(epoch FROM pg_xact_commit_timestamp(xmin))::float,"
            " extract(epoch FROM time)::float FROM events WHERE subject = ANY(%s) ORDER BY id", (subjects,)).fetchall()
        reports = dict(conn.execute(
            "SELECT 'reservation/' || a.reservation_id,"
            " extract(epoch FROM min(nr.received_at))::float"
            " FROM node_reports nr JOIN allocations a ON a.id = nr.allocation_id"
            " WHERE a.reservation_id = ANY(%s) AND nr.kind = 'bound' GROUP BY 1", (ids,)).fetchall())
        out.states = [tuple(x) for x in conn.execute(
            "SELECT state, count(*) FROM reservations WHERE id = ANY(%s) GROUP BY 1 ORDER BY 2 DESC", (ids,))]
    first: dict[str, dict[str, float]] = {}
    started: dict[str, dict[str, float]] = {}
    other: Counter[str] = Counter()
    for subject, type_, committed, began in rows:
        first.setdefault(subject, {}).setdefault(type_, committed)
        started.setdefault(subject, {}).setdefault(type_, began)
        if type_ not in ("reservation.placed", "reservation.binding", "reservation.active"):
            other[type_] += 1
    out.other_events = other.most_common()
    kinds = ("reservation.placed", "reservation.binding", "reservation.active")
    stamps = [(t, at) for _, t, at, _ in rows if t in kinds]
    if stamps:
        origin = min(at for _, at in stamps)
        span = max(at for _, at in stamps) - origin
        step = 1.0 if span <= 15 else 5.0 if span <= 90 else 10.0
        buckets: dict[int, Counter[str]] = {}
        for t, at in stamps:
            buckets.setdefault(int((at - origin) // step), Counter())[t] += 1
        out.timeline_step = step
        out.timeline = [(i * step, *(buckets.get(i, Counter())[k] for k in kinds))
                        for i in range(int(span // step) + 1)]
    for subject in subjects:
        times = first.get(subject, {})
        placed, binding, active = (times.get(f"reservation.{k}") for k in ("placed", "binding", "active"))
        report = reports.get(subject)
        if placed is not None and active is not None:
            out.placed_active.append(active - placed)
        began = started.get(subject, {})
        if "reservation.placed" in began and "reservation.active" in began:
            out.placed_active_starts.append(began["reservation.active"] - began["reservation.placed"])
        if placed is not None and binding is not None:
            out.placed_binding.append(binding - placed)
        if binding is not None and report is not None:
            out.binding_report.append(report - binding)
        if report is not None and active is not None:
            out.report_active.append(active - report)


async def reservations_phase(args: argparse.Namespace, endpoint: str, conninfo: str, seeded: Seeded) -> Latencies:
    with psycopg.connect(conninfo) as conn:
        after_id = conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0]
    seen: dict[str, float] = {}
    watcher = asyncio.create_task(watch_active(endpoint, seeded.token, after_id, seen))
    run_id = f"fleet-{uuid.uuid4().hex[:10]}"
    pace = f", paced at {args.rate:g}/s" if args.rate else ""
    say(f"creating {args.reservations} reservations (start now, 1 h, 1/2/4/8 GPUs), "
        f"{args.concurrency} in flight{pace}")
    t0 = time.monotonic()
    creating = asyncio.create_task(create_all(endpoint, seeded.token, seeded.pool_id, run_id, args.reservations,
                                              args.concurrency, args.rate))
    worst_age = 0.0
    while not creating.done():
        await asyncio.wait({creating}, timeout=PROGRESS_SECONDS)
        worst_age = max(worst_age, await asyncio.to_thread(heartbeat_age_s, conninfo, seeded.pool_id) or 0.0)
        if not creating.done():
            say(f"  creates: {time.monotonic() - t0:.0f}s, {len(seen)} active (seen on Watch)")
    created = creating.result()
    create_seconds = time.monotonic() - t0
    placed = [c.rid for c in created if c.rid and c.state in ("placed", "binding", "active")]
    say(f"  creates: {len(created)} answered in {create_seconds:.1f}s; waiting up to {args.active_timeout:.0f}s "
        f"for {len(placed)} to be active")
    deadline = time.monotonic() + args.active_timeout
    last_progress = time.monotonic()
    active = 0
    while True:
        active = await asyncio.to_thread(active_count, conninfo, placed)
        if active >= len(placed) or time.monotonic() >= deadline:
            break
        if time.monotonic() - last_progress >= PROGRESS_SECONDS:
            worst_age = max(worst_age, await asyncio.to_thread(heartbeat_age_s, conninfo, seeded.pool_id) or 0.0)
            say(f"  {active}/{len(placed)} active")
            last_progress = time.monotonic()
        await asyncio.sleep(0.5)
    waited = time.monotonic() - t0
    # The stream trails the commit a little: give it a moment to deliver the last events.
    settle = time.monotonic() + 5.0
    while not watcher.done() and sum(1 for i in placed if i in seen) < active and time.monotonic() < settle:
        await asyncio.sleep(0.1)
    watcher.cancel()
    (ended,) = await asyncio.gather(watcher, return_exceptions=True)
    if isinstance(ended, grpc.aio.AioRpcError):
        say(f"  note: Events.Watch failed ({ended.code().name}: {ended.details()}); the client-side row is partial")
    out = Latencies(created, create_seconds, active, waited, worst_heartbeat_age=worst_age)
    await asyncio.to_thread(db_latencies, conninfo, placed, out)
    out.client = [seen[c.rid] - c.answered for c in created if c.rid in seen]
    return out


# -- the report ------------------------------------------------------------------------------

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


# -- one run ---------------------------------------------------------------------------------

@dataclass
class Run:
    tmp: pathlib.Path
    processes: list[devstack.Process] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    nodes: Nodes | None = None  # the ListNodes channel

    def stop(self) -> None:
        if self.nodes is not None:
            self.nodes.close()
            self.nodes = None
        for process in reversed(self.processes):
            try:
                process.stop()
            except Exception as exc:  # noqa: BLE001 - stop the others anyway
                say(f"stopping {process.proc.args[:3]} failed: {exc!r}")
        self.processes.clear()


@dataclass
class Fleet:
    """The processes of one run and what the benchmark observes of them."""

    endpoint: str
    root_token: str
    seeded: Seeded
    cp: devstack.Process
    gw: devstack.Process
    ns: devstack.Process
    nodes: Nodes
    cpu: CpuMeter
    worst_age: float = 0.0  # seconds: the stalest heartbeat sampled so far

    def processes(self) -> tuple[tuple[devstack.Process, str], ...]:
        return (self.cp, "control plane"), (self.gw, "gateway"), (self.ns, "nodesim")

    def sample_age(self, conninfo: str) -> float | None:
        age = heartbeat_age_s(conninfo, self.seeded.pool_id)
        self.worst_age = max(self.worst_age, age or 0.0)
        return age


@dataclass
class Enrolment:
    token_seconds: float
    connect_seconds: float = 0.0
    first_connected: float = 0.0
    samples: list[tuple[int, int]] = field(default_factory=list)  # (connected nodes, gateway RSS KiB)
    gw_before: int | None = None
    gw_connected: int | None = None
    ns_connected: int | None = None


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


def start_fleet(args: argparse.Namespace, bench: Run, conninfo: str, root_token: str) -> tuple[Fleet, Enrolment]:
    """Control plane, gateway, seed, join tokens, then nodesim; returns once all N are connected."""
    tmp, logs = bench.tmp, bench.tmp / "logs"
    say("starting the control plane and the gateway")
    with _signals_deferred():  # a started child is recorded before Ctrl-C lands
        cp, endpoint = devstack.controlplane(conninfo, logs / "controlplane.log")
        bench.processes.append(cp)
    with _signals_deferred():
        gw, session, enrol = devstack.gateway(conninfo, logs / "gateway.log", tmp / "ca.pem")
        bench.processes.append(gw)
    seeded = seed(endpoint, root_token)
    width = max(3, len(str(args.nodes - 1)))
    t0 = time.monotonic()
    devstack.issue_join_tokens(endpoint, root_token, seeded.pool_id, [node_name(i, width) for i in range(args.nodes)],
                               tmp / "join-tokens.json")
    result = Enrolment(token_seconds=time.monotonic() - t0)
    say(f"{args.nodes} join tokens issued in {result.token_seconds:.1f}s "
        f"({args.nodes / result.token_seconds:.0f}/s)")

    time.sleep(1.0)  # let the gateway settle after start-up before taking its baseline
    result.gw_before = rss_kib(gw.proc.pid)
    say(f"starting nodesim --sim {args.nodes} (connect rate {args.connect_rate:.0f}/s, heartbeat "
        f"{args.heartbeat:g}s); waiting up to {args.connect_timeout:.0f}s for every node to connect")
    with _signals_deferred():
        ns = devstack.nodesim(args.nodes, session, enrol, tmp / "sandbox", tmp / "join-tokens.json",
                              tmp / "ca.pem", logs / "nodesim.log",
                              extra=("--heartbeat", str(args.heartbeat), "--connect-rate", str(args.connect_rate)))
        bench.processes.append(ns)
    watch: procstat.Watch = {"bench": (os.getpid(), False), "controlplane": (cp.proc.pid, False),
                             "gateway": (gw.proc.pid, False), "nodesim": (ns.proc.pid, False)}
    pg_pid = stack.postmaster_pid(tmp)
    if pg_pid is not None:
        watch["postgres"] = (pg_pid, True)
    fleet = Fleet(endpoint, root_token, seeded, cp, gw, ns, Nodes(endpoint, root_token, seeded.pool_id),
                  CpuMeter(watch))
    bench.nodes = fleet.nodes
    wait_connected(args, fleet, result)
    return fleet, result


def wait_connected(args: argparse.Namespace, fleet: Fleet, result: Enrolment) -> None:
    started = time.monotonic()
    token = fleet.cpu.start(f"enrol {args.nodes}")
    last_progress = started
    while True:
        counts = fleet.nodes.counts()
        ready, now = counts["ready"], time.monotonic()
        gw_rss = rss_kib(fleet.gw.proc.pid)
        if gw_rss is not None:
            result.samples.append((ready, gw_rss))
        if ready and not result.first_connected:
            result.first_connected = now - started
        if ready >= args.nodes:
            break
        for process, what in fleet.processes():
            if not process.alive:
                raise RuntimeError(f"the {what} exited during enrolment; see {process.log_path}")
        if now - started > args.connect_timeout:
            raise RuntimeError(f"only {ready} of {args.nodes} nodes connected in {args.connect_timeout:.0f}s "
                               f"({dict(counts)})")
        if now - last_progress >= PROGRESS_SECONDS:
            elapsed = now - started
            say(f"  {elapsed:5.0f}s: {counts['registered']} enrolled, {ready} connected ({ready / elapsed:.1f}/s); "
                f"gateway {mib(gw_rss)}, nodesim {mib(rss_kib(fleet.ns.proc.pid))}")
            last_progress = now
        time.sleep(QUICK_POLL_SECONDS if args.nodes <= 100 else POLL_SECONDS)
    result.connect_seconds = time.monotonic() - started
    fleet.cpu.stop(token)
    result.gw_connected, result.ns_connected = rss_kib(fleet.gw.proc.pid), rss_kib(fleet.ns.proc.pid)
    say(f"  all {args.nodes} connected in {result.connect_seconds:.1f}s "
        f"({args.nodes / result.connect_seconds:.1f} nodes/s)")


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
    if args.pg_statements:
        say("")
        say(diag.statement_summary(pg_log, offset, calls=len(lat.created), top=20))


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
    say(f"  oldest heartbeat at the end {ending.end_age or 0:.1f}s, worst seen {fleet.worst_age:.1f}s "
        f"(unreachable after 30s); processes alive: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in ending.alive.items()))
    say(f"  verdict: {'HEALTHY' if healthy else 'UNHEALTHY'}")
    for path in (logs / "gateway.log", logs / "controlplane.log"):
        summary = server_log_summary(path)
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


def start_database(tmp: pathlib.Path) -> str:
    """The embedded PostgreSQL with track_commit_timestamp on (it takes a restart), so every
    event's commit time can be read back: pg_xact_commit_timestamp(xmin)."""
    with _signals_deferred():
        conninfo = stack.start_database(tmp, fast=False)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET track_commit_timestamp = on")
        stack.stop_database(tmp)
        return stack.start_database(tmp, fast=False)


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


if __name__ == "__main__":
    sys.exit(main())
