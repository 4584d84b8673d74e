"""The locks of a one-node inline placement (migration 0057): it holds its pool's lock shared and
its node's lock exclusively, so placements on other nodes of the pool go on beside it, a second
placement on the same node waits for it, and every change that takes the pool lock exclusively
still waits for both (and they for it). Its quota charge comes last, and a refused one leaves
nothing of the placement behind."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from controlplane.ids import draft_id
from tests.promise_support import pool_locked
from tests.support import ServerThread, World, refused
from tests.test_hostile_time import lock_waited


@contextlib.contextmanager
def placing_on(world: World, node_id: str) -> Iterator[None]:
    """Hold the locks a one-node placement on `node_id` holds until it commits (the pool's shared,
    the node's exclusive: place_inline's first two statements), in a transaction of the test's own."""
    with psycopg.connect(world.conninfo) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock_shared(hashtextextended(%s, 0))", ("pool:" + world.pool_id,))
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(node_lock_key(%s), 0))", (node_id,))
        yield


def node_of(world: World, rid: str) -> str:
    return world.sql("SELECT node_id FROM allocations WHERE reservation_id = %s", (rid,))[0][0]


def full_and_free(world: World, server: ServerThread) -> tuple[str, str, int]:
    """Fill one of the world's two nodes for four hours from tomorrow: (the full node, the free
    one, the start), once the capacity index has heard of it. The index learns of a placement by
    its notification: a create planned before that could pick the full node, and wait for the
    node's lock the test holds for as long as the test waits for its answer. Tomorrow, not now: a
    reservation starting now is bound by the worker at once, which takes the pool's lock
    exclusively, and a shared request queues behind that waiter (make test failed on it)."""
    start = world.later()
    full = node_of(world, world.create(count=8, duration="4h", start=start).id)
    free = next(n.id for n in world.nodes if n.id != full)
    server.call(server.app.runtime.capacity.barrier())
    return full, free, start


def test_a_placement_on_another_node_does_not_wait_for_one_in_flight(world: World, server: ServerThread) -> None:
    """With a placement in flight on the full node, a create (which can only go to the free node)
    is placed while it still holds its locks: it took the pool lock shared, not exclusively."""
    full, free, start = full_and_free(world, server)
    for _ in range(3):
        with ThreadPoolExecutor(1) as pool, placing_on(world, full):
            answer = pool.submit(world.create, count=2, start=start)
            try:
                placed = answer.result(timeout=5)  # before the block ends: nothing waited for it
                break
            except TimeoutError:
                # A worker's job (node registration's follow-ups, a binding) asked for the pool's
                # lock exclusively meanwhile: it waits for the test's shared hold, and the create's
                # shared request queues behind it. Not this promise: try again once it is through.
                if not world.sql("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock'"
                                 " AND NOT granted AND ((classid::bigint << 32) | objid::bigint)"
                                 " = hashtextextended(%s, 0)", ("pool:" + world.pool_id,)):
                    placed = answer.result(timeout=25)  # nothing else in the way: this must not wait
                    break
    else:
        pytest.fail("a worker's exclusive pool lock came in the way three times")
    assert placed.state == "placed"
    assert node_of(world, placed.id) == free


def test_a_placement_on_the_same_node_waits_for_the_one_in_flight(world: World, server: ServerThread) -> None:
    """A create whose only fit is the node another placement holds waits for that one's commit,
    then is placed there: two placements on one node never decide beside each other (its host
    bookings' sum is checked against what is committed)."""
    full, free, start = full_and_free(world, server)
    with ThreadPoolExecutor(1) as pool:
        with placing_on(world, free):
            answer = pool.submit(world.create, count=2, start=start)
            lock_waited(world, "advisory")
            assert not answer.done()
        placed = answer.result(timeout=30)
    assert placed.state == "placed"
    assert node_of(world, placed.id) == free


def test_the_pool_lock_held_exclusively_still_holds_every_one_node_placement(world: World) -> None:
    """A change that takes the pool lock exclusively (node, atom and label changes, gangs,
    repairs, extends, the lease holder's batches) excludes one-node placements on every node."""
    with ThreadPoolExecutor(1) as pool:
        with pool_locked(world):
            answer = pool.submit(world.create, count=1)
            lock_waited(world, "advisory")
            assert not answer.done()
        assert answer.result(timeout=30).state == "placed"


def test_a_quota_refusal_in_the_one_statement_placement_leaves_nothing_of_it(world: World) -> None:
    """The charge is the placement's last step: a refusal undoes the allocation, its bookings,
    wake-ups and event written before it, and the draft stays a draft (decided again on retry)."""
    world.quota(3)
    world.create(count=2)
    code, reason, details = refused(world.create, key="over", count=2)
    assert reason == "QUOTA_EXCEEDED", details
    rid = draft_id(world.tenant, world.user_id, "over")
    assert world.sql("SELECT state FROM reservations WHERE id = %s", (rid,)) == [("draft",)]
    assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (rid,)) == [(0,)]
    assert world.sql("SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
                     " WHERE a.reservation_id = %s", (rid,)) == [(0,)]
    assert world.sql("SELECT count(*) FROM work_items WHERE subject = %s", (rid,)) == [(0,)]
    assert world.sql("SELECT count(*) FROM events WHERE subject = %s", ("reservation/" + rid,)) == [(0,)]
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s", (rid,)) == [(0,)]
    world.quota(4)  # room now: the same key is decided again and placed
    assert world.create(key="over", count=2).state == "placed"
