"""The moments that matter to a reservation, written as work items for the reconciler."""

from __future__ import annotations

from psycopg import AsyncConnection

from controlplane.reservations import queries

REPAIR_LEAD_MS = 15 * 60 * 1000     # BookingRepair checks 15 minutes before the start
BIND_TIMEOUT_MS = 5 * 60 * 1000     # a node has 5 minutes to report its devices bound
ACTIVE_RECHECK_MS = 15 * 60 * 1000  # an active reservation is rechecked every 15 minutes


async def at(conn: AsyncConnection, rid: str, *moments: int | None) -> None:
    """Wake the reservation at each moment; the moments already past collapse into one, now."""
    wanted = [m for m in moments if m is not None]
    if wanted:
        await conn.execute(queries.WAKE_AT, {"id": rid, "moments": wanted})


def booked_moment_list(start_ms: int, end_ms: int, lease_deadline_ms: int | None,
                       now_ms: int | None = None) -> list[int]:
    """start - 15 min (BookingRepair's check), start, end and the lease deadline of a placed
    reservation, for a caller that schedules them in its own statement. Given the clock it places
    at, the repair check's moment is left out when it has passed: it would be due at once, in a
    pass that finds the start not reached (the nodes were just placed on), and the pass at the
    start runs the repair check first anyway."""
    lead = start_ms - REPAIR_LEAD_MS
    moments = [None if now_ms is not None and lead <= now_ms else lead, start_ms, end_ms, lease_deadline_ms]
    return [m for m in moments if m is not None]
