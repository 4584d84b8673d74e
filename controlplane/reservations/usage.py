"""What the metering ledger needs of GPU reservations: when each was active, on how many GPUs.

A reservation is billed from the moment it became active (its reservation.active event, never
before the start of its window: nothing while placed or binding) until its window ends; release,
expiry and preemption truncate the window at that moment, so billing stops there. A lease
deadline that passed ends it too, though the reconciler may not have released it yet (a lapse is
dated at its deadline): a lease renewed in time has moved its deadline past any hour billed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from psycopg import AsyncConnection

# Reservations active at some time in [from, to): the stretch and the GPUs (whole-GPU equivalents
# of the distinct atoms it booked for the stretch: the bookings of a node that failed to bind,
# which ended before it was active, are not billed beside the ones it was placed on again).
_ACTIVE_IN = """
SELECT r.id, r.tenant_id, r.pool_id, p.region,
       greatest(e.time, lower(r.during)) AS active_from, least(upper(r.during), r.lease_deadline) AS active_until,
       (SELECT coalesce(sum(a.gpu_equivalent), 0) FROM atoms a
        WHERE a.id IN (SELECT b.atom_id FROM bookings b JOIN allocations al ON al.id = b.allocation_id
                       WHERE al.reservation_id = r.id
                         AND b.during && tstzrange(greatest(e.time, lower(r.during)), upper(r.during)))) AS gpus
FROM reservations r
JOIN pools p ON p.id = r.pool_id
CROSS JOIN LATERAL (SELECT min(ev.time) AS time FROM events ev
                    WHERE ev.subject = 'reservation/' || r.id AND ev.type = 'reservation.active') e
WHERE r.during && tstzrange(%(from)s, %(to)s) AND e.time IS NOT NULL AND e.time < %(to)s
  AND greatest(e.time, lower(r.during)) < least(upper(r.during), r.lease_deadline)
"""


async def active_gpu_stretches(conn: AsyncConnection, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Every reservation active at some time in [start, end): id, tenant_id, pool_id, region,
    active_from, active_until, gpus."""
    return await (await conn.execute(_ACTIVE_IN, {"from": start, "to": end})).fetchall()
