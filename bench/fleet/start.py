"""The stack and the enrolment: the database, control plane and gateway as processes, the seed
through the Admin API, join tokens, then `nodesim --sim N` until every node is connected."""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import psycopg

from bench import procstat, stack
from bench.fleet.measure import CpuMeter, mib, rss_kib
from bench.fleet.options import (
    GPUS_PER_NODE,
    IDENTITY,
    POLICY,
    POLL_SECONDS,
    POLL_SECONDS_PER_1000,
    PROGRESS_SECONDS,
    QUICK_POLL_SECONDS,
    RPC_TIMEOUT,
    TENANT,
    say,
)
from bettercompute.v1 import admin_pb2 as a
from bettercompute.v1 import admin_pb2_grpc
from controlplane.devtools import devstack
from controlplane.devtools.dev import _signals_deferred

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
    session_endpoint: str = ""  # the gateway's ports, kept across its restart
    enrol_endpoint: str = ""
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
                  CpuMeter(watch), session, enrol)
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
        time.sleep(QUICK_POLL_SECONDS if args.nodes <= 100
                   else max(POLL_SECONDS, POLL_SECONDS_PER_1000 * args.nodes / 1000))
    result.connect_seconds = time.monotonic() - started
    fleet.cpu.stop(token)
    result.gw_connected, result.ns_connected = rss_kib(fleet.gw.proc.pid), rss_kib(fleet.ns.proc.pid)
    say(f"  all {args.nodes} connected in {result.connect_seconds:.1f}s "
        f"({args.nodes / result.connect_seconds:.1f} nodes/s)")


def start_database(tmp: pathlib.Path) -> str:
    """The embedded PostgreSQL with track_commit_timestamp on (it takes a restart), so every
    event's commit time can be read back: pg_xact_commit_timestamp(xmin)."""
    with _signals_deferred():
        conninfo = stack.start_database(tmp, fast=False)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET track_commit_timestamp = on")
        stack.stop_database(tmp)
        return stack.start_database(tmp, fast=False)
