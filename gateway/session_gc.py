"""Logs a long garbage collection: with thousands of node sessions the heap holds millions of
objects, and a full collection stops the event loop (every session) while it scans them."""

from __future__ import annotations

import gc
import time
from typing import Any

import structlog

log = structlog.get_logger("gateway.gc")

LONG_SECONDS = 0.2  # a pause worth a log line


_installed: list[object] = []


def log_long_pauses(logger: Any = log, long_seconds: float = LONG_SECONDS) -> None:
    """Once per process (tests start many gateways in one)."""
    if _installed:
        return
    started: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (took := time.perf_counter() - started[0]) >= long_seconds:
            logger.warning("long garbage collection", generation=info.get("generation"),
                           seconds=round(took, 3), collected=info.get("collected"))

    gc.callbacks.append(callback)
    _installed.append(callback)
