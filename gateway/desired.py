"""A node's desired state: its generation and every allocation it should hold now (binding or
bound, with a booking that ends after compute_now()), read in one snapshot so a generation is
never sent with assignments older than it."""

from __future__ import annotations

from typing import Any

from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2

_GENERATION = "SELECT desired_generation FROM nodes WHERE id = %(node_id)s"
_ASSIGNMENTS = """
SELECT a.id, a.device_ids, a.limits, r.request->>'binding' AS binding,
       epoch_ms(max(upper(b.during))) AS until
FROM allocations a
JOIN reservations r ON r.id = a.reservation_id
JOIN bookings b ON b.allocation_id = a.id
WHERE a.node_id = %(node_id)s AND a.state IN ('binding', 'bound')
GROUP BY a.id, r.request
HAVING max(upper(b.during)) > compute_now()
ORDER BY a.id
"""

_BINDINGS = {"kubernetes": node_pb2.BINDING_KUBERNETES}


def _limits(raw: dict[str, Any]) -> node_pb2.Limits:
    return node_pb2.Limits(
        cpu_millis=int(raw.get("cpu_millis") or 0), memory_bytes=int(raw.get("memory_bytes") or 0),
        hugepages_1gi=int(raw.get("hugepages_1gi") or 0), cpus=str(raw.get("cpus") or ""),
        mems=str(raw.get("mems") or ""))


def assignment(row: dict[str, Any]) -> node_pb2.DeviceAssignment:
    return node_pb2.DeviceAssignment(
        allocation_id=row["id"], device_ids=row["device_ids"], until=row["until"],
        binding=_BINDINGS.get(row["binding"] or "", node_pb2.BINDING_HOLD),
        limits=_limits(row["limits"] or {}), device_class="gpu")


async def read(pool: AsyncConnectionPool, node_id: str) -> node_pb2.DesiredState:
    async with pool.connection() as conn:
        async with conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            generation = await (await conn.execute(_GENERATION, {"node_id": node_id})).fetchone()
            rows = await (await conn.execute(_ASSIGNMENTS, {"node_id": node_id})).fetchall()
    return node_pb2.DesiredState(generation=generation["desired_generation"] if generation else 0,
                                 assignments=[assignment(r) for r in rows])
