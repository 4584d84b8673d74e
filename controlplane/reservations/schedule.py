"""The moments that matter to a reservation, written as work items for the reconciler."""

from __future__ import annotations

from psycopg import AsyncConnection

REPAIR_LEAD_MS = 15 * 60 * 1000     # BookingRepair checks 15 minutes before the start
BIND_TIMEOUT_MS = 5 * 60 * 1000     # a node has 5 minutes to report its devices bound
ACTIVE_RECHECK_MS = 15 * 60 * 1000  # an active reservation is rechecked every 15 minutes

# A moment already past is due now, not at its past time: the queue runs due items oldest run_at
# first, so a past run_at would jump ahead of every wake-up already waiting (node reports
# included) and starve them while creates keep coming.
_AT = "SELECT schedule_work('reservation', %s, greatest(from_epoch_ms(%s), compute_now()))"
_NOW_MS = "SELECT epoch_ms(compute_now()) AS now_ms"


async def at(conn: AsyncConnection, rid: str, *moments: int | None) -> None:
    """Wake the reservation at each moment; the moments already past collapse into one, now."""
    now_ms = (await (await conn.execute(_NOW_MS)).fetchone())["now_ms"]
    due = {max(m, now_ms) for m in moments if m is not None}
    for moment in sorted(due):
        await conn.execute(_AT, (rid, moment))


async def booked_moments(
    conn: AsyncConnection, rid: str, start_ms: int, end_ms: int, lease_deadline_ms: int | None
) -> None:
    """start - 15 min, start, end and the lease deadline of a placed reservation."""
    await at(conn, rid, start_ms - REPAIR_LEAD_MS, start_ms, end_ms, lease_deadline_ms)
