"""Faults against the promise that nothing is lost, double-booked or half-written and that every
call is safe to retry (DESIGN.md sections 2, 8, 11 and 13; spec "Drafts and idempotency", "The
admission sequence"): PostgreSQL ending the control plane's connections (pg_terminate_backend,
as a failover or an operator does) while idle and mid-call, kill -9 of the control plane and of
the gateway with calls and node reports in flight, and Watch streams across a restart. Each test
here was an attack; the ones that broke a promise came with their fix."""

from __future__ import annotations

import contextlib
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import psycopg
import pytest
from structlog.testing import capture_logs

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap, listen
from controlplane.common.status import error_info
from controlplane.devtools import devstack
from tests.conftest import clone_database, module_stack
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, eventually, get, gpus, make_world, refused
from tests.test_gateway import GatewayThread, Node, connected, enrolled, gateway, join_token, pool_id  # noqa: F401 - fixtures
from tests.test_watch import Stream

WAIT = 30  # seconds: a bound on waiting for a positive signal, never a pause


def until(check: Callable[[], Any], what: str, seconds: float = WAIT) -> Any:
    deadline = time.monotonic() + seconds
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return result


def backends(conninfo: str, where: str = "true") -> list[int]:
    """The pids of the other sessions on this database (the servers'), filtered by `where`."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [pid for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            f" AND backend_type = 'client backend' AND {where}")]


def terminate(conninfo: str, pids: list[int], conn: psycopg.Connection | None = None) -> None:
    """End these backends (from `conn`, or a connection of our own) and wait until they are gone."""
    with psycopg.connect(conninfo, autocommit=True) if conn is None else contextlib.nullcontext(conn) as c:
        for pid in pids:
            c.execute("SELECT pg_terminate_backend(%s)", (pid,))
        until(lambda: not {pid for (pid,) in c.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,))}, "the backends to end")


POOLED = "application_name NOT LIKE 'bc-listen:%%'"  # the connection pool's, not a listener's


# -- the connection pool ------------------------------------------------------------------------


def test_pooled_connections_the_server_ended_while_idle_fail_no_call(world: World) -> None:
    """The server ends every pooled connection (a failover, an operator, an idle timeout) while
    nothing runs. Before the fix, each call that drew a dead connection from the pool answered
    INTERNAL (five in a row here) until the pool had discarded them all: the pool now checks a
    connection before lending it."""
    placed = world.create(count=1)
    terminate(world.conninfo, backends(world.conninfo, POOLED))
    for _ in range(20):
        assert get(world, placed.id).id == placed.id
    assert world.create(count=1).state == "placed"
    check_invariants(world.conninfo, world.tenant)


def test_a_whole_pool_of_dead_connections_fails_no_call(world: World) -> None:
    """Every connection of a pool grown by concurrent calls ended at once (a failover). psycopg's
    pool backs off before each next try after a failed check, twice as long each time: with one
    dead connection after another a call waited 1 + 2 + 4 + 8 + 16 s and ran out of time. The first
    dead one now has every idle connection checked at once, so the call's next try gets a live one."""
    placed = world.create(count=1)
    with ThreadPoolExecutor(max_workers=32) as workers:
        until(lambda: list(workers.map(lambda _: get(world, placed.id), range(64)))
              and len(backends(world.conninfo, POOLED)) >= 8, "the pool to grow to 8 connections or more")
    terminate(world.conninfo, backends(world.conninfo, POOLED))
    for _ in range(5):
        assert get(world, placed.id).id == placed.id
    check_invariants(world.conninfo, world.tenant)


def waiting_on_a_lock(conninfo: str, statement: str = "") -> list[int]:
    """The backends waiting on a lock (running `statement`, when given: a pending retry woken by
    the world's newly registered nodes takes the pool lock too)."""
    return backends(conninfo, "wait_event_type = 'Lock'" + (f" AND query LIKE '%{statement}%'" if statement else ""))


@pytest.mark.parametrize("call", ["release", "cancel", "extend", "create"])
def test_a_call_whose_backend_is_ended_mid_call_is_unavailable_and_its_retry_converges(world: World, call: str) -> None:
    """The server ends the backend of a call while it waits on a lock. The caller gets
    UNAVAILABLE (the gRPC code clients retry on, ErrorInfo reason UNAVAILABLE, no internals), not
    INTERNAL, and the same call again succeeds once: nothing was half-written."""
    target = world.create(count=2, start=world.later(2))
    requests: dict[str, Callable[[], Any]] = {
        "release": lambda: world.user.res("Release", pb.ReleaseReservationRequest(
            tenant_id=world.tenant, reservation_id=target.id)),
        "cancel": lambda: world.user.res("Cancel", pb.CancelReservationRequest(
            tenant_id=world.tenant, reservation_id=target.id)),
        "extend": lambda: world.user.res("Extend", pb.ExtendReservationRequest(
            tenant_id=world.tenant, reservation_id=target.id, until=target.during.end + 3_600_000,
            idempotency_key="ext-1")),
        "create": lambda: world.user.res("Create", create),
    }
    create = world.create_request(key="mid-call", count=1)
    answer: dict[str, Any] = {}
    with psycopg.connect(world.conninfo) as holder:
        # Hold what the call needs next: the reservation's row, or (a create) the pool's lock.
        if call == "create":
            holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("pool:" + world.pool_id,))
        else:
            holder.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (target.id,))
        thread = threading.Thread(target=lambda: answer.update(refused=refused(requests[call])))
        thread.start()
        statement = "place_inline" if call == "create" else ""
        [blocked] = until(lambda: waiting_on_a_lock(world.conninfo, statement), "the call to wait on the lock")
        terminate(world.conninfo, [blocked])
        thread.join(WAIT)
        holder.rollback()
    code, reason, details = answer["refused"]
    assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"), details
    assert "requestId" in details and "retryAfterSeconds" in details
    again = requests[call]()
    if call == "release":
        assert again.state == "released"
    elif call == "cancel":
        assert again.state == "cancelled"
    elif call == "extend":
        assert again.extended and again.reservation.during.end == target.during.end + 3_600_000
    else:
        assert again.state == "placed" and world.sql("SELECT count(*) FROM reservations WHERE id = %s",
                                                      (again.id,)) == [(1,)]
    check_invariants(world.conninfo, world.tenant)


# -- kill -9 of the control plane with calls in flight ------------------------------------------

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class Call:
    """One call with a fixed request (its idempotency key included), made again until it has an
    answer that is not a fault: what a client that retries does."""

    def __init__(self, name: str, rid: str, send: Callable[[Client, float], Any]) -> None:
        self.name, self.rid, self.send = name, rid, send
        self.answers: list[Any] = []  # every answer or spec error, in order

    def once(self, client: Client, timeout: float = 20) -> str:
        """Call it once: "" once it has a final answer (a response, or a spec error that is no
        fault); else why not: "fault" (the server was away), "in-flight" (a killed extend's slot,
        taken over once 60 s old)."""
        try:
            self.answers.append(self.send(client, timeout))
            return ""
        except grpc.RpcError as exc:
            if exc.code() in RETRYABLE:
                return "fault"
            info = error_info(exc)
            if info is not None and info.reason == "CONFLICT" and info.metadata.get("reason") == "extend-in-flight":
                return "in-flight"
            self.answers.append((exc.code(), info.reason if info else "", dict(info.metadata) if info else {}))
            return ""


@pytest.mark.parametrize("eighths", [1, 4], ids=["early", "midway"])
def test_kill_9_with_creates_extends_releases_and_cancels_in_flight_converges_on_retry(
        pg_uri: str, tmp_path: pathlib.Path, eighths: int) -> None:
    """A control plane killed with -9 while 42 calls are in flight (creates on an inline and a
    lease pool, extends to an `until`, releases, cancels), `eighths` of them answered, then
    started again: every call made again with the same request (and key) converges to one
    outcome, the one answered before the kill if any. No duplicate or lost reservation, no draft,
    queued or running create left, no extend slot or pending change left behind, and the
    invariants hold (no overlap, quota usage equal to the live charges, legal transitions)."""
    conninfo = clone_database(pg_uri)
    root_token = bootstrap.ensure_root(conninfo)
    env = {"BC_CLOCK_CONTROL": "1", "BC_PENDING_RETRY_SECONDS": "2", "BC_PLACER_LEASE_SECONDS": "1.5"}
    process, endpoint = devstack.controlplane(conninfo, tmp_path / "cp-1.log", env=env)
    processes = [process]
    clients: list[Client] = []
    try:
        root = Client(endpoint, root_token)
        clients.append(root)
        world = make_world(endpoint, root, conninfo, nodes=4, quota=10_000)
        token = world.user.metadata[0][1].split(" ", 1)[1]
        lease_pool = root.admin("CreatePool", apb.CreatePoolRequest(
            owner_tenant_id=world.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
        for i in range(4):
            root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=lease_pool, name=f"l{i}", gpus=gpus(f"l{i}")))
        # Targets for the calls on existing reservations: placed, starting in two hours.
        targets = [world.create(count=1, start=world.later(2)) for _ in range(18)]
        tenant = world.tenant
        calls: list[Call] = []
        for i in range(24):
            req = world.create_request(key=f"c{i}", count=(1, 2, 4)[i % 3],
                                       pool_id=lease_pool if i % 3 == 0 else world.pool_id,
                                       start=world.later(1 + i % 4) if i % 2 else None)
            if i % 3 == 0:
                req.wait.timeout_ms = 15_000
            calls.append(Call("create", "", lambda c, t, req=req: c.res("Create", req, timeout=t)))
        for t in targets[:6]:
            req = pb.ExtendReservationRequest(tenant_id=tenant, reservation_id=t.id, until=t.during.end + 3_600_000,
                                              idempotency_key=f"x-{t.id[-6:]}")
            calls.append(Call("extend", t.id, lambda c, tm, req=req: c.res("Extend", req, timeout=tm)))
        for t in targets[6:12]:
            req = pb.ReleaseReservationRequest(tenant_id=tenant, reservation_id=t.id)
            calls.append(Call("release", t.id, lambda c, tm, req=req: c.res("Release", req, timeout=tm)))
        for t in targets[12:]:
            req = pb.CancelReservationRequest(tenant_id=tenant, reservation_id=t.id)
            calls.append(Call("cancel", t.id, lambda c, tm, req=req: c.res("Cancel", req, timeout=tm)))

        user = Client(endpoint, token)
        clients.append(user)
        go = threading.Barrier(len(calls) + 1)
        answered = threading.Semaphore(0)

        def first(call: Call) -> None:
            go.wait()
            if not call.once(user):
                answered.release()

        threads = [threading.Thread(target=first, args=(call,), daemon=True) for call in calls]
        for thread in threads:
            thread.start()
        go.wait()
        for _ in range(len(calls) * eighths // 8):  # some answered: the rest are in flight
            assert answered.acquire(timeout=WAIT)
        process.kill()
        for thread in threads:
            thread.join(WAIT)
        in_flight = sum(1 for call in calls if not call.answers)
        assert in_flight, "every call answered before the kill"

        process, endpoint = devstack.controlplane(conninfo, tmp_path / "cp-2.log", env=env)
        processes.append(process)
        user, root = Client(endpoint, token), Client(endpoint, root_token)
        clients += [user, root]
        deadline = time.monotonic() + 120
        for call in calls:  # every call again, answered before the kill or not: the same outcome
            while why := call.once(user):
                assert time.monotonic() < deadline, f"{call.name} never answered: {call.answers}"
                if why == "in-flight":  # the killed extend's slot, 60 s of the product's clock later
                    root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=61_000))
                else:
                    time.sleep(0.1)

        by_id: dict[str, pb.Reservation] = {}
        for call in calls:
            last = call.answers[-1]
            if call.name == "create":
                assert {a.id for a in call.answers} == {last.id}, call.answers  # one reservation per key
                by_id[last.id] = last
            elif call.name == "extend":
                assert not isinstance(last, tuple) and last.reservation.during.end == targets[
                    [t.id for t in targets].index(call.rid)].during.end + 3_600_000, call.answers
            elif call.name == "release":
                assert last.state == "released", call.answers
            elif isinstance(last, tuple):  # a cancel that committed before the kill: its retry sees it
                assert last[1] == "INVALID_STATE" and last[2]["state"] == "cancelled", call.answers
            else:
                assert last.state == "cancelled", call.answers

        def settled() -> bool:
            rows = world.sql("SELECT id, state, operation_state FROM reservations WHERE tenant_id = %s"
                             " AND (state IN ('draft', 'queued') OR operation_state = 'running')", (tenant,))
            return not rows
        until(settled, "no draft, queued or running create left", seconds=60)
        assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (tenant,)) == [
            (len(targets) + sum(1 for c in calls if c.name == "create"),)]
        assert world.sql("SELECT count(*) FROM extend_holds") == [(0,)]
        assert world.sql("SELECT count(*) FROM authz_projection WHERE pending IS NOT NULL") == [(0,)]
        check_invariants(conninfo, tenant)
    finally:
        for client in clients:
            client.close()
        for p in processes:
            p.stop()


# -- kill -9 of the gateway while nodes bind and report -----------------------------------------

GATEWAY_ENV = {"BC_NODE_GRACE_SECONDS": "10", "BC_NODE_SWEEP_SECONDS": "1"}


def test_kill_9_of_the_gateway_while_nodes_bind_and_report_loses_and_doubles_nothing(
        pg_uri: str, tmp_path: pathlib.Path) -> None:
    """The gateway is killed with -9 while a fleet binds holds and reports them, and started again
    on the same ports. The nodes reconnect; every hold placed before, during and after the outage
    becomes active once, no report is stored twice, and the invariants hold."""
    conninfo = clone_database(pg_uri)
    root_token = bootstrap.ensure_root(conninfo)
    processes: list[devstack.Process] = []
    clients: list[Client] = []
    try:
        cp, endpoint = devstack.controlplane(conninfo, tmp_path / "cp.log", env={"BC_CLOCK_CONTROL": "1"})
        processes.append(cp)
        gw, session, enrol = devstack.gateway(conninfo, tmp_path / "gw-1.log", tmp_path / "ca.pem", env=GATEWAY_ENV)
        processes.append(gw)
        root = Client(endpoint, root_token)
        clients.append(root)
        world = make_world(endpoint, root, conninfo, nodes=0, quota=1000)
        names = [f"gk-{i}" for i in range(4)]
        devstack.issue_join_tokens(endpoint, root_token, world.pool_id, names, tmp_path / "tokens.json")
        processes.append(devstack.nodesim(len(names), session, enrol, tmp_path / "sandbox", tmp_path / "tokens.json",
                                          tmp_path / "ca.pem", tmp_path / "fleet.log", extra=("--heartbeat", "0.5")))

        def connected() -> bool:
            nodes = root.admin("ListNodes", apb.ListNodesRequest(pool_id=world.pool_id)).items
            return len([n for n in nodes if n.connectivity == "connected" and n.gpu_count == 8]) == len(names)
        until(connected, "the fleet to connect", seconds=60)

        def active() -> set[str]:
            return {rid for (rid,) in world.sql(
                "SELECT id FROM reservations WHERE tenant_id = %s AND state = 'active'", (world.tenant,))}

        rids = [world.create(count=1 + i % 2).id for i in range(8)]
        until(lambda: active(), "a first hold to bind", seconds=60)
        gw.kill()  # binds and reports of the others in flight
        rids += [world.create(count=1 + i % 2).id for i in range(4)]  # placed while no node is reachable
        gw, _, _ = devstack.gateway(conninfo, tmp_path / "gw-2.log", tmp_path / "ca.pem", env=GATEWAY_ENV,
                                    listen=session, enrol_listen=enrol)
        processes.append(gw)
        rids += [world.create(count=1 + i % 2).id for i in range(4)]
        until(lambda: active() >= set(rids), "every hold to be active", seconds=90)

        assert world.sql("SELECT allocation_id, key_id, sequence FROM node_reports WHERE sequence IS NOT NULL"
                         " GROUP BY 1, 2, 3 HAVING count(*) > 1") == []
        assert world.sql("SELECT subject FROM events WHERE tenant_id = %s AND type = 'reservation.active'"
                         " GROUP BY subject HAVING count(*) > 1", (world.tenant,)) == []
        for rid in rids:
            r = get(world, rid)
            assert r.state == "active" and r.binding.attested and r.binding.cdi_devices, r
        check_invariants(conninfo, world.tenant)
    finally:
        for client in clients:
            client.close()
        for p in reversed(processes):
            p.stop()


# -- a Watch stream across a restart ------------------------------------------------------------


def test_a_watch_resumed_after_a_kill_9_from_its_cursor_misses_and_repeats_nothing(
        pg_uri: str, tmp_path: pathlib.Path) -> None:
    """A consumer watches while creates stream in; the control plane is killed with -9 (some
    creates in flight) and started again, and the consumer resumes from the last id it got: the
    ids it got, over both streams, are the tenant's events in order, each once."""
    conninfo = clone_database(pg_uri)
    root_token = bootstrap.ensure_root(conninfo)
    processes: list[devstack.Process] = []
    clients: list[Client] = []
    try:
        cp, endpoint = devstack.controlplane(conninfo, tmp_path / "cp-1.log")
        processes.append(cp)
        root = Client(endpoint, root_token)
        clients.append(root)
        world = make_world(endpoint, root, conninfo, nodes=4, quota=10_000)
        token = world.user.metadata[0][1].split(" ", 1)[1]
        seen: list[int] = []
        stop = threading.Event()

        def creates(client: Client, prefix: str) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    client.res("Create", world.create_request(key=f"{prefix}{i}", start=world.later(1)), timeout=5)
                except grpc.RpcError:
                    pass  # killed mid-call: the invariants below say nothing was half-written

        def watch(client: Client, after: int, n: int) -> None:
            with Stream(client, timeout=60, tenant_id=world.tenant, after_id=after) as stream:
                seen.extend(e.id for e in stream.take(n, timeout=WAIT))

        user = Client(endpoint, token)
        clients.append(user)
        load = [threading.Thread(target=creates, args=(user, f"a{n}-"), daemon=True) for n in range(3)]
        for t in load:
            t.start()
        watch(user, 0, 30)
        cp.kill()
        stop.set()
        for t in load:
            t.join(WAIT)

        cp, endpoint = devstack.controlplane(conninfo, tmp_path / "cp-2.log")
        processes.append(cp)
        user = Client(endpoint, token)
        clients.append(user)
        stop.clear()
        load = [threading.Thread(target=creates, args=(user, f"b{n}-"), daemon=True) for n in range(3)]
        for t in load:
            t.start()
        watch(user, seen[-1], 30)
        stop.set()
        for t in load:
            t.join(WAIT)
        stored = [i for (i,) in world.sql("SELECT id FROM events WHERE tenant_id = %s AND id <= %s ORDER BY id",
                                          (world.tenant, seen[-1]))]
        assert seen == stored
        check_invariants(conninfo, world.tenant)
    finally:
        for client in clients:
            client.close()
        for p in reversed(processes):
            p.stop()


# -- the listeners of the capacity index and the pool-lease placer ------------------------------


@pytest.fixture
def own(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, placer_lease_seconds=1.5, create_wait_cap_seconds=20)


def listener(conninfo: str, name: str) -> list[int]:
    """The backend of the LISTEN connection serving the listener `name` (one per process, shared)."""
    return listen.backend_pids(conninfo, name)


def held_in_index(server: ServerThread, pool_id: str) -> set[tuple[str, int, int]]:
    capacity = server.app.runtime.capacity
    server.call(capacity.barrier())
    pool = capacity.pool(pool_id)
    assert pool is not None
    return {(a.id, s, e) for n in pool.nodes.values() for a in n.atoms.values() for s, e in a.intervals}


def booked_in_rows(world: World, pool_id: str) -> set[tuple[str, int, int]]:
    return set(world.sql("SELECT b.atom_id, epoch_ms(lower(b.during)), epoch_ms(upper(b.during)) FROM bookings b"
                         " JOIN atoms a ON a.id = b.atom_id JOIN nodes n ON n.id = a.node_id WHERE n.pool_id = %s",
                         (pool_id,)))


def test_changes_while_the_index_and_placer_listeners_are_down_reach_them_once_back(
        own: tuple[ServerThread, Client], pg_uri: str) -> None:
    """The server ends the capacity index's and the pool-lease placer's LISTEN connections and
    refuses new connections for a while, as a failover does; meanwhile creates, a release and a
    queued create commit, their notifications lost. Once connections are let in again, the index
    holds exactly what the rows hold (rebuilt, not stale), the queued create is placed, and creates
    on both placers place without a lost race."""
    server, root = own
    world = make_world(server.endpoint, root, server.conninfo, nodes=2, quota=1000)
    lease_pool = root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
    for i in range(2):
        root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=lease_pool, name=f"l{i}", gpus=gpus(f"l{i}")))
    start = world.later(2)
    first = world.create(count=8, start=start)
    assert world.create(count=1, pool_id=lease_pool, wait=pb.Wait(timeout_ms=20_000)).state == "placed"
    capacity = server.app.runtime.capacity
    builds = capacity.builds
    assert held_in_index(server, world.pool_id) == booked_in_rows(world, world.pool_id)

    dbname = world.sql("SELECT current_database()")[0][0]
    listeners = sorted({*listener(world.conninfo, "capacity-index"), *listener(world.conninfo, "placer-lease")})
    assert len(listeners) == 1  # the process's one LISTEN connection serves both
    listeners += backends(world.conninfo, "application_name = 'bc-listen:placer-lease/queries'")  # its lease ticks
    assert len(listeners) == 2
    admin = psycopg.connect(pg_uri, autocommit=True)  # from another database: it may not close its own
    admin.execute(f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS false")
    try:
        terminate(world.conninfo, listeners, admin)
        second = world.create(count=8, start=start)  # the other node: the index hears nothing of it
        world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=first.id))
        queued = world.create(count=2, pool_id=lease_pool)
        assert queued.state == "queued"
    finally:
        admin.execute(f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS true")
        admin.close()
    until(lambda: capacity.builds > builds, "the index to be rebuilt")
    assert held_in_index(server, world.pool_id) == booked_in_rows(world, world.pool_id)
    assert get(world, second.id).state == "placed"
    placed = eventually(world, queued.id, lambda r: r.operation.state != "running", seconds=WAIT)
    assert placed.state in ("placed", "binding") and placed.allocations, placed
    with capture_logs() as logs:
        again = world.create(count=8, start=start)
        assert again.state == "placed" and again.allocations[0].node_id != second.allocations[0].node_id
        assert world.create(count=4, pool_id=lease_pool, wait=pb.Wait(timeout_ms=20_000)).state == "placed"
    assert not [e for e in logs if e.get("event") == "placement race lost"]  # planned on a fresh index
    assert held_in_index(server, world.pool_id) == booked_in_rows(world, world.pool_id)
    check_invariants(world.conninfo, world.tenant)


# -- the gateway's unary calls ------------------------------------------------------------------


def test_an_enrolment_whose_backend_is_ended_mid_call_is_unavailable_and_the_token_still_enrols(
        gateway: GatewayThread, pool_id: str) -> None:
    """The server ends the backend of an enrolment while it waits for its join token's row. The
    node gets UNAVAILABLE (before the fix: INTERNAL), nothing is spent, and the same token then
    enrols it."""
    token = join_token(gateway.conninfo, pool_id, "gpu-faulty")
    node = Node(gateway)
    answer: dict[str, Any] = {}
    with psycopg.connect(gateway.conninfo) as holder:
        holder.execute("SELECT 1 FROM join_tokens WHERE node_name = 'gpu-faulty' FOR UPDATE")
        thread = threading.Thread(target=lambda: answer.update(refused=refused(node.enrol, token)))
        thread.start()
        [blocked] = until(lambda: waiting_on_a_lock(gateway.conninfo), "the enrolment to wait on the token")
        terminate(gateway.conninfo, [blocked])
        thread.join(WAIT)
        holder.rollback()
    code, reason, details = answer["refused"]
    assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"), details
    assert node.enrol(token).node_id


def assert_unavailable_then_served(ended: grpc.RpcError | None, node: Any) -> None:
    """The session ended UNAVAILABLE (ErrorInfo, no internals in its message), and the node's next
    session gets its desired state."""
    assert ended is not None
    info = error_info(ended)
    assert (ended.code(), info.reason if info else None) == (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"), ended
    assert "psycopg" not in ended.details() and "administrator" not in ended.details()
    again = node.session()
    try:
        assert again.recv() is not None
    finally:
        again.close()


def test_a_session_whose_desired_state_read_is_ended_mid_call_tells_the_node_no_internals(
        gateway: GatewayThread, pool_id: str) -> None:
    """The server ends the backend reading a node's desired state for its session. Before the fix
    the node got grpc's default for an unhandled exception: UNKNOWN "Unexpected <class
    'psycopg.errors.AdminShutdown'>: terminating connection due to administrator command". The
    session now ends UNAVAILABLE (ErrorInfo, no internals), the node's cue to reconnect, and the
    node's next session gets its desired state."""
    node, session = connected(gateway, pool_id, "gpu-faulty")
    with psycopg.connect(gateway.conninfo) as holder:
        holder.execute("LOCK TABLE allocations IN ACCESS EXCLUSIVE MODE")
        with psycopg.connect(gateway.conninfo, autocommit=True) as other:
            other.execute("SELECT bump_desired(%s)", (node.node_id,))
        [blocked] = until(lambda: waiting_on_a_lock(gateway.conninfo), "the desired state read to wait")
        terminate(gateway.conninfo, [blocked])
        ended = session.ended()
        holder.rollback()
    assert_unavailable_then_served(ended, node)


def test_a_session_whose_certificate_read_is_ended_mid_call_tells_the_node_no_internals(
        gateway: GatewayThread, pool_id: str) -> None:
    """The same while the gateway reads the certificate of a session being opened (before the fix:
    UNKNOWN with the exception's text); the node's next session is served."""
    node = enrolled(gateway, pool_id, "gpu-faulty")
    with psycopg.connect(gateway.conninfo) as holder:
        holder.execute("LOCK TABLE revocations IN ACCESS EXCLUSIVE MODE")
        session = node.session()
        [blocked] = until(lambda: waiting_on_a_lock(gateway.conninfo), "the certificate read to wait")
        terminate(gateway.conninfo, [blocked])
        ended = session.ended()
        holder.rollback()
    assert_unavailable_then_served(ended, node)


# -- every connection ended at once, under load -------------------------------------------------


def test_every_connection_ended_at_once_under_load_answers_only_unavailable_and_everything_resumes(
        world: World) -> None:
    """Creates stream in on four threads and a Watch is open when the server ends every
    connection of the control plane at once (its pool's and every listener's), twice. A call
    answers, or UNAVAILABLE and its retry with the same key converges; never INTERNAL. Afterwards
    the open Watch (or its resumption) gets the events of later creates, a create placed to start
    now moves to binding (the work queue), and the invariants hold."""
    world.quota(10_000)  # however many creates the load makes: no QUOTA_EXCEEDED among the answers
    codes: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()
    base = world.later(1)
    ours = world.sql("SELECT pg_backend_pid()")[0][0]  # the test's own connection stays

    def creates(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            req = world.create_request(key=f"f{n}-{i}", start=base + i % 3 * 3_600_000)
            while True:  # the same request until it has an answer
                try:
                    world.user.res("Create", req, timeout=20)
                    code = "OK"
                except grpc.RpcError as exc:
                    info = error_info(exc)
                    code = info.reason if info else exc.code().name
                with lock:
                    codes.append(code)
                if code != "UNAVAILABLE":
                    break

    with Stream(world.user, timeout=120, tenant_id=world.tenant) as stream:
        load = [threading.Thread(target=creates, args=(n,), daemon=True) for n in range(4)]
        for t in load:
            t.start()
        for _ in range(2):
            until(lambda: codes.count("OK") >= 10, "creates to flow")
            terminate(world.conninfo, backends(world.conninfo, f"pid <> {ours}"))
            with lock:
                codes[:] = [c for c in codes if c != "OK"]
        until(lambda: codes.count("OK") >= 10, "creates to flow again")
        stop.set()
        for t in load:
            t.join(WAIT)
        assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
        now = world.create(key="after", count=1, duration="30m")  # before every window the load booked
        seen: list[Any] = []
        try:
            while not any(e.subject == f"reservation/{now.id}" for e in seen):
                seen += stream.take(1, timeout=WAIT)
        except grpc.RpcError as exc:  # the stream's own read met the fault: it resumes from its cursor
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            last = seen[-1].id if seen else 0
            with Stream(world.user, timeout=60, tenant_id=world.tenant, after_id=last) as again:
                while not any(e.subject == f"reservation/{now.id}" for e in seen):
                    seen += again.take(1, timeout=WAIT)
    eventually(world, now.id, lambda r: r.state in ("binding", "active"), seconds=WAIT)
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s AND state = 'draft'",
                     (world.tenant,)) == [(0,)]
    check_invariants(world.conninfo, world.tenant)


def test_a_reconciler_pass_whose_backend_is_ended_mid_handler_is_taken_again(clock_world: World) -> None:
    """The server ends the backends of the work queue's handlers while they wait for the reservation
    they move at its start. The item rolls back with it and is handled again: the reservation reaches
    binding, once, without waiting for the safety poll."""
    world = clock_world
    r = world.create(count=1, start=world.later(0.5))
    with psycopg.connect(world.conninfo) as holder:
        holder.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (r.id,))
        world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=31 * 60_000))
        blocked = until(lambda: waiting_on_a_lock(world.conninfo), "the reconciler to wait on the row")
        terminate(world.conninfo, blocked)
        holder.rollback()
    moved = eventually(world, r.id, lambda x: x.state == "binding", seconds=WAIT)
    assert moved.state == "binding"
    assert world.sql("SELECT count(*) FROM events WHERE subject = %s AND type = 'reservation.binding'",
                     (f"reservation/{r.id}",)) == [(1,)]
    check_invariants(world.conninfo, world.tenant)
