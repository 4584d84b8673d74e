"""The unreachable sweeper's loop: every gateway runs one, and each round stores what this gateway
heard since the last (only where `last_seen` trails it by more than a fraction of the grace) and
sweeps (controlplane.nodes.connectivity.Liveness: nodes not heard from within the grace become
unreachable, once, whichever gateway sees them first). A node becomes connected again on its next
hello, or on the round after its next heartbeat."""

from __future__ import annotations

import asyncio

import structlog
from controlplane.nodes import connectivity

log = structlog.get_logger("gateway.sweeper")


async def run(liveness: connectivity.Liveness, every_seconds: float, stopping: asyncio.Event) -> None:
    while not stopping.is_set():
        try:
            await liveness.sweep()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unreachable sweep failed")
        try:
            await asyncio.wait_for(stopping.wait(), timeout=every_seconds)
        except TimeoutError:
            pass
