"""The moments that matter to a reservation, written as work items for the reconciler."""

from __future__ import annotations

from psycopg import AsyncConnection

REPAIR_LEAD_MS = 15 * 60 * 1000     # BookingRepair checks 15 minutes before the start
BIND_TIMEOUT_MS = 5 * 60 * 1000     # a node has 5 minutes to report its devices bound
ACTIVE_RECHECK_MS = 15 * 60 * 1000  # an active reservation is rechecked every 15 minutes

# A moment already past is due now, not at its past time: the queue runs due items oldest run_at
# first, so a past run_at would jump ahead of every wake-up already waiting (node reports
# included) and starve them while creates keep coming.
# One statement (it runs inside create's pool-locked commit, where every round trip counts).
_AT = """
SELECT schedule_work('reservation', %(id)s, due)
FROM (SELECT DISTINCT greatest(from_epoch_ms(m), compute_now()) AS due
      FROM unnest(%(moments)s::bigint[]) AS m) moments
"""


async def at(conn: AsyncConnection, rid: str, *moments: int | None) -> None:
    """Wake the reservation at each moment; the moments already past collapse into one, now."""
    wanted = [m for m in moments if m is not None]
    if wanted:
        await conn.execute(_AT, {"id": rid, "moments": wanted})


async def booked_moments(
    conn: AsyncConnection, rid: str, start_ms: int, end_ms: int, lease_deadline_ms: int | None
) -> None:
    """start - 15 min, start, end and the lease deadline of a placed reservation."""
    await at(conn, rid, start_ms - REPAIR_LEAD_MS, start_ms, end_ms, lease_deadline_ms)
