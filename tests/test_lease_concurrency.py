"""The pool-lease placer under load (issue "capacity engine", Correctness): the invariants (no atom
double-booked, quota used equals the live charges, every live reservation has bookings or a
reason, every event path allowed by the state table) hold under concurrent creates, releases and
extends on a lease pool, and across a lease handover: two real control-plane processes on one
database, the holder killed with SIGKILL while creates stream in; the other replica takes the
lease, places everything still queued, and nothing is double-booked or left queued, and no quota
drifts."""

from __future__ import annotations

import pathlib
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.devtools import devstack
from tests.conftest import clone_database, module_stack
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, make_world
from tests.test_concurrency import outcome

SHAPES = [(1, ""), (2, ""), (4, ""), (8, ""), (2, "nvlink-all"), (4, "nvlink-all")]
HOUR_MS = 3_600_000


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, default_placer="lease", placer_lease_seconds=1.5, placer_batch=8)


def settled(conninfo: str, tenant: str, seconds: float = 60) -> None:
    """Wait until no reservation of the tenant is queued (the holder placed or parked them all)."""
    deadline = time.monotonic() + seconds
    while True:
        with psycopg.connect(conninfo) as conn:
            left = conn.execute("SELECT count(*) FROM reservations WHERE tenant_id = %s AND state = 'queued'",
                                (tenant,)).fetchone()[0]
        if left == 0:
            return
        assert time.monotonic() < deadline, f"{left} reservations still queued"
        time.sleep(0.1)


def test_concurrent_creates_releases_and_extends_on_a_lease_pool(world: World) -> None:
    w = world
    for _ in range(2):
        w.add_node()
    w.quota(40)  # more than the 32 GPUs: the pool runs out first (pending), then the quota
    now_ms = w.sql("SELECT epoch_ms(compute_now())")[0][0]
    created: list[str] = []
    lock = threading.Lock()

    def op(i: int) -> tuple[str, str, Any]:
        r = random.Random(i)
        kind = r.choice(["create"] * 5 + ["release", "extend"])
        with lock:
            known = list(created)
        if kind == "create" or not known:
            count, topology = r.choice(SHAPES)
            wait = pb.Wait(timeout_ms=10_000) if r.random() < 0.5 else None
            start = now_ms + HOUR_MS + r.choice([0, 15, 30]) * 60_000
            code, reply = outcome(lambda: w.create(key=f"c{i}", count=count, topology=topology, duration="2h",
                                                   start=start, **({"wait": wait} if wait else {})))
            if code == "ok":
                with lock:
                    created.append(reply.id)
            return "create", code, reply
        rid = r.choice(known)
        if kind == "release":
            request = pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=rid)
            return kind, *outcome(lambda: w.user.res("Release", request))
        request = pb.ExtendReservationRequest(tenant_id=w.tenant, reservation_id=rid, by="30m",
                                              idempotency_key=f"x{i}")
        return kind, *outcome(lambda: w.user.res("Extend", request))

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(op, range(160)))
    allowed = {"create": {"ok", "QUOTA_EXCEEDED"}, "release": {"ok"},
               "extend": {"ok", "INVALID_STATE", "CONFLICT"}}
    for kind, code, reply in results:
        assert code in allowed[kind], (kind, code, reply)
    creates = [reply for kind, code, reply in results if kind == "create" and code == "ok"]
    assert any(r.state == "queued" for r in creates), "no create answered queued"
    assert any(r.state == "placed" for r in creates), "no create waited until placed"
    assert any(kind == "extend" and code == "ok" and reply.extended for kind, code, reply in results)
    settled(w.conninfo, w.tenant)
    s = check_invariants(w.conninfo, w.tenant)
    final = {b["id"]: b["state"] for b in s["bookings"]}
    assert "placed" in final.values(), final
    went = {e["type"] for e in s["events"]}
    assert {"reservation.queued", "reservation.placed", "reservation.pending"} <= went, "the pool ran out too"
    assert_pending_have_a_reason(w.conninfo, w.tenant)


def assert_pending_have_a_reason(conninfo: str, tenant: str) -> None:
    """Every pending reservation says why: an Unschedulable condition with a message."""
    with psycopg.connect(conninfo) as conn:
        silent = conn.execute(
            "SELECT id FROM reservations WHERE tenant_id = %s AND state = 'pending' AND NOT EXISTS ("
            " SELECT 1 FROM jsonb_array_elements(conditions) c"
            " WHERE c->>'type' = 'Unschedulable' AND c->>'message' <> '')", (tenant,)).fetchall()
    assert silent == []


REPLICA_ENV = {"BC_DEFAULT_PLACER": "lease", "BC_PLACER_LEASE_SECONDS": "1.5", "BC_PLACER_BATCH": "4",
               "BC_PENDING_RETRY_SECONDS": "2"}


@pytest.mark.timeout(300)
def test_the_lease_moves_to_the_other_replica_when_its_holder_is_killed(pg_uri: str, tmp_path: pathlib.Path) -> None:
    conninfo = clone_database(pg_uri)
    root_token = bootstrap.ensure_root(conninfo)
    replicas = [devstack.controlplane(conninfo, tmp_path / f"replica-{i}.log", env=REPLICA_ENV) for i in range(2)]
    clients: list[Client] = []
    try:
        root = Client(replicas[0][1], root_token)
        clients.append(root)
        world = make_world(replicas[0][1], root, conninfo, nodes=4, quota=10_000)
        token = world.user.metadata[0][1].split(" ", 1)[1]

        def holder() -> tuple[int, int]:
            """(pid, epoch) of the pool's lease holder, once there is one."""
            deadline = time.monotonic() + 30
            while True:
                rows = world.sql("SELECT holder, epoch FROM pool_leases WHERE pool_id = %s", (world.pool_id,))
                if rows:
                    return int(rows[0][0].split(":")[1]), rows[0][1]
                assert time.monotonic() < deadline, "nobody took the pool's lease"
                time.sleep(0.05)

        # A first create makes sure a holder drains the pool.
        first = world.create(count=1, start=world.later(1), wait=pb.Wait(timeout_ms=20_000))
        assert first.state == "placed"
        pid, epoch = holder()
        victim = next(p for p, _ in replicas if p.proc.pid == pid)
        survivor_endpoint = next(e for p, e in replicas if p.proc.pid != pid)
        user = Client(survivor_endpoint, token)
        clients.append(user)

        stop = threading.Event()
        answers: list[tuple[str, Any]] = []
        start = world.later(1)

        def stream(seed: int) -> None:
            rnd = random.Random(seed)
            i = 0
            while not stop.is_set():
                i += 1
                count, topology = rnd.choice(SHAPES)
                at = start + rnd.randint(0, 400) * 30 * 60_000  # spread: most of them fit
                answers.append(outcome(lambda: world.create(user, key=f"s{seed}-{i}", count=count, topology=topology,
                                                            duration=f"{rnd.randint(5, 60)}m", start=at)))

        threads = [threading.Thread(target=stream, args=(n,), daemon=True) for n in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(1 for code, _ in answers if code == "ok") < 20:  # batches are running
            assert time.monotonic() < deadline, answers[-5:]
            time.sleep(0.05)
        victim.kill()  # SIGKILL, mid-stream: its open batch (if any) rolls back with its connections
        killed_at = time.monotonic()
        while holder()[0] == pid:
            assert time.monotonic() - killed_at < 30, "the lease never moved"
            time.sleep(0.05)
        moved_after = time.monotonic() - killed_at
        new_pid, new_epoch = holder()
        assert new_pid != pid and new_epoch > epoch
        before = len(answers)
        deadline = time.monotonic() + 60
        while len(answers) < before + 20:  # creates keep flowing to the new holder
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)

        codes = {code for code, _ in answers}
        assert codes <= {"ok", "grpc:UNAVAILABLE"}, codes
        settled(conninfo, world.tenant)
        s = check_invariants(conninfo, world.tenant)
        states = [b["state"] for b in s["bookings"]]
        assert "queued" not in states
        assert states.count("placed") >= 20, states
        assert_pending_have_a_reason(conninfo, world.tenant)
        assert moved_after < 15, f"the lease took {moved_after:.1f} s to move"
    finally:
        for client in clients:
            client.close()
        for process, _ in replicas:
            process.stop()
