"""Chaos under mixed load (a hostile review of the reservation engine): one tenant with an inline
pool and a lease pool of host-resource nodes, and in parallel threads creates of every shape
(single GPUs, NVLink groups, gangs, host resources, calendar starts, renewable leases), retries of
the same idempotency key with the same and with another request, extends, renews, releases and
cancels, node-signed bind reports, and the node side through the operator's and the node's paths
(unreachable and back, a GPU unhealthy and healthy, cordon and ready, certificates revoked then
readmitted and enrolled again, an inventory without some GPUs and with them again), the clock
moved forward, and the reservation worker drained from a thread of its own beside the server's.

After each round, once the workers have settled: the SQL invariants (tests/invariants.py), nothing
stuck past what the spec allows, every state an answer showed has its event, no call answered
INTERNAL (or anything the operation does not allow) and no "rpc failed" or failed work item in
the log. The scenario is seeded: a failure prints its seed, and BC_CHAOS_SEED=<seed> runs that
seed again (the thread interleaving is the machine's). BC_CHAOS_SECONDS runs seeds for longer.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import nodes_pb2_grpc as npb_grpc
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.app import WORK_HANDLERS
from controlplane.nodes import inventory
from controlplane.nodes import reports as node_reports
from controlplane.reservations import schedule, states
from controlplane.workers import pending, queue
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, make_world
from tests.test_concurrency import outcome
from tests.test_pki import Enrolled, arun, enrol, sign

LIMITS_LABEL = "bc.dev/cap.devices.limits"
GIB = 1 << 30
MIN = 60_000
HOUR = 60 * MIN
NODES_PER_POOL = 4
GPUS_PER_NODE = 8
# A long hunt may raise these (BC_CHAOS_OPS, BC_CHAOS_THREADS); the defaults fit the suite's minute.
ROUND_OPS = int(os.environ.get("BC_CHAOS_OPS", 60))
THREADS = int(os.environ.get("BC_CHAOS_THREADS", 6))
ROUNDS = 3


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True, pending_retry_seconds=2, placer_lease_seconds=1.5,
                            placer_batch=8)


def short(reply: Any) -> str:
    if isinstance(reply, pb.Reservation):
        return f"{reply.id} {reply.state}"
    return str(reply)[:300]


# -- the fleet ------------------------------------------------------------------------------------


def node_gpus(name: str, keep: frozenset[int] | None = None) -> list[node_pb2.Gpu]:
    """Eight GPUs on two NUMA nodes and two NVLink cliques of four, as bcd reports them."""
    return [node_pb2.Gpu(uuid=f"GPU-{name}-{i}", model="H100-SXM5-80GB", memory_mib=81559, numa_node=i // 4,
                         nvlink_cluster=f"c-{name}", nvlink_clique=str(i // 4))
            for i in range(GPUS_PER_NODE) if keep is None or i in keep]


def node_inventory(name: str, generation: int, keep: frozenset[int] | None = None) -> node_pb2.Inventory:
    return node_pb2.Inventory(
        generation=generation, gpus=node_gpus(name, keep), vcpus=64, memory_bytes=512 * GIB, hugepages_1gi=16,
        numa_nodes=[node_pb2.NumaNode(id=0, cpulist="0-31", memory_bytes=256 * GIB),
                    node_pb2.NumaNode(id=1, cpulist="32-63", memory_bytes=256 * GIB)])


@dataclass
class FleetNode:
    id: str
    name: str
    pool_id: str
    generation: int = 1
    enrolled: Enrolled | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)  # one operator change at a time


class Fleet:
    """The tenant's two pools and their nodes, and the node side: signed reports, inventories,
    revocations, all through the paths the gateway and the operator use."""

    def __init__(self, server: ServerThread, w: World) -> None:
        self.server, self.w = server, w
        self.pools = {"inline": w.pool_id}
        self.pools["lease"] = w.root.admin("CreatePool", apb.CreatePoolRequest(
            owner_tenant_id=w.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
        self.nodes: list[FleetNode] = []
        self.sequence = 0
        self.seq_lock = threading.Lock()
        for kind, pool_id in self.pools.items():
            for i in range(NODES_PER_POOL):
                name = f"{kind[0]}{i}-{w.tenant[-6:]}"
                node = w.root.admin("RegisterNode", apb.RegisterNodeRequest(
                    pool_id=pool_id, name=name, labels={"rack": f"r{i % 2}"}, system_labels={LIMITS_LABEL: "true"},
                    gpus=[apb.Gpu(uuid=g.uuid, model=g.model, memory_mib=g.memory_mib, numa_node=g.numa_node,
                                  nvlink_domain=f"{g.nvlink_cluster}/{g.nvlink_clique}") for g in node_gpus(name)]))
                fn = FleetNode(node.id, name, pool_id)
                self.nodes.append(fn)
                fn.enrolled = enrol(w.conninfo, pool_id, name)
                arun(w.conninfo, lambda pool, fn=fn: inventory.apply_inventory(
                    pool, fn.id, node_inventory(fn.name, fn.generation)))
                self.connectivity(fn, "connected")
        server.call(server.app.runtime.capacity.barrier())
        self.node_admin = npb_grpc.NodeAdminStub(w.root.channel)

    def connectivity(self, node: FleetNode, value: str) -> tuple[str, Any]:
        return outcome(lambda: self.w.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(
            node_id=node.id, connectivity=value)))

    def report(self, node: FleetNode, allocation_id: str, kind: str, devices: list[str]) -> str:
        """A node-signed report about the allocation, taken in by the gateway's intake."""
        if node.enrolled is None:
            return "unenrolled"
        with self.seq_lock:
            self.sequence = max(self.sequence + 1, int(time.time() * 1000))
            sequence = self.sequence
        body = node_pb2.Report(node_id=node.id, sequence=sequence, time=int(time.time() * 1000))
        if kind == "bound":
            body.bound.CopyFrom(node_pb2.AllocationBound(allocation_id=allocation_id,
                                                         cdi_devices=[f"bcd.dev/gpu={d}" for d in devices]))
        elif kind == "released":
            body.released.CopyFrom(node_pb2.AllocationReleased(allocation_id=allocation_id, reason="unassigned"))
        else:
            body.failed.CopyFrom(node_pb2.AllocationFailed(allocation_id=allocation_id, reason="device-missing"))
        raw = body.SerializeToString()
        keys = node.enrolled.keys
        attested = node_pb2.AttestedReport(body=raw, key_id=node.enrolled.key_id,
                                           signature=sign(keys.signing, raw))
        ack = arun(self.w.conninfo, lambda pool: node_reports.intake(pool, node.id, attested))
        return node_pb2.ReportOutcome.Name(ack.outcome).removeprefix("REPORT_").lower()

    def apply(self, node: FleetNode, keep: frozenset[int] | None) -> None:
        with node.lock:
            node.generation += 1
            inv = node_inventory(node.name, node.generation, keep)
            arun(self.w.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, inv))

    def revoke(self, node: FleetNode) -> tuple[str, Any]:
        return outcome(lambda: self.node_admin.RevokeCertificates(
            npb.RevokeCertificatesRequest(node_id=node.id, reason="chaos"), metadata=self.w.root.metadata))

    def readmit(self, node: FleetNode) -> tuple[str, Any]:
        """Readmit, enrol again with a fresh join token and be heard from: back in service."""
        code, reply = outcome(lambda: self.node_admin.ReadmitNode(
            npb.ReadmitNodeRequest(node_id=node.id), metadata=self.w.root.metadata))
        if code != "ok":
            return code, reply
        with node.lock:
            node.enrolled = enrol(self.w.conninfo, node.pool_id, node.name)
        return self.connectivity(node, "connected")


# -- the scenario ---------------------------------------------------------------------------------

# What each operation may answer; anything else (INTERNAL above all) is a finding.
ALLOWED = {
    "create": {"ok", "QUOTA_EXCEEDED"},
    "create-retry": {"ok", "QUOTA_EXCEEDED"},
    "create-conflict": {"CONFLICT"},
    "twin": {"ok", "QUOTA_EXCEEDED", "CONFLICT"},
    "extend": {"ok", "INVALID_STATE", "CONFLICT", "QUOTA_EXCEEDED", "NOT_FOUND"},
    "extend-retry": {"ok", "INVALID_STATE", "CONFLICT", "QUOTA_EXCEEDED", "NOT_FOUND"},
    "renew": {"ok", "INVALID_STATE", "NOT_FOUND"},
    "release": {"ok", "NOT_FOUND"},
    "cancel": {"ok", "INVALID_STATE", "NOT_FOUND"},
    "node": {"ok", "INVALID_STATE"},
}


@dataclass
class Shape:
    pool: str
    count: int
    topology: str = ""
    gang: int = 0
    gang_key: str = ""
    vcpu: int | None = None
    memory: int | None = None
    start_in: int | None = None
    duration: str = "1h"
    lease: int | None = None


class Scenario:
    def __init__(self, seed: int, server: ServerThread) -> None:
        self.seed = seed
        self.server = server
        # A root token of its own: each seed moves the clock more than a day, past earlier tokens.
        root = Client(server.endpoint, bootstrap.ensure_root(server.conninfo))
        self.w = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=56)
        self.w.quota(2000, "vcpu")
        self.w.quota(20000, "memoryGiB")
        self.fleet = Fleet(server, self.w)
        self.lock = threading.Lock()
        self.keys: dict[str, tuple[Shape, int | None]] = {}  # key -> shape and absolute start
        self.ids: set[str] = set()
        self.leased: set[str] = set()
        self.first_ids: dict[str, str] = {}
        self.seen: dict[str, set[str]] = defaultdict(set)  # reservation -> states answered
        self.extend_keys: list[tuple[str, str, str]] = []
        self.findings: list[str] = []
        self.stats: dict[str, int] = defaultdict(int)
        self.node_flags: dict[tuple[str, str], bool] = {}

    # what the threads do

    def shape(self, r: random.Random) -> Shape:
        pool = r.choice(["inline", "lease"])
        kind = r.choice(["single", "nvlink", "gang", "host", "calendar", "lease", "single", "nvlink"])
        s = Shape(pool=pool, count=1, duration=r.choice(["20m", "1h", "2h", "4h"]))
        if kind == "nvlink":
            s.count, s.topology = r.choice([2, 4]), "nvlink-all"
        elif kind == "gang":
            s.count, s.gang, s.gang_key = r.choice([2, 4, 8]), 2, r.choice(["", "rack"])
        elif kind == "host":
            s.count, s.vcpu, s.memory = r.choice([1, 2]), r.choice([8, 16, 24]), r.choice([64, 128])
        elif kind == "lease":
            s.count, s.lease = r.choice([1, 2]), r.choice([60, 300, 900])
        if kind == "calendar" or r.random() < 0.3:
            s.start_in = r.choice([10, 20, 45, 90, 180]) * MIN
        return s

    def request(self, key: str, s: Shape, start: int | None, r: random.Random) -> pb.CreateReservationRequest:
        kw: dict[str, Any] = {"pool_id": self.fleet.pools[s.pool]}
        if start is not None:
            kw["start"] = start
        if s.gang:
            kw["gang"] = pb.Gang(size=s.gang, topology_key=s.gang_key)
        if s.vcpu is not None:
            kw["resources"] = pb.HostResources(vcpu=s.vcpu, memory_gib=s.memory)
        if s.lease is not None:
            kw["lease_seconds"] = s.lease
        if s.pool == "lease" and r.random() < 0.5:
            kw["wait"] = pb.Wait(timeout_ms=3000)
        return self.w.create_request(key=key, count=s.count, topology=s.topology, duration=s.duration, **kw)

    def note(self, kind: str, code: str, reply: Any, what: Any) -> None:
        with self.lock:
            self.stats[f"{kind}:{code}"] += 1
            if code not in ALLOWED[kind]:
                self.findings.append(f"{kind} answered {code}: {short(reply)} ({what})")
            if code == "ok":
                r = getattr(reply, "reservation", reply)
                if isinstance(r, pb.Reservation) and r.id:
                    self.seen[r.id].add(r.state)

    def now(self) -> int:
        return self.w.sql("SELECT epoch_ms(compute_now())")[0][0]

    def op_create(self, r: random.Random) -> None:
        with self.lock:
            known = sorted(self.keys)
        if known and r.random() < 0.25:
            key = r.choice(known)
            s, start = self.keys[key]
            if r.random() < 0.2:  # the same key for another request
                other = Shape(**{**s.__dict__, "count": s.count % 2 + 1 if not s.gang else s.count})
                other.duration = "3h" if s.duration != "3h" else "5h"
                code, reply = outcome(lambda: self.w.user.res("Create", self.request(key, other, start, r)))
                self.note("create-conflict", code, reply, (key, other))
                return
            code, reply = outcome(lambda: self.w.user.res("Create", self.request(key, s, start, r)))
            self.note("create-retry", code, reply, (key, s))
            if code == "ok":
                with self.lock:
                    first = self.first_ids.setdefault(key, reply.id)
                    if first != reply.id:
                        self.findings.append(f"key {key} answered {reply.id}, before {first}")
            return
        key = f"k{self.seed}-{uuid.uuid4().hex[:8]}"
        s = self.shape(r)
        start = None if s.start_in is None else self.now() + s.start_in
        code, reply = outcome(lambda: self.w.user.res("Create", self.request(key, s, start, r)))
        self.note("create", code, reply, (key, s))
        with self.lock:  # known to the other threads once answered: a retry comes after the first call
            self.keys[key] = (s, start)
            if code == "ok":
                self.ids.add(reply.id)
                first = self.first_ids.setdefault(key, reply.id)
                if first != reply.id:
                    self.findings.append(f"key {key} answered {reply.id}, before {first}")
                if s.lease is not None:
                    self.leased.add(reply.id)

    def pick(self, r: random.Random) -> str | None:
        with self.lock:
            ids = sorted(self.ids)
        return r.choice(ids) if ids else None

    def op_extend(self, r: random.Random) -> None:
        with self.lock:
            earlier = list(self.extend_keys)
        if earlier and r.random() < 0.3:
            rid, key, by = r.choice(earlier)
            kind = "extend-retry"
        else:
            rid, key, by, kind = self.pick(r), f"x{uuid.uuid4().hex[:8]}", r.choice(["15m", "30m", "1h"]), "extend"
            if rid is None:
                return
            with self.lock:
                self.extend_keys.append((rid, key, by))
        code, reply = outcome(lambda: self.w.user.res("Extend", pb.ExtendReservationRequest(
            tenant_id=self.w.tenant, reservation_id=rid, by=by, idempotency_key=key)))
        self.note(kind, code, reply, (rid, key, by))

    def op_simple(self, r: random.Random, kind: str) -> None:
        with self.lock:
            leased = sorted(self.leased)
        rid = r.choice(leased) if kind == "renew" and leased and r.random() < 0.8 else self.pick(r)
        if rid is None:
            return
        method, message = {"renew": ("Renew", pb.RenewReservationRequest),
                           "release": ("Release", pb.ReleaseReservationRequest),
                           "cancel": ("Cancel", pb.CancelReservationRequest)}[kind]
        code, reply = outcome(lambda: self.w.user.res(method, message(tenant_id=self.w.tenant, reservation_id=rid)))
        self.note(kind, code, reply, rid)

    def op_node(self, r: random.Random) -> None:
        node = r.choice(self.fleet.nodes)
        with node.lock:
            self._node_change(r, node)

    def _node_change(self, r: random.Random, node: FleetNode) -> None:
        what = r.choice(["reach", "health", "cordon", "revoke", "inventory"])
        flag = (node.id, what)
        with self.lock:
            on = self.node_flags.get(flag, False)
            self.node_flags[flag] = not on
        w = self.w
        if what == "reach":
            code, reply = self.fleet.connectivity(node, "connected" if on else "unreachable")
        elif what == "health":
            code, reply = outcome(lambda: w.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(
                node_id=node.id, device_uuid=f"GPU-{node.name}-{r.randrange(GPUS_PER_NODE)}",
                health="healthy" if on else "unhealthy")))
            if code == "NOT_FOUND" and reply.get("deviceUuid"):  # gone from the node's inventory
                code = "ok"
            if on:  # restore every GPU of the node
                for i in range(GPUS_PER_NODE):
                    outcome(lambda i=i: w.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(
                        node_id=node.id, device_uuid=f"GPU-{node.name}-{i}", health="healthy")))
        elif what == "cordon":
            code, reply = outcome(lambda: w.root.admin("SetNodeState", apb.SetNodeStateRequest(
                node_id=node.id, state="ready" if on else "cordoned")))
        elif what == "revoke":
            code, reply = self.fleet.readmit(node) if on else self.fleet.revoke(node)
        else:
            keep = None if on else frozenset(r.sample(range(GPUS_PER_NODE), GPUS_PER_NODE - r.choice([1, 2])))
            try:
                self.fleet.apply(node, keep)
                code, reply = "ok", None
            except Exception as exc:  # noqa: BLE001 - a finding, reported with the others
                code, reply = f"raised:{type(exc).__name__}", str(exc)
        self.note("node", code, reply, (node.name, what, "back" if on else "away"))

    def op_report(self, r: random.Random) -> None:
        rows = self.w.sql(
            "SELECT a.id, a.node_id, a.state, a.device_ids FROM allocations a JOIN reservations res ON res.id = a.reservation_id"
            " WHERE res.tenant_id = %s AND a.state IN ('binding', 'bound') ORDER BY a.id", (self.w.tenant,))
        if not rows:
            return
        alloc, node_id, state, devices = r.choice(rows)
        node = next(n for n in self.fleet.nodes if n.id == node_id)
        kind = "bound" if state == "binding" and r.random() < 0.85 else r.choice(["failed", "released", "bound"])
        try:
            verdict = self.fleet.report(node, alloc, kind, devices)
        except Exception as exc:  # noqa: BLE001
            verdict = f"raised:{type(exc).__name__}:{exc}"
            with self.lock:
                self.findings.append(f"report {kind} on {alloc}: {verdict}")
        with self.lock:
            self.stats[f"report:{kind}:{verdict}"] += 1

    def op_advance(self, r: random.Random) -> None:
        code, reply = outcome(lambda: self.w.root.admin("AdvanceClock", apb.AdvanceClockRequest(
            by_ms=r.choice([1, 3, 6, 11, 16]) * MIN)))
        self.note("node", code, reply, "advance")

    def op_twins(self, r: random.Random) -> None:
        """One fresh key sent three times at once (twins race through admission), one of them
        now and then for another request: one reservation, the same to every twin that got one."""
        key = f"t{self.seed}-{uuid.uuid4().hex[:8]}"
        s = self.shape(r)
        start = None if s.start_in is None else self.now() + s.start_in
        other = Shape(**{**s.__dict__, "duration": "5h"}) if r.random() < 0.3 else None
        shapes = [s, s, other or s]
        barrier = threading.Barrier(3)

        def send(shape: Shape) -> tuple[str, Any]:
            request = self.request(key, shape, start, random.Random(r.random()))
            barrier.wait(10)
            return outcome(lambda: self.w.user.res("Create", request))

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(send, shapes))
        ids = {reply.id for code, reply in answers if code == "ok"}
        for shape, (code, reply) in zip(shapes, answers):
            self.note("twin", code, reply, (key, shape))
        codes = [code for code, _ in answers]
        with self.lock:
            if len(ids) > 1:
                self.findings.append(f"twins of {key} answered several reservations: {ids}")
            if other is None and len(set(codes)) > 1 and "QUOTA_EXCEEDED" not in codes:
                self.findings.append(f"twins of {key} with one request answered differently: {codes}")
            if other is not None and codes.count("CONFLICT") > 2:
                self.findings.append(f"twins of {key}: every one CONFLICT: {codes}")
            if ids:
                self.ids |= ids
                self.first_ids.setdefault(key, next(iter(ids)))
                if other is None:  # else the request that won is not known here
                    self.keys[key] = (s, start)

    def op_node_of_booked(self, r: random.Random) -> None:
        """A node change on a node that holds live allocations (the ones that matter)."""
        rows = self.w.sql(
            "SELECT DISTINCT a.node_id FROM allocations a JOIN reservations res ON res.id = a.reservation_id"
            " WHERE res.tenant_id = %s AND a.state IN ('placed', 'binding', 'bound') ORDER BY 1", (self.w.tenant,))
        if not rows:
            return
        node_id = r.choice(rows)[0]
        node = next(n for n in self.fleet.nodes if n.id == node_id)
        with node.lock:
            self._node_change(r, node)

    OPS = (["create"] * 10 + ["twins"] * 2 + ["extend"] * 2 + ["renew"] + ["release"] * 2 + ["cancel"]
           + ["node"] * 2 + ["node-booked"] * 2 + ["report"] * 3 + ["advance"])

    def run_op(self, i: int, round_no: int) -> None:
        r = random.Random(f"{self.seed}/{round_no}/{i}")
        kind = r.choice(self.OPS)
        if kind == "create":
            self.op_create(r)
        elif kind == "extend":
            self.op_extend(r)
        elif kind in ("renew", "release", "cancel"):
            self.op_simple(r, kind)
        elif kind == "node":
            self.op_node(r)
        elif kind == "report":
            self.op_report(r)
        elif kind == "twins":
            self.op_twins(r)
        elif kind == "node-booked":
            self.op_node_of_booked(r)
        else:
            self.op_advance(r)

    # a round

    def round(self, round_no: int) -> None:
        stop = threading.Event()

        def drainer() -> None:  # the reservation worker, beside the server's own runners
            while not stop.is_set():
                try:
                    if not self.server.call(queue.run_one(self.server.app.runtime, WORK_HANDLERS)):
                        time.sleep(0.01)
                except Exception as exc:  # noqa: BLE001
                    with self.lock:
                        self.findings.append(f"drain raised {type(exc).__name__}: {exc}")

        def sampler() -> None:  # every committed state someone could read must have its event
            with psycopg.connect(self.w.conninfo, autocommit=True) as conn:
                while not stop.is_set():
                    rows = conn.execute("SELECT id, state FROM reservations WHERE tenant_id = %s",
                                        (self.w.tenant,)).fetchall()
                    with self.lock:
                        for rid, state in rows:
                            self.seen[rid].add(state)
                    time.sleep(0.02)

        extra = threading.Thread(target=drainer, daemon=True)
        extra.start()
        watcher = threading.Thread(target=sampler, daemon=True)
        watcher.start()
        try:
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(lambda i: self.run_op(i, round_no), range(ROUND_OPS)))
        finally:
            stop.set()
            extra.join(30)
            watcher.join(30)
        now = self.settle()
        self.drained_since()  # a pending retry or a create that began before committed after it:
        self.settle()         # their wake-ups were not there to count
        self.check(now)

    def settle(self, seconds: float = 60) -> int:
        """Wait until the workers took every due wake-up and the lease holder every queued create;
        the moment (compute_now()) they had: every deadline up to it has been acted on."""
        deadline = time.monotonic() + seconds
        while True:
            now, due, queued = self.w.sql(
                "SELECT epoch_ms(compute_now()), (SELECT count(*) FROM work_items WHERE kind = 'reservation' AND run_at <= compute_now()"
                "        AND subject IN (SELECT id FROM reservations WHERE tenant_id = %(t)s)),"
                "       (SELECT count(*) FROM reservations WHERE tenant_id = %(t)s AND state = 'queued')",
                {"t": self.w.tenant})[0]
            if due == 0 and queued == 0:
                return now
            if time.monotonic() > deadline:
                self.findings.append(f"not settled after {seconds} s: {due} due wake-ups, {queued} queued")
                return now
            time.sleep(0.05)

    def finish(self) -> None:
        """Past every end: everything booked then comes to rest, and the invariants still hold."""
        code, reply = outcome(lambda: self.w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=30 * HOUR)))
        self.note("node", code, reply, "advance past every end")
        now = self.settle()
        self.drained_since()
        self.settle()
        self.check(now)  # a pending one may be placed from now on: the STUCK query judges the rest
        self.restore()
        self.settle()
        self.pending_that_fit()

    def restore(self) -> None:
        """Every node back: readmitted, connected, ready, healthy, its whole inventory."""
        w = self.w
        for node in self.fleet.nodes:
            with node.lock:
                if self.node_flags.get((node.id, "revoke")):
                    self.note("node", *self.fleet.readmit(node), (node.name, "restore"))
                self.note("node", *self.fleet.connectivity(node, "connected"), (node.name, "restore"))
                self.note("node", *outcome(lambda node=node: w.root.admin("SetNodeState", apb.SetNodeStateRequest(
                    node_id=node.id, state="ready"))), (node.name, "restore"))
                self.fleet.apply(node, None)
                for i in range(GPUS_PER_NODE):
                    self.note("node", *outcome(lambda i=i, node=node: w.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(
                        node_id=node.id, device_uuid=f"GPU-{node.name}-{i}", health="healthy"))), (node.name, "restore"))
        self.node_flags.clear()

    def pending_that_fit(self) -> None:
        """With every node back, a pending reservation (start now) that a preview says fits is
        placed by the pending worker's next pass over its pool."""
        by_id = {rid: key for key, rid in self.first_ids.items()}

        def fitting() -> list[str]:
            for pool_id in self.fleet.pools.values():
                self.server.call(pending.retry_pool(self.server.app.runtime, pool_id))
            self.settle()
            rows = self.w.sql("SELECT id FROM reservations WHERE tenant_id = %s AND state = 'pending'"
                              " ORDER BY id", (self.w.tenant,))
            out = []
            for (rid,) in rows:
                key = by_id.get(rid)
                if key is None or key not in self.keys or self.keys[key][1] is not None:
                    continue  # a twin of another request, or a calendar start (passed by now)
                shape, _ = self.keys[key]
                request = self.request(key, shape, None, random.Random(0))
                request.ClearField("wait")
                preview = capacity_pb2_grpc.CapacityStub(self.w.user.channel).Preview(
                    request, metadata=self.w.user.metadata, timeout=60)
                if preview.fits:
                    out.append(rid)
            return out

        first = fitting()
        if first:
            again = [rid for rid in fitting() if rid in first]
            for rid in again:
                self.findings.append(f"pending though a preview fits, after two passes: {rid}\n{self.story(rid)}")

    def story(self, rid: str) -> str:
        """What a finding about one reservation needs: its row, allocations, wake-ups and events."""
        q = self.w.sql
        return "\n".join(str(x) for x in [
            q("SELECT state, during::text, lease_deadline, epoch_ms(compute_now()), request::text, conditions::text"
              " FROM reservations WHERE id = %s", (rid,)),
            q("SELECT id, node_id, state FROM allocations WHERE reservation_id = %s ORDER BY id", (rid,)),
            q("SELECT run_at, attempts, last_error, dead_at FROM work_items WHERE subject = %s", (rid,)),
            q("SELECT type, data->>'state', time FROM events WHERE subject = %s ORDER BY id", ("reservation/" + rid,)),
        ])

    def drained_since(self, seconds: float = 60) -> None:
        """Wait until every transaction open now (the servers' included) has ended."""
        deadline = time.monotonic() + seconds
        [(mark,)] = self.w.sql("SELECT clock_timestamp()")
        while self.w.sql("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                         " AND pid <> pg_backend_pid() AND xact_start < %s", (mark,)):
            if time.monotonic() > deadline:
                self.findings.append(f"a transaction open for {seconds} s")
                return
            time.sleep(0.02)

    def check(self, now: int) -> None:
        s = check_invariants(self.w.conninfo, self.w.tenant)
        stuck = self.w.sql(STUCK, {"t": self.w.tenant, "now": now, "lead": schedule.REPAIR_LEAD_MS,
                                   "bind": schedule.BIND_TIMEOUT_MS})
        for row in self.w.sql(HOST_OVERBOOKED, {"t": self.w.tenant}):
            self.findings.append(f"host resources overbooked: {row}")
        for row in stuck:
            self.findings.append(f"stuck: {row}\n{self.story(row[0])}")
        went: dict[str, set[str]] = defaultdict(set)
        for e in s["events"]:
            went[e["id"]].add(e["state"])
        with self.lock:
            for rid, seen in self.seen.items():
                missing = seen - went[rid] - {states.DRAFT, states.DENIED}
                if missing:
                    self.findings.append(f"{rid} was answered {sorted(missing)} but has no such event: {went[rid]}")


# Host resources (not in tests/invariants.py): at each moment a booking starts, the node's live
# bookings of the resource fit what it can give (host_capacity: allocatable less the reserve).
HOST_OVERBOOKED = """
SELECT t.node_id, t.resource, t.at::text, sum(h2.amount) AS booked, host_capacity(t.node_id, t.resource) AS capacity
FROM (SELECT DISTINCT h1.node_id, h1.resource, lower(h1.during) AS at
      FROM host_bookings h1 JOIN nodes n ON n.id = h1.node_id JOIN pools p ON p.id = n.pool_id
      WHERE p.owner_tenant_id = %(t)s) t
JOIN host_bookings h2 ON h2.node_id = t.node_id AND h2.resource = t.resource AND h2.during @> t.at
JOIN allocations a2 ON a2.id = h2.allocation_id AND a2.state IN ('placed', 'binding', 'bound')
GROUP BY t.node_id, t.resource, t.at
HAVING sum(h2.amount) > host_capacity(t.node_id, t.resource)
"""


# Settled, nothing may be left: queued (the holder places or parks every one), placed past its
# repair on a node that is not fit, placed past its start, binding past its bind deadline, booked
# past its end or its lease deadline, or booked with no wake-up left (its end at least is one).
STUCK = """
SELECT * FROM (
SELECT r.id, r.state, epoch_ms(lower(r.during)) - %(now)s AS start_in, epoch_ms(upper(r.during)) - %(now)s AS end_in,
       CASE
         WHEN r.state = 'queued' THEN 'queued'
         WHEN r.state IN ('placed', 'binding', 'active') AND epoch_ms(upper(r.during)) <= %(now)s THEN 'past its end'
         WHEN r.state IN ('placed', 'binding', 'active') AND r.lease_deadline IS NOT NULL
              AND epoch_ms(r.lease_deadline) <= %(now)s THEN 'past its lease deadline'
         WHEN r.state = 'placed' AND epoch_ms(lower(r.during)) <= %(now)s THEN 'placed past its start'
         WHEN r.state = 'placed' AND epoch_ms(lower(r.during)) - %(lead)s <= %(now)s AND EXISTS (
              SELECT 1 FROM allocations al JOIN nodes n ON n.id = al.node_id
              LEFT JOIN bookings b ON b.allocation_id = al.id LEFT JOIN atoms a ON a.id = b.atom_id
              WHERE al.reservation_id = r.id AND al.state = 'placed'
                AND (n.state <> 'ready' OR n.connectivity = 'unreachable' OR n.revoked_at IS NOT NULL
                     OR a.health <> 'healthy' OR NOT a.bookable)) THEN 'placed on an unfit node past its repair'
         WHEN NOT EXISTS (SELECT 1 FROM work_items wi WHERE wi.subject = r.id AND wi.dead_at IS NULL)
              THEN 'booked with no wake-up left'
       END AS why
FROM reservations r
WHERE r.tenant_id = %(t)s AND r.state IN ('queued', 'placed', 'binding', 'active')
) s WHERE why IS NOT NULL
"""


def server_log_deadlocks(conninfo: str) -> str:
    """The database server's own account of its deadlocks: the statement of each process."""
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            text = conn.execute("SELECT pg_read_file('log')").fetchone()[0]
    except psycopg.Error as exc:
        return f"(no server log: {exc})"
    lines = text.splitlines()
    found = [i for i, line in enumerate(lines) if "deadlock detected" in line]
    return "\n".join("\n".join(lines[i:i + 14]) for i in found[-2:])


# Seeds that found a bug (each has its focused test below): run first, then fresh ones.
FOUND = [1342586754, 654181955]


def seeds() -> tuple[list[int], float]:
    """BC_CHAOS_SEED=<seed>[,<seed>...] runs those; otherwise FOUND, then fresh seeds until
    BC_CHAOS_SECONDS (default 25: about 40 seconds with the setup) have passed."""
    pinned = os.environ.get("BC_CHAOS_SEED")
    if pinned:
        return [int(x) for x in pinned.split(",")], float("inf")
    fresh = [random.SystemRandom().randrange(1 << 32) for _ in range(1000)]
    return FOUND + fresh, float(os.environ.get("BC_CHAOS_SECONDS", 25))


@pytest.mark.timeout(3600)
def test_mixed_load_with_node_faults_keeps_every_invariant(stack: tuple[ServerThread, Client]) -> None:
    server, _ = stack
    chosen, budget = seeds()
    started = time.monotonic()
    rounds = 0
    retried: dict[str, int] = defaultdict(int)  # deadlocks and serialization failures retried
    with capture_logs() as logs:
        for seed in chosen:
            if time.monotonic() - started > budget:
                break
            scenario = Scenario(seed, server)
            try:
                for round_no in range(ROUNDS + 1):
                    if round_no < ROUNDS:
                        scenario.round(round_no)
                        rounds += 1
                    else:
                        scenario.finish()
                    failed = [e for e in logs if e.get("event") in ("rpc failed", "work item failed", "work item dead",
                                                                    "work runner failed; continuing")]
                    for e in failed:
                        scenario.findings.append(f"log: {e}")
                    if any("deadlock" in str(e) for e in failed):
                        scenario.findings.append(server_log_deadlocks(server.conninfo))
                    for e in logs:
                        if e.get("event") in ("transaction retried", "statement retried"):
                            retried[e.get("sqlstate")] += 1
                    logs.clear()
                    assert scenario.findings == [], f"seed {seed}, round {round_no}:\n" + "\n".join(
                        scenario.findings[:20])
            except AssertionError as exc:
                raise AssertionError(f"seed {seed} (BC_CHAOS_SEED={seed} runs it again): {exc}") from None
            finally:
                scenario.w.close()
                scenario.w.root.close()
            print(f"seed {seed}: {dict(scenario.stats)}")
            print("  reached:", scenario.w.sql(
                "SELECT CASE WHEN request ? 'gang' AND request->'gang' <> 'null' THEN 'gang'"
                " WHEN (request->'resources'->>'vcpu')::int > 20 THEN 'host' WHEN request->>'leaseSeconds' IS NOT NULL"
                " THEN 'lease' ELSE 'plain' END AS shape, e.type, count(DISTINCT r.id)"
                " FROM reservations r JOIN events e ON e.subject = 'reservation/' || r.id"
                " WHERE r.tenant_id = %s GROUP BY 1, 2 ORDER BY 1, 2", (scenario.w.tenant,)))
    print(f"{rounds} rounds in {time.monotonic() - started:.0f} s; retried by SQLSTATE: {dict(retried)}")


# -- focused tests of what the scenario found -----------------------------------------------------


def blocked_on_a_lock(conninfo: str, text: str) -> list[int]:
    """The backends of this database waiting for a lock in a statement containing `text`."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [pid for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            " AND query ILIKE %s", (f"%{text}%",))]


def test_a_lapsed_lease_refunds_before_it_touches_the_bookings_a_create_waits_on(
        stack: tuple[ServerThread, Client]) -> None:
    """Seeds 1342586754 and 654181955: the reconciler's transaction that ended a reservation cut
    its bookings (row locks a create booking those atoms waits on), then refunded its quota,
    waiting for the tenant's usage rows, which a concurrent create had charged and held: a
    deadlock, the reconciler's pass failed ("work item failed") and the release waited for a
    retry. A refund now takes the usage rows first, in the order a create takes them: with the
    rows held as a create holds them, the waiting end has not touched the bookings."""
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=1, quota=8)
    leased = w.create(count=2, duration="2h", lease_seconds=60)
    assert leased.state in ("placed", "binding"), leased
    with psycopg.connect(w.conninfo) as charging:  # a create's charge of the tenant's GPUs, not committed
        charging.execute("SELECT * FROM quota_usage WHERE tenant_id = %s FOR UPDATE", (w.tenant,))
        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=2 * MIN))  # the lease lapses
        deadline = time.monotonic() + 30
        while not blocked_on_a_lock(w.conninfo, "quota_charges"):
            assert time.monotonic() < deadline, "the reconciler never reached the refund"
            time.sleep(0.02)
        # What a create placing on those atoms needs next: their bookings' rows, not locked.
        booked = charging.execute(
            "SELECT b.atom_id FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
            " WHERE a.reservation_id = %s FOR UPDATE OF b NOWAIT", (leased.id,)).fetchall()
        assert len(booked) == 2
    released = eventually_state(w, leased.id, states.RELEASED)
    assert released.state == states.RELEASED
    check_invariants(w.conninfo, w.tenant)


def eventually_state(w: World, rid: str, state: str, seconds: float = 30) -> pb.Reservation:
    deadline = time.monotonic() + seconds
    while True:
        r = w.user.res("Get", pb.GetReservationRequest(tenant_id=w.tenant, reservation_id=rid))
        if r.state == state:
            return r
        assert time.monotonic() < deadline, f"{rid} is still {r.state}"
        time.sleep(0.05)
