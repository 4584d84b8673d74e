"""Node rows: registered by an operator (with their GPUs), created at enrolment, listed, marked
revoked and readmitted. Validation of the operator's input stays with the caller
(controlplane.admin); these take checked values."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from controlplane import db, db_errors, errors
from controlplane.common.locks import pool_lock
from controlplane.ids import new_id
from controlplane.nodes import queries, shared_atoms
from controlplane.nodes.locking import lock_for_placement_change


async def node(conn: AsyncConnection, node_id: str) -> dict[str, Any] | None:
    """The node as the Admin API shows it (with its GPU count)."""
    return await (await conn.execute(queries.NODE, {"id": node_id, "pool": None})).fetchone()


async def list_pool(pool: AsyncConnectionPool, pool_id: str) -> list[dict[str, Any]]:
    async with db.read_only(pool) as conn:
        return await (await conn.execute(queries.NODE, {"id": None, "pool": pool_id})).fetchall()


async def register(pool: AsyncConnectionPool, *, pool_id: str, name: str, labels: dict[str, Any],
                   capabilities: list[str], gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """A node and its GPU atoms, under the pool's lock (new atoms are new capacity: the pool's
    pending reservations retry at once)."""
    node_id = new_id("node")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await pool_lock(conn, pool_id)
        await conn.execute(queries.REGISTER, {
            "id": node_id, "pool_id": pool_id, "name": name, "labels": Jsonb(labels),
            "capabilities": capabilities, "inventory": Jsonb({"gpus": gpus})})
        await _hold_all(conn, node_id, [g["uuid"] for g in gpus])
        async with conn.cursor() as cur:
            await cur.executemany(queries.INSERT_GPU, [
                {"id": new_id("atom"), "node_id": node_id, "uuid": g["uuid"], "model": g.get("model") or "",
                 "numa_node": g.get("numa_node") or 0, "nvlink_domain": g.get("nvlink_domain") or ""}
                for g in gpus])
        await shared_atoms.apply(conn, node_id, pool_id, [shared_atoms.GpuParts(g["uuid"]) for g in gpus])
        await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": pool_id})
        return await node(conn, node_id)

    with db_errors.mapped(poolId=pool_id, name=name):  # nodes_pool_id_fkey, nodes_pool_id_name_key
        return await db.run_in_transaction(pool, work)


async def _hold_all(conn: AsyncConnection, node_id: str, uuids: list[str]) -> None:
    """The new node holds every GPU it is registered with; CONFLICT when another node holds one
    (controlplane.nodes.inventory: one device, one node)."""
    await conn.execute(queries.HOLD_GPUS, {"node_id": node_id, "uuids": sorted(uuids)})
    taken = await (await conn.execute(queries.HELD_ELSEWHERE, {"node_id": node_id, "uuids": uuids})).fetchone()
    if taken is not None:
        raise errors.Conflict("a GPU with this uuid is on another node", uuid=taken["device_uuid"],
                              nodeId=taken["node_id"])


async def exists(conn: AsyncConnection, node_id: str) -> bool:
    return await (await conn.execute(queries.EXISTS, {"node_id": node_id})).fetchone() is not None


async def for_enrolment(conn: AsyncConnection, pool_id: str, name: str) -> dict[str, Any]:
    """The node of this name in the pool (created, with no GPUs yet, when absent), its row locked:
    enrolments of one node run one after the other."""
    await conn.execute(queries.CREATE_NAMED, {"id": new_id("node"), "pool_id": pool_id, "name": name})
    found = await (await conn.execute(queries.BY_NAME, {"pool_id": pool_id, "name": name})).fetchone()
    return await (await conn.execute(queries.LOCK, {"node_id": found["id"]})).fetchone()


async def lock(conn: AsyncConnection, node_id: str) -> dict[str, Any] | None:
    """The node's row, locked (with its revoked mark): a renewal and a revocation of one node run
    one after the other."""
    return await (await conn.execute(queries.LOCK, {"node_id": node_id})).fetchone()


async def mark_revoked(conn: AsyncConnection, node_id: str, reason: str) -> None:
    """The node may not enrol again until it is readmitted (the first revocation's time and reason
    stay); the GPUs it held are let go. It is unreachable at once, under its pool's lock (nothing
    is placed on it from this commit; the reservations live on it wake and hear NodeUnreachable),
    until it is readmitted, enrolled again and heard from (node_seen, migration 0038)."""
    await lock_for_placement_change(conn, node_id)
    await conn.execute(queries.MARK_REVOKED, {"node_id": node_id, "reason": reason})
    await conn.execute(queries.SET_CONNECTIVITY, {"connectivity": "unreachable", "node_id": node_id})
    await conn.execute(queries.WAKE_RESERVATIONS, {"node_id": node_id})
    # Its GPUs are no longer held: another node (the machine enrolled anew) may report them.
    await conn.execute(queries.RELEASE_GPUS, {"node_id": node_id, "held": []})


async def readmit(conn: AsyncConnection, node_id: str) -> bool:
    """True when the node was revoked and may now enrol again."""
    return await (await conn.execute(queries.READMIT, {"node_id": node_id})).fetchone() is not None
