"""Draft expiry: a draft is a create that never got past admission (IAM or quota refused it, or the
process died between the two transactions). It keeps its idempotency key for the retention window
(README "Limits"); after that it is deleted, with its authorization row (ON DELETE CASCADE).

The sweep is one statement per batch; rows a create is deciding right now are locked and skipped.
The window is wall-clock time (now(), like created_at), not compute_now(): it bounds storage,
not a lifecycle, and moving the dev clock expires no draft.
"""

from __future__ import annotations

import asyncio

import structlog

from controlplane import db
from controlplane.reservations import queries
from controlplane.runtime import Runtime
from controlplane.workers import sweeps

log = structlog.get_logger(__name__)

BATCH = 500

async def expire(rt: Runtime) -> int:
    """Delete the drafts older than the retention window; the number deleted."""
    params = {"retention_s": rt.settings.draft_retention_hours * 3600, "batch": BATCH}
    total = 0
    while True:
        deleted = await db.run_in_transaction(rt.pool, lambda c: c.execute(queries.DELETE_EXPIRED_DRAFTS, params))
        total += deleted.rowcount
        if deleted.rowcount < BATCH:
            break
    if total:
        log.info("drafts expired", count=total)
    return total


async def run(rt: Runtime, stop: asyncio.Event) -> None:
    await sweeps.every(rt.settings.draft_sweep_seconds, lambda: expire(rt), stop, "draft expiry")
