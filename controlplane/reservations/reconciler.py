"""The capacity.reservations reconciler: drives one reservation at the moments that matter.

Woken by work items (start - 15 min, start, bind deadline, end, lease deadline, confirmation
deadline, node changes, node reports). It re-reads everything and does what is due at
compute_now(), so a duplicate or late wake-up is harmless. An active reservation is never
released for node trouble: the reconciler only sets and clears conditions.
"""

from __future__ import annotations

from psycopg import AsyncConnection

from controlplane import db
from controlplane.common.locks import pool_lock
from controlplane.metal import is_node_lease
from controlplane.metal import lifecycle as node_lease
from controlplane.reservations import binding, preemption, queries, repair, schedule, states
from controlplane.reservations.lifecycle import end_over, end_pending_victim, over_at
from controlplane.reservations.transitions import expire_confirmation
from controlplane.runtime import Runtime


async def reconcile(conn: AsyncConnection, rt: Runtime, rid: str) -> None:
    """Most passes place nothing (start a binding, judge reports, activate, end, set conditions)
    and need only the reservation's row lock. A pass that must place (BookingRepair, a binding
    failure) is rolled back to its savepoint, releasing that row lock, and run again taking the
    pool lock first, in capacity's lock order. The pool lock is shared with every create of the
    pool, so taking it only when needed keeps the worker from queueing behind them."""
    try:
        async with conn.transaction():
            await _reconcile(conn, rt, rid, may_place=False)
    except binding.NeedsPoolLock:
        await _reconcile(conn, rt, rid, may_place=True)


async def _reconcile(conn: AsyncConnection, rt: Runtime, rid: str, *, may_place: bool) -> None:
    # The first pass locks the row at once, reading the clock with it (one round trip); the pass
    # that may place reads it unlocked first, to take the pool lock before the row's.
    row = await (await conn.execute(queries.BY_ID if may_place else queries.BY_ID_LOCKED_NOW, {"id": rid})).fetchone()
    if row is None:
        return
    now_ms = row.pop("now_ms", None)
    if row["state"] == states.AWAITING_CONFIRMATION:
        await expire_confirmation(conn, row)
        return
    if row["state"] == states.PENDING:  # woken at the cut of a victim pending since BookingRepair
        if preemption.cut_of(row) is None or not preemption.notice_over(
                row, now_ms if now_ms is not None else await db.now_ms(conn)):
            return
        if not may_place:
            raise binding.NeedsPoolLock  # its end takes its notices: the pool lock first
        await end_pending_victim(conn, row)
        return
    if row["state"] not in states.BOOKED:
        return
    if may_place:
        await pool_lock(conn, row["pool_id"])  # lock order: pool, then reservation
        row = await (await conn.execute(queries.BY_ID_FOR_UPDATE, {"id": rid})).fetchone()
        if row is None or row["state"] not in states.BOOKED:
            return
        now_ms = await db.now_ms(conn)

    over = over_at(row, now_ms)
    if over is not None:
        if not may_place and await preemption.noticed(conn, rid):
            # Its end takes the notices it gave (giving victims their time back books) or was
            # under, as a release does after the pool lock: run again taking that lock first.
            raise binding.NeedsPoolLock
        await end_over(conn, row, over)
        return
    if is_node_lease(row["request"]):  # from its start the node is metal's (controlplane.metal)
        await node_lease.reconcile(conn, rt, row, now_ms, may_place=may_place)
        return
    if row["state"] == states.PLACED:
        if now_ms >= row["during_start"] - schedule.REPAIR_LEAD_MS:
            bad = await repair.bad_nodes(conn, row)
            if bad and not may_place:
                raise binding.NeedsPoolLock
            if bad:
                if not await repair.repair(conn, rt, row, bad, now_ms):
                    return
                row = await (await conn.execute(queries.BY_ID, {"id": rid})).fetchone()
        if now_ms >= row["during_start"]:
            await binding.start(conn, rt, row, now_ms, may_place=may_place)
    elif row["state"] == states.BINDING:
        await binding.progress(conn, rt, row, now_ms, may_place=may_place)
    elif row["state"] == states.ACTIVE:
        await binding.recheck_active(conn, rt, row, now_ms)

