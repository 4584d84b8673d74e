"""The pool lock, and the one lock order every transaction follows.

Lock order, everywhere (DESIGN §17):

    pool advisory lock -> (a node's advisory lock) -> reservation row -> quota rows
        -> allocation rows -> node rows

A reservation's confirmation request hangs off its row: release, cancel, admission, the
reconciler's expiry (`expire_confirmation`) and offboarding all lock the reservation row before
its confirmation (the expiry and offboarding took the confirmation first and deadlocked with a
release; tests/test_surface_leftovers.py).

A one-node inline placement (place_inline, migration 0057) takes the pool lock SHARED and then
its node's own advisory lock (SQL `node_lock_key`: 'node:' and the id) exclusively: one-node
placements on different nodes of a pool go on beside each other, two on one node wait for each
other, and every holder of the pool lock in its exclusive mode (everything below, the general
path, gangs, repairs, extends, preemption, the lease holder's batches) still excludes them all.
Nothing else takes a node's lock, and nothing takes it before the pool lock. Its quota charge
comes last, after its allocation and bookings: before it the placement holds only key-share
locks on the node's and the atoms' rows (its foreign keys), which only a deletion or a key
change waits for, and those are made under the pool lock held exclusively.

A transaction that needs the pool lock takes it first. Placement re-reads node state, labels and
atom health under it, so every change that affects placement (inventory, atoms, host resources,
GPU health, cordon, operator connectivity and labels) takes the node's pool lock before it locks
or writes the node's rows (controlplane.nodes). Liveness alone (heartbeats, the unreachable
sweeper) changes connectivity without it: placement re-checks connectivity under its lock, and
the reconciler handles a node lost at any time after a placement anyway.

A tenant's webhook lock (advisory, 'webhooks:' and the tenant id) comes after all of these: an
event writer takes it shared in its commit (the webhook fan-out, a deferred trigger: migration
0064), and Webhooks.Create and Webhooks.Delete exclusively in a transaction that locks nothing
else but its tenant's row in key-share mode (the foreign key; Delete, the webhook's row and its
deliveries, which an event writer's fan-out only inserts after the lock), which no event writer
locks beyond that.
"""

from __future__ import annotations

from psycopg import AsyncConnection


def pool_lock_key(pool_id: str) -> str:
    """The key of the pool's advisory lock, hashed with hashtextextended(key, 0)."""
    return "pool:" + pool_id


async def pool_lock(conn: AsyncConnection, pool_id: str) -> None:
    """The pool's transaction-scoped advisory lock (held until commit or rollback)."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (pool_lock_key(pool_id),))
