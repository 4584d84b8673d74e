"""A machine a tenant holds (a whole-machine lease, controlplane.metal): its node is `leased` from
the lease's start until metal saw the machine wiped after it. A leased node is not schedulable
(placement takes only `ready` nodes) and its certificates carry the role `node-tenant`: the PKI
reads the node's state when it renews a certificate, so the node never chooses its role. Each
change hints the node's sessions to renew (`bc_node_renew`), which is when the role changes.

The caller holds the node's pool lock (a node's state is a placement fact).
"""

from __future__ import annotations

from psycopg import AsyncConnection

from controlplane.nodes import queries

LEASED = "leased"
# The node's sessions send it a RenewHint (the gateway's hub listens).
RENEW_CHANNEL = "bc_node_renew"


async def lease(conn: AsyncConnection, node_id: str) -> str:
    """The node becomes its tenant's; returns the state it had (to return to after the wipe)."""
    row = await (await conn.execute(queries.LEASE, {"node_id": node_id})).fetchone()
    await conn.execute(queries.NOTIFY_SESSIONS, {"channel": RENEW_CHANNEL, "node_id": node_id})
    return row["before"] if row and row["before"] != LEASED else "ready"


async def unlease(conn: AsyncConnection, node_id: str, state: str) -> bool:
    """Back to the platform in `state` (ready or cordoned); the pool's pending reservations retry."""
    row = await (await conn.execute(queries.UNLEASE, {"node_id": node_id, "state": state})).fetchone()
    if row is None:
        return False
    await conn.execute(queries.NOTIFY_SESSIONS, {"channel": RENEW_CHANNEL, "node_id": node_id})
    await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": row["pool_id"]})
    return True


async def forget_tenants_word(conn: AsyncConnection, node_id: str) -> None:
    """A machine wiped after its tenant had root on it (its keys are all revoked): what its last
    inventory says (sizes, NUMA lists, disk) was the tenant's to write, and counted as the
    platform's once the node is no longer leased (a pool's per-GPU host share is the smallest any
    of its hosts gives). Until the machine is enrolled anew and reports itself, the node has no
    inventory and no host resources (it books none and is left out of the share), and it is
    unreachable (nothing is placed on it; its next hello connects it again)."""
    await conn.execute(queries.FORGET_INVENTORY, {"node_id": node_id})
    await conn.execute(queries.DELETE_HOST_RESOURCES, {"node_id": node_id})
    await conn.execute(queries.SET_CONNECTIVITY, {"connectivity": "unreachable", "node_id": node_id})
