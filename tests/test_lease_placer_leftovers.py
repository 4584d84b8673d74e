"""Leftovers of the hostile review of the pool-lease placer (DESIGN.md section 9, spec "Waiting for
placement", "Start, lease, extend and release"): a batch that waited for the pool lock counts the
window and the lease from when it places, not from its transaction's start. Real control plane
with clock control on a database of each test's own, real gRPC, real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import pool_locked
from tests.support import Client, ServerThread, World, clock_now, eventually, make_world
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
    with psycopg.connect(w.conninfo) as blocker:
        blocker.execute("""
            WITH r AS (INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,
                                                 request_hash)
                       SELECT 'rsv_blocker' || %(t)s, %(t)s, %(pool)s, i.id, 'blocker', '{}'::jsonb, 'x'
                       FROM identities i WHERE i.id = %(owner)s RETURNING id),
                 al AS (INSERT INTO allocations (id, reservation_id, node_id, device_ids)
                        SELECT 'alloc_blocker' || %(t)s, id, %(node)s, '{}' FROM r RETURNING id)
            INSERT INTO bookings (atom_id, allocation_id, during)
            SELECT (SELECT min(id) FROM atoms WHERE node_id = %(node)s), id,
                   tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(start)s + 60000), '[)') FROM al""",
                        {"t": w.tenant, "pool": w.pool_id, "owner": w.user_id, "node": w.nodes[0].id, "start": start})
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
