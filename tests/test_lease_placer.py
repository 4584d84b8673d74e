"""The pool-lease placer (DESIGN.md section 9, spec "Waiting for placement"): a lease pool's create
answers queued with a running operation and `reservation.queued`; the pool's lease holder places
it in a batch; `wait` holds the answer until it is placed; queued reservations are cancellable and
releasable with their quota refunded; a booking the index never heard of costs only the member
that planned on it a re-plan. Real control plane, real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import psycopg
import pytest
from structlog.testing import capture_logs

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.ids import draft_id
from controlplane import bootstrap
from controlplane.config import Settings
from controlplane.reservations import wait as wait_module
from tests.conftest import clone_database, module_stack
from tests.invariants import check_invariants
from tests.promise_support import pool_locked
from tests.support import Client, ServerThread, World, eventually, get, make_world, rpc_error

LEASE_S = 1.5


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, default_placer="lease", placer_lease_seconds=LEASE_S, placement_top_n=1)


def held_by_other(world: World) -> None:
    """Another (absent) holder holds the pool's lease for a long while: nothing drains it."""
    world.sql("INSERT INTO pool_leases (pool_id, holder, epoch, deadline) "
              "VALUES (%s, 'elsewhere', 7, clock_timestamp() + interval '1 hour') "
              "ON CONFLICT (pool_id) DO UPDATE SET holder = 'elsewhere', epoch = pool_leases.epoch + 1, "
              "deadline = EXCLUDED.deadline", (world.pool_id,))


def held_by_tester(world: World) -> None:
    """The test itself holds the pool's lease, at epoch 3, for an hour: it drains the pool by hand
    (queued.drain with holder 'tester') and the server's lease worker never does."""
    world.sql("INSERT INTO pool_leases (pool_id, holder, epoch, deadline) "
              "VALUES (%s, 'tester', 3, clock_timestamp() + interval '1 hour') "
              "ON CONFLICT (pool_id) DO UPDATE SET holder = 'tester', epoch = 3, deadline = EXCLUDED.deadline",
              (world.pool_id,))


def lapse(world: World) -> None:
    """The absent holder's lease lapses: the server's lease worker takes it at its next tick."""
    world.sql("UPDATE pool_leases SET deadline = clock_timestamp() WHERE pool_id = %s", (world.pool_id,))


def lease_row(world: World) -> tuple[str, int]:
    return world.sql("SELECT holder, epoch FROM pool_leases WHERE pool_id = %s", (world.pool_id,))[0]


def events_of(world: World, rid: str) -> list[str]:
    return [r[0] for r in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id", (f"reservation/{rid}",))]


def test_pool_policy_names_the_placer(world: World) -> None:
    pools = {p.id: p for p in world.root.admin("ListPools", apb.ListPoolsRequest(owner_tenant_id=world.tenant)).items}
    assert pools[world.pool_id].policy.placer == "lease"  # this server's BC_DEFAULT_PLACER
    inline = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="i", policy=apb.PoolPolicy(placer="inline")))
    assert inline.policy.placer == "inline"
    with pytest.raises(grpc.RpcError) as excinfo:
        world.root.admin("CreatePool", apb.CreatePoolRequest(
            owner_tenant_id=world.tenant, name="x", policy=apb.PoolPolicy(placer="fifo")))
    code, reason, details = rpc_error(excinfo)
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "policy.placer")


def test_a_queued_create_is_placed_by_the_lease_holder(world: World) -> None:
    # The answer is read after the queueing commits; the holder's batch (which takes the pool
    # lock) waits until the answer is in, so it cannot place the reservation before that read.
    with pool_locked(world):
        r = world.create(count=2, topology="nvlink-all", start=world.later(2))
    assert (r.state, r.operation.state) == ("queued", "running")
    placed = eventually(world, r.id, lambda x: x.state != "queued")
    assert placed.state == "placed"
    assert placed.operation.state == "succeeded" and len(placed.allocations) == 1
    assert events_of(world, r.id) == ["reservation.queued", "reservation.placed"]
    queued_data = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.queued'",
                            (f"reservation/{r.id}",))[0][0]
    assert queued_data == {"state": "queued", "poolId": world.pool_id}
    holder, _ = lease_row(world)
    assert holder.split(":")[1].isdigit(), holder  # this server's worker holds it
    check_invariants(world.conninfo, world.tenant)


def test_wait_on_a_queued_create_returns_it_placed(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    # The wait's first pause is made longer than the test, so only the batch's hand-off can end it:
    # with the usual 50 ms a slow batch (make test under load) let the pause lapse and the wait
    # read the reservation between the batch's commit and its hand-off (handed False; not a fault).
    monkeypatch.setattr(wait_module, "FIRST_DELAY_S", 30.0)
    with capture_logs() as logs:
        r = world.create(count=1, start=world.later(2), wait=pb.Wait(timeout_ms=20_000))
    assert (r.state, r.operation.state) == ("placed", "succeeded")
    assert events_of(world, r.id) == ["reservation.queued", "reservation.placed"]
    [line] = [e for e in logs if e["event"] == "operation wait" and e["reservation_id"] == r.id]
    # Handed by this process's batch, with no read before the first pause (it was just queued) and
    # none after the hand-off that ended the last; or, when the batch committed before the wait
    # began watching (make test under load: the queueing commit comes first), woken by the batch's
    # notification (or, had that come first too, at the lengthened pause's end) and read once.
    if line["handed"]:
        assert line["reads"] == len(line["pauses_ms"]) - 1
    else:
        assert line["reads"] == 1, line


def test_wait_returns_it_placed_once_a_holder_takes_the_lapsed_lease(world: World) -> None:
    held_by_other(world)
    _, old_epoch = lease_row(world)
    request = world.create_request(key="waiting", count=1, start=world.later(2), wait=pb.Wait(timeout_ms=20_000))
    future = world.user._r.Create.future(request, metadata=world.user.metadata, timeout=60)
    rid = draft_id(world.tenant, world.user_id, "waiting")
    until(lambda: world.sql("SELECT state FROM reservations WHERE id = %s", (rid,)) == [("queued",)])
    with capture_logs() as logs:
        lapse(world)
        r = future.result()
    assert (r.id, r.state, r.operation.state) == (rid, "placed", "succeeded")
    [line] = [e for e in logs if e["event"] == "operation wait" and e["reservation_id"] == rid]
    assert line["woken"] == 1, "the batch ended the pause, not the back-off"
    assert line["handed"], "the new holder's batch, in this process, handed the wait its reservation"
    holder, epoch = lease_row(world)
    assert holder != "elsewhere" and epoch == old_epoch + 1, "a takeover moves the fencing epoch"


def until(check: Callable[[], bool], seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_queued_reservations_are_cancellable_and_releasable(world: World) -> None:
    held_by_other(world)
    world.quota(6)
    start = world.later(2)
    cancelled, released, kept = (world.create(count=2, start=start) for _ in range(3))
    assert {cancelled.state, released.state, kept.state} == {"queued"}
    with pytest.raises(grpc.RpcError) as excinfo:
        world.create(count=2)
    assert rpc_error(excinfo)[1] == "QUOTA_EXCEEDED", "queued reservations hold their quota"

    out = world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=cancelled.id))
    assert (out.state, out.operation.state) == ("cancelled", "failed")
    out = world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=released.id))
    assert out.state == "cancelled"
    assert events_of(world, cancelled.id) == ["reservation.queued", "reservation.cancelled"]
    again = world.create(count=4, start=start)  # the refunded quota is usable at once
    assert again.state == "queued"
    check_invariants(world.conninfo, world.tenant)

    lapse(world)
    for rid in (kept.id, again.id):
        assert eventually(world, rid, lambda x: x.state != "queued").state == "placed"
    assert get(world, cancelled.id).state == "cancelled" and get(world, released.id).state == "cancelled"
    assert world.sql("SELECT count(*) FROM allocations a JOIN reservations r ON r.id = a.reservation_id "
                     "WHERE r.id = ANY(%s)", ([cancelled.id, released.id],))[0][0] == 0
    check_invariants(world.conninfo, world.tenant)


def test_a_queued_reservation_nothing_fits_goes_pending_with_the_reason(world: World) -> None:
    r = world.create(count=16, wait=pb.Wait(timeout_ms=20_000))
    assert (r.state, r.operation.state) == ("pending", "succeeded")
    unschedulable = [c for c in r.conditions if c.type == "Unschedulable"]
    assert unschedulable and unschedulable[0].reason == "NoFit"
    assert "no node has 16 free healthy GPUs" in unschedulable[0].message
    assert events_of(world, r.id) == ["reservation.queued", "reservation.pending"]
    check_invariants(world.conninfo, world.tenant)


def test_a_booking_the_index_never_heard_of_costs_only_its_member_a_replan(world: World) -> None:
    """Node A has 4 GPUs booked openly and the other 4 booked behind the index's back (no
    notification): bin-packing (top-1) plans the 4-GPU member on A, whose insert the EXCLUDE
    constraint refuses; only that member is planned again, on B, beside the batch's others."""
    a, b = world.nodes
    start = world.later(2)
    opened = world.create(count=4, start=start, duration="2h", wait=pb.Wait(timeout_ms=20_000))
    assert opened.state == "placed"
    on_a = opened.allocations[0].node_id == a.id
    if not on_a:  # keep the names: A is the node holding the open booking
        a, b = b, a
    free_on_a = [r[0] for r in world.sql(
        "SELECT at.id FROM atoms at WHERE at.node_id = %s AND NOT EXISTS "
        "(SELECT 1 FROM bookings bk WHERE bk.atom_id = at.id) ORDER BY at.id", (a.id,))]
    assert len(free_on_a) == 4
    held_by_other(world)
    members = [world.create(count=c, start=start, duration="2h") for c in (4, 2, 2)]
    assert all(m.state == "queued" for m in members)
    secret = "rsv_secret" + world.tenant
    world.sql("""
        WITH r AS (INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,
                                             request_hash, state, operation_state, during)
                   SELECT %(id)s, tenant_id, pool_id, owner_identity_id, 'secret', request, 'x', 'placed',
                          'succeeded', tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(start)s + 7200000), '[)')
                   FROM reservations WHERE id = %(opened)s RETURNING id),
             al AS (INSERT INTO allocations (id, reservation_id, node_id, device_ids)
                    SELECT 'alloc_secret' || %(id)s, id, %(node)s, '{}' FROM r RETURNING id)
        SELECT 1 FROM al""", {"id": secret, "start": start, "opened": opened.id, "node": a.id})
    with world._conn.transaction():  # the booking without its trigger: the index never hears of it
        world._conn.execute("SET LOCAL session_replication_role = replica")
        world._conn.execute(
            "INSERT INTO bookings (atom_id, allocation_id, during) SELECT unnest(%s::text[]), %s, "
            "tstzrange(from_epoch_ms(%s), from_epoch_ms(%s), '[)')",
            (free_on_a, "alloc_secret" + secret, start, start + 7_200_000))
    world.sql("UPDATE reservations SET state = 'released', end_reason = 'test' WHERE id = %s", (secret,))

    with capture_logs() as logs:
        lapse(world)
        placed = [eventually(world, m.id, lambda x: x.state != "queued") for m in members]
    assert [m.state for m in placed] == ["placed"] * 3
    assert {m.allocations[0].node_id for m in placed} == {b.id}, "the refused member was re-planned on B"
    lost = [e for e in logs if e["event"] == "batch placement races lost"]
    assert [(e["members"], e["nodes"]) for e in lost] == [(1, [a.id])]
    batch = [e for e in logs if e["event"] == "placer batch"]
    assert [(e["reservations"], e["placed"], e["lost_races"]) for e in batch] == [(3, 3, 1)]
    assert world.sql("SELECT count(*) FROM bookings bk JOIN atoms at ON at.id = bk.atom_id "
                     "WHERE at.node_id = %s", (a.id,))[0][0] == 8


@dataclass
class Replicas:
    """Two control planes on one database with 10-minute leases (a lease could only move by its
    holder's hand), after a first create placed: `first` holds the pool's lease at `epoch`."""

    world: World
    first: ServerThread
    other: ServerThread
    epoch: int


@contextlib.contextmanager
def two_replicas(pg_uri: str) -> Iterator[Replicas]:
    conninfo = clone_database(pg_uri)
    settings = Settings(database_url=conninfo, default_placer="lease", placer_lease_seconds=600)
    servers = [ServerThread(conninfo, settings) for _ in range(2)]
    try:
        root = Client(servers[0].endpoint, bootstrap.ensure_root(conninfo))
        w = make_world(servers[0].endpoint, root, conninfo)
        assert w.create(count=1, start=w.later(2), wait=pb.Wait(timeout_ms=20_000)).state == "placed"
        holder, epoch = lease_row(w)
        first = next(s for s in servers if s.app.runtime.leases.holder == holder)
        yield Replicas(w, first, next(s for s in servers if s is not first), epoch)
        root.close()
    finally:
        for server in servers:
            server.stop()  # a second stop of a stopped one does nothing


def test_a_stopped_holder_hands_its_lease_over_at_once(pg_uri: str) -> None:
    """Stopping the holder (as SIGTERM does) lapses its lease and tells the other, which takes
    it, one epoch later, and places the next create."""
    with two_replicas(pg_uri) as r:
        w, other = r.world, r.other
        r.first.stop()
        until(lambda: lease_row(w)[0] == other.app.runtime.leases.holder)
        assert lease_row(w)[1] == r.epoch + 1
        user = Client(other.endpoint, w.user.metadata[0][1].split(" ", 1)[1])
        placed = w.create(user, count=1, start=w.later(2), wait=pb.Wait(timeout_ms=20_000))
        assert placed.state == "placed"
        user.close()


def test_a_stop_waits_for_its_leases_to_be_dropped(pg_uri: str) -> None:
    """The holder's stop gives its lease worker the grace to drop the leases, even when it has no
    RPC in flight: the test holds the lease row so the drop waits, and releases it while the stop
    is under way; the other replica takes the lease, one epoch later."""
    import concurrent.futures

    with two_replicas(pg_uri) as r:
        w, first = r.world, r.first
        waiting = ("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                   "AND query LIKE '%%UPDATE pool_leases SET deadline%%'")
        with psycopg.connect(first.conninfo) as blocker, concurrent.futures.ThreadPoolExecutor(1) as pool:
            blocker.execute("SELECT 1 FROM pool_leases WHERE pool_id = %s FOR UPDATE", (w.pool_id,))
            stopping = pool.submit(first.call, first.app.stop(10))
            until(lambda: bool(w.sql(waiting)))  # the drop waits for the row...
            blocker.rollback()  # ...and goes on
            stopping.result(30)
        until(lambda: lease_row(w)[0] == r.other.app.runtime.leases.holder)
        assert lease_row(w)[1] == r.epoch + 1


def test_a_batch_books_host_resources_through_the_guarded_statement(world: World) -> None:
    """A lease pool's batch books each member's host resources like an inline commit: what a node
    cannot give is not booked there (the guard of migration 0018 decides), and the member goes to a
    node that can."""
    from tests.test_host_resources import host_bookings, resources

    world.wait_ms = 20_000
    for node in world.nodes:
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node.id, state="cordoned"))
    hosts = []
    for vcpu in (40, 40):
        name = f"hr{len(world.nodes):03d}-{world.tenant[-6:]}"
        from tests.support import gpus as gpu_list
        node = world.add_node(gpu_list(name, 8), name=name, system_labels={"bc.dev/cap.devices.limits": "true"})
        world.sql("INSERT INTO host_resources (node_id, resource, allocatable) VALUES"
                  " (%(n)s, 'vcpu', %(v)s), (%(n)s, 'memoryGiB', 512)", {"n": node.id, "v": vcpu})
        hosts.append(node.id)
    world.quota(1000, "vcpu")
    start = world.later(2)
    # Each node gives 38 vCPUs (40 less the default reserve of 2): two asks of 30 need both nodes.
    first = world.create(count=1, resources=resources(vcpu=30), start=start)
    second = world.create(count=1, resources=resources(vcpu=30), start=start)
    placed = [eventually(world, r.id, lambda x: x.state != "queued") for r in (first, second)]
    assert [p.state for p in placed] == ["placed", "placed"]
    assert {p.allocations[0].node_id for p in placed} == set(hosts)
    assert [host_bookings(world, p.id)["vcpu"] for p in placed] == [30, 30]
    third = world.create(count=1, resources=resources(vcpu=30), start=start)
    assert eventually(world, third.id, lambda x: x.state != "queued").state == "pending"
    assert host_bookings(world, third.id) == {}
    check_invariants(world.conninfo, world.tenant)


def test_a_batch_whose_lease_was_taken_over_meanwhile_commits_nothing(stack: tuple[ServerThread, Client]) -> None:
    """The fencing check: a batch planned under epoch N whose lease moved to epoch N+1 before its
    last statement rolls back whole. The batch is held inside its insert (an uncommitted booking
    of another transaction on one of its atoms) while the lease is taken over."""
    from controlplane.reservations import queued

    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=1)
    held_by_tester(w)
    start = w.later(2)
    r = w.create(count=8, start=start, duration="1h")
    assert r.state == "queued"
    runtime = server.app.runtime
    assert server.call(queued.drain(runtime, w.pool_id, "tester", 2)) == 0, "a stale epoch takes nothing"

    blocker = psycopg.connect(w.conninfo)
    try:
        blocker.execute("""
            WITH r AS (INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,
                                                 request_hash)
                       SELECT 'rsv_blocker' || tenant_id, tenant_id, pool_id, owner_identity_id, 'blocker', request, 'x'
                       FROM reservations WHERE id = %(rid)s RETURNING id),
                 al AS (INSERT INTO allocations (id, reservation_id, node_id, device_ids)
                        SELECT 'alloc_blocker', id, %(node)s, '{}' FROM r RETURNING id)
            INSERT INTO bookings (atom_id, allocation_id, during)
            SELECT (SELECT min(id) FROM atoms WHERE node_id = %(node)s), id,
                   tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(start)s + 60000), '[)') FROM al""",
                        {"rid": r.id, "node": w.nodes[0].id, "start": start})
        async def drain_watched() -> tuple[int, dict | None]:
            with runtime.leases.waiters.watching(r.id) as waiter:
                return await queued.drain(runtime, w.pool_id, "tester", 3), waiter.view

        future = asyncio.run_coroutine_threadsafe(drain_watched(), server.loop)
        until(lambda: w.sql("SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'")[0][0] > 0)
        w.sql("UPDATE pool_leases SET holder = 'elsewhere', epoch = 4 WHERE pool_id = %s", (w.pool_id,))
        blocker.rollback()
        assert future.result(30) == (0, None), "the fenced batch counts nothing and hands nothing"
    finally:
        blocker.close()
    node = runtime.capacity.pool(w.pool_id).nodes[w.nodes[0].id]
    assert all(a.intervals == [] for a in node.atoms.values()), "the index forgot the rolled-back plan"
    assert get(w, r.id).state == "queued"
    assert w.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (r.id,))[0][0] == 0
    w.sql("UPDATE pool_leases SET deadline = clock_timestamp() WHERE pool_id = %s", (w.pool_id,))
    assert eventually(w, r.id, lambda x: x.state != "queued").state == "placed", "the next holder places it"
    check_invariants(w.conninfo, w.tenant)
    w.close()


def test_a_batch_that_fits_costs_five_statements_however_many_it_places(world: World) -> None:
    """BEGIN, the pool lock with the fence and the rows, every allocation and booking, every move
    with its wake-ups and events, COMMIT: counted in the log and the Prometheus counters."""
    for _ in range(2):
        world.add_node()
    held_by_other(world)
    start = world.later(2)
    members = [world.create(count=c, start=start, topology=t) for c, t in
               [(1, ""), (2, "nvlink-all"), (4, ""), (8, ""), (1, ""), (3, ""), (2, ""), (8, "nvlink-all"), (1, ""),
                (2, "")]]
    assert {m.state for m in members} == {"queued"}
    with capture_logs() as logs:
        lapse(world)
        for m in members:
            assert eventually(world, m.id, lambda x: x.state != "queued").state == "placed"
    batches = [e for e in logs if e["event"] == "placer batch" and e["pool_id"] == world.pool_id]
    assert [(e["reservations"], e["placed"], e["statements"]) for e in batches] == [(10, 10, 5)]
    assert batches[0]["statements_per_reservation"] == 0.5


def test_the_batch_counters_are_exported(stack: tuple[ServerThread, Client], world: World) -> None:
    registry = stack[0].app.runtime.metrics.registry
    before = registry.get_sample_value("bc_placer_batch_statements_total") or 0
    placed_before = registry.get_sample_value("bc_placer_batch_reservations_total", {"outcome": "placed"}) or 0
    r = world.create(count=1, start=world.later(2), wait=pb.Wait(timeout_ms=20_000))
    assert r.state == "placed"
    # Counted once the batch's transaction is over, which may be just after the create's answer.
    until(lambda: registry.get_sample_value("bc_placer_batch_reservations_total", {"outcome": "placed"})
          >= placed_before + 1)
    assert registry.get_sample_value("bc_placer_batch_statements_total") >= before + 5


def test_the_holders_batch_hands_its_waiters_what_a_read_gives(stack: tuple[ServerThread, Client],
                                                               world: World) -> None:
    """After its commit, a batch hands each waiting create of its process the reservation as it
    moved it (placed with its allocation, or pending with its reason): the very view a read of it
    gives then."""
    from controlplane.reservations import queued
    from controlplane.reservations.reads import fetch_view

    server, _ = stack
    runtime = server.app.runtime
    held_by_tester(world)
    start = world.later(2)
    members = [world.create(count=c, start=start, duration="2h", topology=t)
               for c, t in [(2, "nvlink-all"), (16, ""), (1, "")]]  # no node has 16 GPUs
    assert {m.state for m in members} == {"queued"}
    ids = [m.id for m in members]

    async def read_when_handed(waiter: Any, rid: str) -> tuple[dict | None, dict]:
        await waiter.event.wait()
        return waiter.view, await fetch_view(runtime, rid)  # at once: a hand-off before the commit differs

    async def drain_and_read() -> tuple[int, list[tuple[dict | None, dict]]]:
        with contextlib.ExitStack() as watching:
            waiters = [watching.enter_context(runtime.leases.waiters.watching(rid)) for rid in ids]
            reads = [asyncio.create_task(read_when_handed(w, rid)) for w, rid in zip(waiters, ids)]
            taken = await queued.drain(runtime, world.pool_id, "tester", 3)
            return taken, await asyncio.gather(*reads)

    taken, pairs = server.call(drain_and_read())
    handed, read = [h for h, _ in pairs], [r for _, r in pairs]
    assert taken == 3
    assert [(v["state"], v["operation_state"], len(v["allocations"])) for v in handed] == [
        ("placed", "succeeded", 1), ("pending", "succeeded", 0), ("placed", "succeeded", 1)]
    assert [c["reason"] for c in handed[1]["conditions"]] == ["NoFit"]
    assert handed == read


def test_a_batch_whose_commit_fails_hands_nothing(stack: tuple[ServerThread, Client], world: World) -> None:
    """The hand-off comes after the commit, never before: a batch whose every statement ran but
    whose commit failed (a deferred check of this test's own refuses it) hands its waiter nothing
    and wakes it to read, and the reservation is still queued."""
    from controlplane.reservations import queued

    server, _ = stack
    runtime = server.app.runtime
    held_by_tester(world)
    r = world.create(count=1, start=world.later(2))
    assert r.state == "queued"
    world.sql("CREATE FUNCTION test_refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS "
              "$$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$")
    world.sql("CREATE CONSTRAINT TRIGGER test_refuse_at_commit AFTER UPDATE ON reservations "
              f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.id = '{r.id}') "
              "EXECUTE FUNCTION test_refuse_at_commit()")

    async def drain_watched() -> tuple[bool, dict | None]:
        with runtime.leases.waiters.watching(r.id) as waiter:
            with pytest.raises(psycopg.errors.RaiseException, match="refused at commit"):
                await queued.drain(runtime, world.pool_id, "tester", 3)
            return waiter.event.is_set(), waiter.view

    try:
        assert server.call(drain_watched()) == (True, None), "woken to read, handed nothing"
    finally:
        world.sql("DROP TRIGGER test_refuse_at_commit ON reservations")
        world.sql("DROP FUNCTION test_refuse_at_commit()")
    assert get(world, r.id).state == "queued"


def test_a_claimed_reservation_is_woken_by_its_hand_off_or_else_at_the_end() -> None:
    """A batch's own notification does not wake the waiters it is about to hand their views to;
    a batch that claimed and could not hand (its commit failed) wakes them, and they read."""
    from controlplane.placement.lease import Waiters

    async def scenario() -> None:
        waiters = Waiters()
        with waiters.watching("r1") as first, waiters.watching("r2") as second:
            with waiters.handing() as hand_off:
                hand_off.claim({"r1": {"id": "r1", "state": "placed"}})
                waiters.wake(["r1", "r2"])  # the batch's bc_placed, heard before the hand-off
                assert not first.event.is_set() and second.event.is_set()
                hand_off.hand()
            assert first.event.is_set() and first.view == {"id": "r1", "state": "placed"}
            assert second.view is None

            first.event.clear()
            second.event.clear()
            with pytest.raises(psycopg.OperationalError), waiters.handing() as hand_off:
                hand_off.claim({"r2": {"id": "r2"}})
                raise psycopg.OperationalError("the connection broke at the commit")
            assert second.event.is_set() and second.view is None, "woken to read"
            assert not first.event.is_set()
            second.event.clear()
            waiters.wake(["r2"])
            assert second.event.is_set(), "no longer claimed"

    asyncio.run(scenario())
