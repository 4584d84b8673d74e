"""Reservation states and the transitions between them, as data (one place, checked in SQL)."""

from __future__ import annotations

DRAFT = "draft"
AWAITING_CONFIRMATION = "awaiting-confirmation"
PENDING = "pending"
QUEUED = "queued"
PLACED = "placed"
BINDING = "binding"
ACTIVE = "active"
DENIED = "denied"
RELEASED = "released"
FAILED = "failed"
CANCELLED = "cancelled"
EXPIRED = "expired"

TERMINAL = frozenset({DENIED, RELEASED, FAILED, CANCELLED, EXPIRED})
# States whose allocations hold bookings.
BOOKED = frozenset({PLACED, BINDING, ACTIVE})
# Internal states: reservations.get answers NOT_FOUND, reservations.list skips them.
INTERNAL = frozenset({DRAFT})

# state -> the states it may move to.
TRANSITIONS: dict[str, frozenset[str]] = {
    DRAFT: frozenset({AWAITING_CONFIRMATION, PENDING, QUEUED, PLACED, DENIED}),
    AWAITING_CONFIRMATION: frozenset({PENDING, QUEUED, PLACED, DENIED, EXPIRED, CANCELLED}),
    # pending -> released: a victim pending after BookingRepair whose notice's end came (preempted).
    PENDING: frozenset({PLACED, QUEUED, CANCELLED, FAILED, RELEASED}),
    QUEUED: frozenset({PLACED, PENDING, CANCELLED}),
    PLACED: frozenset({BINDING, PENDING, RELEASED, CANCELLED, FAILED}),
    BINDING: frozenset({ACTIVE, PENDING, PLACED, RELEASED, FAILED}),
    ACTIVE: frozenset({RELEASED}),
    DENIED: frozenset(),
    RELEASED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
    EXPIRED: frozenset(),
}


def sources_of(target: str) -> list[str]:
    """Every state allowed to move to `target` (for `UPDATE ... WHERE state = ANY(...)`)."""
    return sorted(s for s, nexts in TRANSITIONS.items() if target in nexts)
