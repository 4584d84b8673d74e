"""The unreachable sweeper's loop: every gateway runs one, and each round asks the nodes package
to sweep (controlplane.nodes.connectivity.sweep: nodes not heard from within the grace become
unreachable, once, whichever gateway sees them first). A node becomes connected again on its next
hello or heartbeat."""

from __future__ import annotations

import asyncio

import structlog
from psycopg_pool import AsyncConnectionPool

from controlplane.nodes import connectivity

log = structlog.get_logger("gateway.sweeper")


async def run(pool: AsyncConnectionPool, grace_seconds: float, every_seconds: float, stopping: asyncio.Event) -> None:
    while not stopping.is_set():
        try:
            await connectivity.sweep(pool, grace_seconds)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unreachable sweep failed")
        try:
            await asyncio.wait_for(stopping.wait(), timeout=every_seconds)
        except TimeoutError:
            pass
