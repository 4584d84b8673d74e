"""BookingRepair: before a placed reservation starts, move its booking off hardware that went bad.

Checked at start - 15 min and at the start. The caller holds the pool lock (taken first, keeping
capacity's lock order) and the reservation row lock.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import events
from controlplane.reservations import placing, queries, schedule
from controlplane.runtime import Runtime


async def bad_nodes(conn: AsyncConnection, rid: str) -> list[str]:
    return [r["node_id"] for r in await (await conn.execute(queries.BAD_NODES, {"id": rid})).fetchall()]


async def repair(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], bad: list[str], now_ms: int) -> bool:
    """Release the allocations and place again for the same window, avoiding `bad` nodes; the quota
    charge is kept. True when it stays placed, False when it went pending (BookingRepairFailed)."""
    params = {"id": row["id"]}
    left = [r["node_id"] for r in await (await conn.execute(queries.LIVE_NODES, params)).fetchall()]
    await conn.execute(queries.DROP_PLACED_BOOKINGS, params)
    await conn.execute(queries.RELEASE_PLACED_ALLOCATIONS, params)
    ask, placement = await placing.place_again(
        conn, rt, row, (row["during_start"], row["during_end"]), frozenset(bad), now_ms)
    if placement is None:
        message = f"booking repair found no replacement for {', '.join(bad)}: " + await placing.explain(conn, row, ask)
        await placing.go_pending(conn, row, "BookingRepairFailed", message, now_ms)
        return False
    await conn.execute(queries.BUMP_VERSION, params)
    await events.emit_reservation(conn, row, "reservation.repaired", **{"from": left, "nodeIds": [placement.node_id]})
    await schedule.at(conn, row["id"], row["during_start"])
    return True
