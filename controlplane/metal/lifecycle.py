"""The reconciler's part of a node lease (spec 004, BookingRepair: "A node lease is judged by
whether its node is still leasable, and only before its window begins, because from then on the
node is metal's to deploy").

- placed, from 15 minutes before the start until the deploy begins: a node no longer leasable is
  repaired (re-placed for the same window, avoiding it), as any booking. Checked at the start too,
  before the deploy: a machine another lease still holds (leased, not yet seen wiped: a lease of
  the minutes before this one's start began after the check 15 minutes before) is never deployed;
- at the start: metal's deploy begins (no bind deadline of five minutes, no re-placement);
- binding: the metal worker drives it; a wake-up only nudges the worker;
- active: conditions of its nodes, as for any reservation (node reports never bind a node lease).
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane.metal import deploy, placement
from controlplane.reservations import binding, repair, schedule, states
from controlplane.runtime import Runtime


async def reconcile(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], now_ms: int, *, may_place: bool) -> None:
    if row["state"] == states.PLACED:
        if now_ms >= row["during_start"] - schedule.REPAIR_LEAD_MS:
            bad = await placement.not_leasable(conn, row["id"])
            if bad and not may_place:
                raise binding.NeedsPoolLock
            if bad and not await repair.repair(conn, rt, row, bad, now_ms):
                return
        if now_ms < row["during_start"]:
            return
        if not may_place:  # the node's state changes: the pool lock first
            raise binding.NeedsPoolLock
        await deploy.begin(conn, rt, row, now_ms)
    elif row["state"] == states.BINDING:
        await deploy.nudge(conn, row)
    elif row["state"] == states.ACTIVE:
        await binding.recheck_active(conn, rt, row, now_ms)
