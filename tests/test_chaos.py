"""Chaos: two control-plane replicas (real processes) on one database, a steady stream of
creates, extends, releases and clock jumps, and kill -9 of a replica every few seconds, until at
least MIN_KILLS kills and MIN_PLACED placements have happened (bounded by MAX_LOAD_SECONDS).

Afterwards the SQL invariant checker finds no double booking, no quota drift and only event
paths the state table allows, and once time has moved past every end, no reservation is stuck
past its deadlines.
"""

from __future__ import annotations

import pathlib
import random
import threading
import time

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.devtools import devstack
from tests.conftest import clone_database
from tests.invariants import check_invariants
from tests.support import Client, make_world

MIN_KILLS = 8  # about what the old fixed 30 s window gave, and more than its floor of 5
MIN_PLACED = 21
MAX_LOAD_SECONDS = 240  # only a bound against a hang: the counts are usually reached in ~20 s
KILL_EVERY_S = (2.0, 4.0)


REPLICA_ENV = {"BC_CLOCK_CONTROL": "1", "BC_PENDING_RETRY_SECONDS": "2"}


class Replica:
    """A `controlplane serve` process (controlplane.devtools.devstack) and the endpoint it listens on."""

    def __init__(self, conninfo: str, log_path: str) -> None:
        self.process, self.endpoint = devstack.controlplane(conninfo, pathlib.Path(log_path), env=REPLICA_ENV)

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        self.process.stop()


@pytest.mark.timeout(MAX_LOAD_SECONDS + 240)  # the load, the settling and the replica starts
def test_kill_9_replicas_under_load_keeps_every_invariant(pg_uri: str, tmp_path) -> None:
    conninfo = clone_database(pg_uri)
    root_token = bootstrap.ensure_root(conninfo)
    replicas = [Replica(conninfo, str(tmp_path / f"replica-{i}.log")) for i in range(2)]
    stop = threading.Event()
    lock = threading.Lock()
    stats: dict[str, int] = {}
    kills = 0
    try:
        root = Client(replicas[0].endpoint, root_token)
        world = make_world(replicas[0].endpoint, root, conninfo, nodes=4, quota=10_000)
        user_token = world.user.metadata[0][1].split(" ", 1)[1]
        created: list[str] = []

        def client() -> tuple[Client, Client]:
            with lock:
                endpoint = random.choice(replicas).endpoint
            return Client(endpoint, user_token), Client(endpoint, root_token)

        def record(name: str) -> None:
            with lock:
                stats[name] = stats.get(name, 0) + 1

        def load(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                user, admin = client()
                try:
                    op = rng.random()
                    if op < 0.55:
                        start = None if rng.random() < 0.5 else world.later(rng.uniform(0.05, 3))
                        req = world.create_request(count=rng.choice([1, 2, 4, 8]),
                                                   topology=rng.choice(["", "nvlink-all"]),
                                                   duration=f"{rng.randint(10, 120)}m")
                        if start is not None:
                            req.start = start
                        r = user.res("Create", req, timeout=10)
                        with lock:
                            created.append(r.id)
                        record(f"create:{r.state}")
                    elif op < 0.7 and created:
                        rid = rng.choice(created)
                        out = user.res("Extend", pb.ExtendReservationRequest(
                            tenant_id=world.tenant, reservation_id=rid, by="15m",
                            idempotency_key=f"x{rng.randint(0, 10**9)}"), timeout=10)
                        record(f"extend:{out.extended}")
                    elif op < 0.9 and created:
                        rid = rng.choice(created)
                        user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=rid),
                                 timeout=10)
                        record("release")
                    else:
                        admin.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=rng.randint(1, 8) * 60_000),
                                    timeout=10)
                        record("advance")
                except grpc.RpcError as exc:
                    record(f"error:{exc.code().name}")
                finally:
                    user.close()
                    admin.close()

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()

        def placed() -> int:
            with lock:
                return stats.get("create:placed", 0) + stats.get("create:binding", 0)

        deadline = time.monotonic() + MAX_LOAD_SECONDS
        victim = 0
        while (kills < MIN_KILLS or placed() < MIN_PLACED) and time.monotonic() < deadline:
            time.sleep(random.uniform(*KILL_EVERY_S))
            with lock:
                replicas[victim].kill()
            kills += 1
            fresh = Replica(conninfo, str(tmp_path / f"replica-{victim}-{kills}.log"))
            with lock:
                replicas[victim] = fresh
            victim = 1 - victim
        stop.set()
        for t in threads:
            t.join(30)
        assert kills >= MIN_KILLS and placed() >= MIN_PLACED, (kills, stats)

        check_invariants(conninfo, world.tenant)

        # Move past every end: both replicas' workers must bring everything to rest.
        admin = Client(replicas[1].endpoint, root_token)
        admin.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=2 * 86_400_000))
        settle = time.monotonic() + 60
        while True:
            with psycopg.connect(conninfo) as conn:
                stuck = conn.execute(
                    "SELECT id, state FROM reservations WHERE tenant_id = %s AND state IN"
                    " ('placed', 'binding', 'active') AND upper(during) <= compute_now()", (world.tenant,)).fetchall()
                due = conn.execute("SELECT count(*) FROM work_items WHERE run_at <= compute_now()").fetchone()[0]
            if not stuck and due == 0:
                break
            assert time.monotonic() < settle, f"stuck past their deadlines: {stuck[:5]}, due work items: {due}"
            time.sleep(0.5)
        admin.close()
        check_invariants(conninfo, world.tenant)
    finally:
        stop.set()
        for replica in replicas:
            replica.stop()
