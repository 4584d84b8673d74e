"""The loop of a periodic sweep (draft expiry, node report retention): run the sweep, wait its
interval or until the process stops, and go on after a failure, which is logged."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger(__name__)


async def every(seconds: float, sweep: Callable[[], Awaitable[object]], stop: asyncio.Event, what: str) -> None:
    """Run `sweep` now and every `seconds` until `stop` is set."""
    while not stop.is_set():
        try:
            await sweep()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("sweep failed; continuing", sweep=what)
        try:
            await asyncio.wait_for(stop.wait(), timeout=seconds)
        except TimeoutError:
            pass
