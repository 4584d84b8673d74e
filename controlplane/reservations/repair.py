"""BookingRepair: before a placed reservation starts, move its booking off hardware that went bad.

Checked at start - 15 min and at the start. The caller holds the pool lock (taken first, keeping
capacity's lock order) and the reservation row lock.

A gang first tries to replace only its bad members, with nodes of the same label value; when that
value has no room, the whole gang is placed again, on any value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import events
from controlplane.placement import gang
from controlplane.reservations import binding_queries, placing, preemption, schedule
from controlplane.runtime import Runtime


async def bad_nodes(conn: AsyncConnection, row: dict[str, Any]) -> list[str]:
    """The nodes of the placed allocations that can no longer run them: not ready, unreachable,
    a booked atom unhealthy or unbookable, its bcd no longer advertising a capability the
    request needs (a daemon downgraded since placement would drop the limits or the binding), or
    its inventory having changed the booking's shape since placement (the booked atoms no longer
    of the request's model or profile, nor in one NVLink domain for nvlink-all; a gang member out
    of the label value the gang was placed under)."""
    params = {"id": row["id"], "required": Jsonb(placing.required_labels(row["request"]))}
    return [r["node_id"] for r in await (await conn.execute(binding_queries.BAD_NODES, params)).fetchall()]


async def repair(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], bad: list[str], now_ms: int) -> bool:
    """Release the allocations and place again for the same window (from now when its start has
    passed), avoiding `bad` nodes; the quota charge is kept. True when it stays placed, False when
    it went pending (BookingRepairFailed)."""
    params = {"id": row["id"]}
    window = (row["during_start"], row["during_end"])
    members = gang.Gang.of(row["request"])
    moved = await _repair_members(conn, rt, row, members, bad, window, now_ms) if members else None
    if moved is not None:
        left, node_ids = moved
    else:
        left = [r["node_id"] for r in await (await conn.execute(binding_queries.LIVE_NODES, params)).fetchall()]
        await conn.execute(binding_queries.DROP_PLACED_BOOKINGS, params)
        await conn.execute(binding_queries.RELEASE_PLACED_ALLOCATIONS, params)
        # When the worker got there after the start (it ran late, or a wake-up was lost), from now:
        # the time already gone may have been another reservation's on the replacement nodes, and
        # it can no longer be used anyway. The end stays.
        window = (max(now_ms, row["during_start"]), row["during_end"])
        replaced = await placing.place_again_any(conn, rt, row, window, frozenset(bad), now_ms)
        if not replaced.node_ids:
            message = f"booking repair found no replacement for {', '.join(bad)}: " + replaced.reason
            await placing.go_pending(conn, row, "BookingRepairFailed", message, now_ms)  # a victim keeps its notice
            await schedule.at(conn, row["id"], preemption.cut_of(row))  # where a victim's notice ends it
            return False
        node_ids = replaced.node_ids
    if window[0] != row["during_start"]:
        await conn.execute(binding_queries.SET_WINDOW_START, {"id": row["id"], "start": window[0]})
        row["during_start"] = window[0]  # the caller goes on with this row (a node lease's deploy)
    await conn.execute(binding_queries.BUMP_VERSION, params)
    await events.emit_reservation(conn, row, "reservation.repaired", **{"from": left, "nodeIds": node_ids})
    await schedule.at(conn, row["id"], row["during_start"])
    return True


async def _repair_members(
    conn: AsyncConnection, rt: Runtime, row: dict[str, Any], members: gang.Gang, bad: list[str],
    window: tuple[int, int], now_ms: int,
) -> tuple[list[str], list[str]] | None:
    """Replace only the gang's members on `bad` nodes with nodes of the same label value, keeping
    the others: (nodes left, nodes taken), or None when that value has no room for them (nothing
    changed then: the replacements' savepoint rolled back)."""
    placed = await (await conn.execute(binding_queries.PLACED_MEMBERS, {"id": row["id"]})).fetchall()
    groups = {r["gang_group"] for r in placed}
    broken = [r for r in placed if r["node_id"] in bad]
    if len(groups) != 1 or None in groups or not broken or len(broken) == len(placed):
        return None
    (group,) = groups
    ask = dataclasses.replace(placing.ask_for(row, now_ms), start_ms=window[0], end_ms=window[1])
    avoid = frozenset(bad) | {r["node_id"] for r in placed}
    part = gang.Gang(len(broken), members.key)
    committed = await placing.commit_gang(conn, rt, row, ask, part, exclude=avoid, within=group)
    if committed.placements is None:
        return None
    ids = [r["id"] for r in broken]
    await conn.execute(binding_queries.DROP_BOOKINGS_OF, {"ids": ids})
    await conn.execute(binding_queries.RELEASE_ALLOCATIONS_OF, {"ids": ids})
    return [r["node_id"] for r in broken], committed.node_ids
