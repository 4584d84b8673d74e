"""BookingRepair: before a placed reservation starts, move its booking off hardware that went bad.

Checked at start - 15 min and at the start. The caller holds the pool lock (taken first, keeping
capacity's lock order) and the reservation row lock.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import events
from controlplane.placement import placer
from controlplane.reservations import placing, schedule
from controlplane.runtime import Runtime

# Nodes of the reservation's live allocations that are no longer fit to serve them.
_BAD_NODES = """
SELECT DISTINCT al.node_id
FROM allocations al
JOIN nodes n ON n.id = al.node_id
LEFT JOIN bookings b ON b.allocation_id = al.id
LEFT JOIN atoms a ON a.id = b.atom_id
WHERE al.reservation_id = %(id)s AND al.state = 'placed'
  AND (n.state <> 'ready' OR n.connectivity = 'unreachable' OR a.health <> 'healthy' OR NOT a.bookable)
"""
_LIVE_NODES = "SELECT node_id FROM allocations WHERE reservation_id = %(id)s AND state = 'placed' ORDER BY id"
_DROP_BOOKINGS = """
DELETE FROM bookings b USING allocations al
WHERE al.id = b.allocation_id AND al.reservation_id = %(id)s AND al.state = 'placed'
"""
_RELEASE_ALLOCATIONS = "UPDATE allocations SET state = 'released' WHERE reservation_id = %(id)s AND state = 'placed'"


async def bad_nodes(conn: AsyncConnection, rid: str) -> list[str]:
    return [r["node_id"] for r in await (await conn.execute(_BAD_NODES, {"id": rid})).fetchall()]


async def repair(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], bad: list[str], now_ms: int) -> bool:
    """Release the allocations and place again for the same window, avoiding `bad` nodes; the quota
    charge is kept. True when it stays placed, False when it went pending (BookingRepairFailed)."""
    params = {"id": row["id"]}
    left = [r["node_id"] for r in await (await conn.execute(_LIVE_NODES, params)).fetchall()]
    await conn.execute(_DROP_BOOKINGS, params)
    await conn.execute(_RELEASE_ALLOCATIONS, params)
    ask, placement = await placing.place_again(
        conn, rt, row, (row["during_start"], row["during_end"]), frozenset(bad), now_ms)
    if placement is None:
        message = f"booking repair found no replacement for {', '.join(bad)}: " + await placer.explain(conn, ask)
        await placing.go_pending(conn, row, "BookingRepairFailed", message, now_ms)
        return False
    await conn.execute("UPDATE reservations SET version = version + 1, updated_at = clock_timestamp()"
                       " WHERE id = %(id)s", params)
    await events.emit_reservation(conn, row, "reservation.repaired", **{"from": left, "nodeIds": [placement.node_id]})
    await schedule.at(conn, row["id"], row["during_start"])
    return True
