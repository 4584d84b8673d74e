"""What stops the event loop stops every call at once: garbage collection and loop stalls.

A long-lived asyncio server (the gateway with thousands of node sessions, the control plane with
its capacity index, caches and imports) holds hundreds of thousands of long-lived objects, and a
full collection scans them all: 0.3-0.35 s of CPU at 5,000 gateway sessions; 50-115 ms every
11-13 s in a control plane at 1,000 nodes under creates, while it answers nothing (at half load
the creates waiting behind one such pause are the p99; docs/benchmarks-fleet.md, "Round 3", and
docs/benchmarks.md, "The sixteenth session"). So, once per process:

- after each full collection, the survivors are frozen (`gc.freeze`): they are not garbage, and
  the next full collection scans only what came since, a few milliseconds;
- every `unfreeze_seconds` they are unfrozen, so one full collection scans everything again and
  frees what of it has become cyclic garbage meanwhile (sessions that ended, index entries
  replaced): one long pause per period instead of one every few seconds. 0 turns the freezing off.

Collections of `long_seconds` or more, and stalls of the loop itself (a timer that fires late,
whatever the cause: a collection, a burst of work, or the process waiting for a CPU), are logged.
The gateway and the control plane each install it (`BC_GATEWAY_GC_UNFREEZE_SECONDS`,
`BC_GC_UNFREEZE_SECONDS`); nodesim, a separate program, has its own (nodesim.pauses).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

LONG_SECONDS = 0.2  # a collection worth a log line
LAG_INTERVAL = 0.05  # how often the watch's timer fires
LAG_SECONDS = 0.1  # a timer this late is a stall worth a log line


class Collections:
    """The process's collection policy and pause log (one per process: `install`)."""

    def __init__(self, unfreeze_seconds: float, logger: Any = log, long_seconds: float = LONG_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.unfreeze_seconds = unfreeze_seconds
        self.log, self.long_seconds, self._clock = logger, long_seconds, clock
        self.full_collections = 0  # since the process started
        self._frozen_at = self.full_collections  # the count when the survivors were last frozen
        self._unfrozen = clock()
        self._started = (0.0, 0.0)  # wall and CPU time of the collection under way

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = (time.perf_counter(), time.thread_time())
            return
        if info.get("generation") == 2:
            self.full_collections += 1
        if (took := time.perf_counter() - self._started[0]) >= self.long_seconds:
            self.log.warning("long garbage collection", generation=info.get("generation"), seconds=round(took, 3),
                             cpu_seconds=round(time.thread_time() - self._started[1], 3),
                             collected=info.get("collected"))

    def tend(self) -> None:
        """Freeze the survivors of a full collection that ran since the last call; unfreeze once
        per period. Called from the loop (never from inside a collection)."""
        if self.unfreeze_seconds <= 0:
            return
        if self._clock() - self._unfrozen >= self.unfreeze_seconds:
            gc.unfreeze()
            self._unfrozen = self._clock()
            self._frozen_at = self.full_collections  # let the next full collection scan everything
        elif self.full_collections != self._frozen_at:
            gc.freeze()
            self._frozen_at = self.full_collections


_installed: list[Collections] = []


def install(unfreeze_seconds: float, logger: Any = log) -> Collections:
    """Once per process (tests start many gateways and control planes in one): later calls get the
    first one, with its period and logger."""
    if not _installed:
        collections = Collections(unfreeze_seconds, logger=logger)
        gc.callbacks.append(collections.callback)
        _installed.append(collections)
    return _installed[0]


async def watch(collections: Collections, interval: float = LAG_INTERVAL, long_seconds: float = LAG_SECONDS) -> None:
    """Until cancelled: tends the collections, and logs every stretch of `long_seconds` or more in
    which the loop ran nothing else (with the CPU time the loop's thread had meanwhile: far less
    than the stall means the process was waiting for a CPU)."""
    loop = asyncio.get_running_loop()
    while True:
        due, cpu = loop.time() + interval, time.thread_time()
        await asyncio.sleep(interval)
        if (late := loop.time() - due) >= long_seconds:
            collections.log.warning("event loop stalled", seconds=round(late, 3),
                                    cpu_seconds=round(time.thread_time() - cpu, 3))
        collections.tend()
