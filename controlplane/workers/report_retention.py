"""Node report retention: the reports of allocations that ended (released or failed) are never
judged again, so after the retention window (README "Limits") they are deleted, in batches
(controlplane.nodes.reports.expire_ended). The window is wall-clock time (now(), like
received_at): it bounds storage, not a lifecycle, and moving the dev clock expires none.
"""

from __future__ import annotations

import asyncio

import structlog

from controlplane.nodes import reports
from controlplane.runtime import Runtime
from controlplane.workers import sweeps

log = structlog.get_logger(__name__)


async def expire(rt: Runtime) -> int:
    """Delete the ended allocations' reports older than the window; the number deleted."""
    total = await reports.expire_ended(rt.pool, rt.settings.report_retention_hours * 3600)
    if total:
        log.info("node reports expired", count=total)
    return total


async def run(rt: Runtime, stop: asyncio.Event) -> None:
    await sweeps.every(rt.settings.report_sweep_seconds, lambda: expire(rt), stop, "node report expiry")
