"""Leftovers of the hostile review of the pool-lease placer (DESIGN.md section 9, spec "Waiting for
placement", "Start, lease, extend and release"): a batch that waited for the pool lock counts the
window and the lease from when it places, and a renew that waited for the batch from when it
renews; cancel, release and extend racing the batch; a start that passes while queued, a retry of
the key, a lowered quota, a withdrawn offer; a pool switched off the lease placer keeps no
reservation queued. Real control plane with clock control on a database of each test's own, real
gRPC, real PostgreSQL."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from structlog.testing import capture_logs

from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import pool_locked
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.promise_support import poll
from tests.support import Client, ServerThread, World, clock_now, eventually, make_world, outcome, refused
from tests.test_hostile_queue import cancel, extend, no_extend_leftovers, release, renew
from tests.test_lease_placer import held_by_other, lapse
from tests.test_hostile_spot import advance, waiting_for_a_lock

LEASE_S = 600


@pytest.fixture
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """A control plane with clock control and lease pools, on a database of this test's own."""
    yield from module_stack(pg_uri, clock_control=True, default_placer="lease", placer_lease_seconds=1.5)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    """A tenant with a lease pool of one 8-GPU node."""
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=1)
    w.server = server
    yield w
    w.close()


@contextlib.contextmanager
def insert_held_up(world: World, start: int) -> Iterator[psycopg.Connection]:
    """Another transaction's uncommitted booking on the first atom of the world's one node, from
    `start` for a minute: a batch that planned on that node waits inside its insert (holding the
    pool lock and its rows) until the block ends or the connection yielded rolls back."""
    with psycopg.connect(world.conninfo) as blocker:
        blocker.execute("""
            WITH r AS (INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,
                                                 request_hash)
                       VALUES ('rsv_blocker' || %(t)s, %(t)s, %(pool)s, %(owner)s, 'blocker', '{}'::jsonb, 'x')
                       RETURNING id),
                 al AS (INSERT INTO allocations (id, reservation_id, node_id, device_ids)
                        SELECT 'alloc_blocker' || %(t)s, id, %(node)s, '{}' FROM r RETURNING id)
            INSERT INTO bookings (atom_id, allocation_id, during)
            SELECT (SELECT min(id) FROM atoms WHERE node_id = %(node)s), id,
                   tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(start)s + 60000), '[)') FROM al""",
                        {"t": world.tenant, "pool": world.pool_id, "owner": world.user_id, "node": world.nodes[0].id,
                         "start": start})
        yield blocker


def waiting_sessions(world: World) -> int:
    return world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                     " AND datname = current_database()")[0][0]


def used_gpus(world: World) -> int:
    return world.sql("SELECT coalesce(sum(amount), 0) FROM quota_charges WHERE tenant_id = %s AND resource = 'gpu' "
                     "AND refunded_at IS NULL", (world.tenant,))[0][0]


def work_at(world: World, rid: str, at_ms: int) -> int:
    return world.sql("SELECT count(*) FROM work_items WHERE subject = %s AND epoch_ms(run_at) = %s",
                     (rid, at_ms))[0][0]


# -- The clock of a batch that waited for the pool lock -----------------------------------------


def test_a_batch_that_waited_for_the_pool_lock_counts_window_and_lease_from_placement(world: World) -> None:
    """The lease runs out leaseSeconds after placement, and a window without a start begins at
    placement: a batch that waited for the pool lock while the clock moved on two minutes used to
    count both from its transaction's start (compute_now() before the wait), so the lease was short
    by the wait and the window began before the placement. Its reconciler wake-up is at the
    deadline."""
    w = world
    with pool_locked(w):
        r = w.create(count=8, lease_seconds=LEASE_S)
        assert r.state == "queued"
        waiting_for_a_lock(w)  # the holder's batch
        advance(w, 120_000)
        placed_from = clock_now(w)
    placed = eventually(w, r.id, lambda x: x.state != "queued", seconds=30)
    assert placed.state in ("placed", "binding")  # the window begins at placement: binding at once
    assert placed.lease_deadline >= placed_from + LEASE_S * 1000, placed.lease_deadline - placed_from
    assert placed.during.start >= placed_from, placed.during.start - placed_from
    assert placed.during.end == placed.during.start + 3_600_000
    assert work_at(w, r.id, placed.lease_deadline) == 1
    check_invariants(w.conninfo, w.tenant)


def test_a_batch_held_up_inside_its_insert_counts_the_lease_from_its_move(world: World) -> None:
    """The batch holds the pool lock but its insert waits (another transaction's uncommitted
    booking on an atom it planned) while the clock moves on two minutes: the lease is counted when
    the batch moves the reservation to placed, as place_inline counts it, not from the clock the
    batch read before the wait."""
    w = world
    start = w.later(2)
    with insert_held_up(w, start) as blocker:
        r = w.create(count=8, start=start, lease_seconds=LEASE_S)
        assert r.state == "queued"
        waiting_for_a_lock(w)  # the batch's insert, behind the uncommitted booking
        advance(w, 120_000)
        placed_from = clock_now(w)
        blocker.rollback()
    placed = eventually(w, r.id, lambda x: x.state != "queued", seconds=30)
    assert placed.state == "placed" and placed.during.start == start
    assert placed.lease_deadline >= placed_from + LEASE_S * 1000, placed.lease_deadline - placed_from
    assert work_at(w, r.id, placed.lease_deadline) == 1
    check_invariants(w.conninfo, w.tenant)


# -- Lifecycle calls racing the batch that places the reservation ---------------------------------


def racing_the_batch(w: World, call, **create) -> tuple[pb.Reservation, object, int]:
    """A queued reservation whose batch holds its row (held up inside its insert) when `call(w, id)`
    comes, which waits for the row; the batch then places it and the call goes on: (the
    reservation as created, the call's outcome, the clock when the batch was let go)."""
    start = create.pop("start", None) or w.later(2)
    with ThreadPoolExecutor(1) as pool, insert_held_up(w, start) as blocker:
        r = w.create(count=8, start=start, **create)
        assert r.state == "queued"
        poll(lambda: waiting_sessions(w) >= 1, 15, "the batch waiting inside its insert")
        pending = pool.submit(outcome, call, w, r.id)
        poll(lambda: waiting_sessions(w) >= 2 or pending.done(), 15, "the call waiting for the row")
        time.sleep(0.2)  # the call waits on: its transaction began before the batch commits
        let_go = clock_now(w)
        blocker.rollback()
        return r, pending.result(timeout=30), let_go


def test_a_renew_that_waited_for_the_batch_counts_from_when_it_renews(world: World) -> None:
    """Renew moves the lease to now plus leaseSeconds: a renew that waited for the row while the
    batch placed it used to count from its transaction's start, before the batch's placement, so
    it shortened the lease the batch had just given."""
    r, renewed, let_go = racing_the_batch(world, renew, lease_seconds=LEASE_S)
    assert isinstance(renewed, pb.Reservation), renewed
    assert renewed.state == "placed"
    assert renewed.lease_deadline >= let_go + LEASE_S * 1000, renewed.lease_deadline - let_go
    assert work_at(world, r.id, renewed.lease_deadline) == 1
    check_invariants(world.conninfo, world.tenant)


@pytest.mark.parametrize("call", [cancel, release], ids=["cancel", "release"])
def test_a_cancel_or_release_that_waited_for_the_batch_withdraws_what_it_placed(world: World, call) -> None:
    r, out, _ = racing_the_batch(world, call)
    assert isinstance(out, pb.Reservation), out
    assert out.state in ("cancelled", "released"), out.state
    assert world.sql("SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id "
                     "WHERE a.reservation_id = %s", (r.id,))[0][0] == 0
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL",
                     (r.id,))[0][0] == 0
    check_invariants(world.conninfo, world.tenant)


def test_an_extend_while_the_batch_places_is_refused_or_applied_whole(world: World) -> None:
    r, out, _ = racing_the_batch(world, lambda w, rid: extend(w, rid, by="1h"))
    got = eventually(world, r.id, lambda x: x.state != "queued", seconds=30)
    if isinstance(out, pb.ExtendReservationResponse):
        assert out.extended and got.during.end == got.during.start + 2 * 3_600_000
    else:
        assert out[1] == "INVALID_STATE", out
        assert got.during.end == got.during.start + 3_600_000
    assert got.state == "placed"
    no_extend_leftovers(world, r.id)
    check_invariants(world.conninfo, world.tenant)


# -- Queued for a while ------------------------------------------------------------------------


def test_a_start_that_passes_while_queued_begins_at_placement_with_the_full_duration(world: World) -> None:
    w = world
    held_by_other(w)
    start = w.later(0.1)  # six minutes ahead
    r = w.create(count=2, start=start, duration="2h", lease_seconds=LEASE_S)
    assert r.state == "queued"
    advance(w, 3_600_000)
    placed_from = clock_now(w)
    lapse(w)
    placed = eventually(w, r.id, lambda x: x.state != "queued", seconds=30)
    assert placed.state in ("placed", "binding"), placed.state
    assert placed.during.start >= placed_from and placed.during.end == placed.during.start + 2 * 3_600_000
    assert placed.lease_deadline >= placed_from + LEASE_S * 1000
    check_invariants(w.conninfo, w.tenant)


def test_a_retry_with_the_same_key_while_queued_answers_the_stored_reservation(world: World) -> None:
    w = world
    held_by_other(w)
    request = w.create_request(key="same", count=2, start=w.later(2))
    first = w.user.res("Create", request)
    second = w.user.res("Create", request)
    assert (first.id, first.state) == (second.id, "queued")
    assert w.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s", (first.id,))[0][0] >= 1
    charged = w.sql("SELECT sum(amount) FROM quota_charges WHERE reservation_id = %s AND resource = 'gpu'",
                    (first.id,))[0][0]
    assert charged == 2
    changed = w.create_request(key="same", count=3, start=first.during.start or w.later(2))
    assert refused(w.user.res, "Create", changed)[1] == "CONFLICT"
    lapse(w)
    request.wait.CopyFrom(pb.Wait(timeout_ms=20_000))
    third = w.user.res("Create", request)
    assert (third.id, third.state) == (first.id, "placed")
    check_invariants(w.conninfo, w.tenant)


def test_a_quota_lowered_while_queued_keeps_the_charge_and_places(world: World) -> None:
    """Quota is charged before placement and kept while queued, as while pending: lowering the
    limit refuses new creates but takes nothing from a reservation already charged."""
    w = world
    held_by_other(w)
    r = w.create(count=4, start=w.later(2))
    assert r.state == "queued"
    w.quota(0)
    assert refused(w.create, count=1)[1] == "QUOTA_EXCEEDED"
    lapse(w)
    assert eventually(w, r.id, lambda x: x.state != "queued", seconds=30).state == "placed"
    assert used_gpus(w) == 4
    assert release(w, r.id).state == "released"
    assert used_gpus(w) == 0
    check_invariants(w.conninfo, w.tenant)


def test_a_queued_reservation_of_a_tenant_whose_offer_was_withdrawn_runs_its_course(
        stack: tuple[ServerThread, Client], world: World) -> None:
    server, root = stack
    owner = world
    guest = make_world(server.endpoint, root, server.conninfo, nodes=0)
    root.admin("OfferPool", apb.OfferPoolRequest(pool_id=owner.pool_id, tenant_id=guest.tenant))
    held_by_other(owner)
    r = guest.create(count=2, start=guest.later(2), pool_id=owner.pool_id)
    assert r.state == "queued"
    root.admin("WithdrawPoolOffer", apb.WithdrawPoolOfferRequest(pool_id=owner.pool_id, tenant_id=guest.tenant))
    lapse(owner)
    placed = eventually(guest, r.id, lambda x: x.state != "queued", seconds=30)
    assert placed.state == "placed"
    assert release(guest, r.id).state == "released"
    check_invariants(guest.conninfo, guest.tenant)
    guest.close()


def test_a_queued_create_waiting_while_its_pool_leaves_the_lease_placer_is_placed(world: World) -> None:
    """No API switches a pool's placer (CreatePool sets it); an operator's UPDATE of pools.policy
    does. A pool switched to inline while a create waited on its queued reservation had no placer
    for it (the lease workers took lease pools only, the pending retry takes pending rows only):
    it stayed queued for ever, and the wait answered queued. A pool with queued reservations is
    still taken and drained; switched back, it queues and places new creates as before."""
    w = world
    held_by_other(w)
    request = w.create_request(key="switched", count=2, start=w.later(2), wait=pb.Wait(timeout_ms=20_000))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(w.user.res, "Create", request)
        poll(lambda: w.sql("SELECT state FROM reservations WHERE idempotency_key = 'switched'") == [("queued",)],
             15, "the create queued")
        w.sql("UPDATE pools SET policy = policy || '{\"placer\": \"inline\"}' WHERE id = %s", (w.pool_id,))
        lapse(w)
        r = waiting.result(timeout=30)
    assert (r.state, r.operation.state) == ("placed", "succeeded")
    assert w.create(count=1, start=w.later(2)).state == "placed", "inline now"
    w.sql("UPDATE pools SET policy = policy || '{\"placer\": \"lease\"}' WHERE id = %s", (w.pool_id,))
    again = w.create(count=1, start=w.later(2))
    assert again.state == "queued"
    assert eventually(w, again.id, lambda x: x.state != "queued", seconds=30).state == "placed"
    check_invariants(w.conninfo, w.tenant)


def test_a_cancel_under_way_when_the_batch_comes_is_skipped_and_ends_it(world: World) -> None:
    """The other order: the cancel holds the row (held up inside its refund) when the holder's
    batch runs; the batch skips the row, places the rest, and the cancel ends it, nothing booked."""
    w = world
    held_by_other(w)
    start = w.later(2)
    doomed, other = (w.create(count=2, start=start) for _ in range(2))
    with ThreadPoolExecutor(1) as pool, psycopg.connect(w.conninfo) as holder:
        holder.execute("SELECT 1 FROM quota_charges WHERE reservation_id = %s FOR UPDATE", (doomed.id,))
        cancelling = pool.submit(outcome, cancel, w, doomed.id)
        poll(lambda: waiting_sessions(w) >= 1, 15, "the cancel waiting inside its refund")
        lapse(w)
        assert eventually(w, other.id, lambda x: x.state != "queued", seconds=30).state == "placed"
        holder.rollback()
        out = cancelling.result(timeout=30)
    assert isinstance(out, pb.Reservation) and out.state == "cancelled", out
    assert w.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (doomed.id,))[0][0] == 0
    check_invariants(w.conninfo, w.tenant)


def test_a_row_the_batch_skipped_whose_holder_let_go_is_placed_without_a_new_create(world: World) -> None:
    """A transaction held the queued row (as a cancel that then failed would) when the batch ran:
    the batch skipped it, and nothing queued after; the lease worker's tick places it."""
    w = world
    held_by_other(w)
    r = w.create(count=2, start=w.later(2))
    with psycopg.connect(w.conninfo) as holder:
        holder.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (r.id,))
        with capture_logs() as logs:
            lapse(w)
            poll(lambda: any(e["event"] == "pool lease taken" for e in logs), 15, "the lease taken")
        assert w.sql("SELECT state FROM reservations WHERE id = %s", (r.id,)) == [("queued",)]
        holder.rollback()
    assert eventually(w, r.id, lambda x: x.state != "queued", seconds=30).state == "placed"
