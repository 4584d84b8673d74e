"""What an operator says about a node's schedulability: cordon (state) and GPU health. Each change
takes the node's pool lock first, as inventory does, so a placement that re-reads them under that
lock never sees them change before it commits; then the reservations on the node wake."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db, errors
from controlplane.nodes import queries, registry
from controlplane.nodes.locking import lock_for_placement_change


async def set_state(pool: AsyncConnectionPool, node_id: str, state: str) -> dict[str, Any]:
    """`ready` or `cordoned`; back to ready, the pool's pending reservations retry now. A leased
    node (controlplane.nodes.tenancy) is INVALID_STATE until it is back from its tenant."""

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        node = await lock_for_placement_change(conn, node_id)
        if node is None:
            raise errors.NotFound("no such node", nodeId=node_id)
        if (await conn.execute(queries.SET_STATE, {"state": state, "node_id": node_id})).rowcount == 0:
            raise errors.InvalidState("the node is leased to a tenant (a whole-machine lease) until metal saw it "
                                      "wiped; cordon it after that", nodeId=node_id, state="leased")
        await conn.execute(queries.WAKE_RESERVATIONS, {"node_id": node_id})
        if state == "ready":
            await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": node["pool_id"]})
        return await registry.node(conn, node_id)

    return await db.run_in_transaction(pool, work)


async def set_gpu_health(pool: AsyncConnectionPool, node_id: str, device_uuid: str, health: str) -> dict[str, Any]:
    """Quarantine or restore a GPU (and its MIG instances and slots); restored, the pool's pending
    reservations retry now."""

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        node = await lock_for_placement_change(conn, node_id)
        changed = 0 if node is None else (await conn.execute(
            queries.SET_GPU_HEALTH, {"health": health, "node_id": node_id, "device_uuid": device_uuid})).rowcount
        if changed == 0:
            raise errors.NotFound("no such GPU on that node", nodeId=node_id, deviceUuid=device_uuid)
        await conn.execute(queries.WAKE_RESERVATIONS, {"node_id": node_id})
        if health == "healthy":  # back in service: the pool's pending reservations retry now
            await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": node["pool_id"]})
        return await registry.node(conn, node_id)

    return await db.run_in_transaction(pool, work)
