"""What stops the fleet's one event loop stops every node: garbage collection and loop stalls.

A fleet of thousands of nodes is hundreds of MiB of objects that live as long as the process, and
a full collection scanned them all: 0.5-3.5 s during enrolment at 5,000 nodes, and after the
fleet's `gc.freeze()` still 0.15-0.5 s for what had come since (docs/benchmarks-fleet.md, "Round
3"). So after each full collection the survivors are frozen too: the next one scans only what
came since. Nothing is unfrozen (the gateway does, periodically): what a simulated node drops is
freed by reference counting, and the cycles of sessions that end (a reconnect) stay, a bounded
cost for a simulator.

Collections of `GC_SECONDS` or more and stalls of the loop (a timer that fires late) are logged
(at info: they say how busy the simulator's own host is, not that a node went wrong),
with the CPU time the loop's thread had meanwhile (far less than the stall: the process was
waiting for a CPU), so a slow bind or a late heartbeat can be told apart from the gateway's share.
"""

from __future__ import annotations

import asyncio
import gc
import time

import structlog

log = structlog.get_logger("nodesim.pauses")

GC_SECONDS = 0.05  # a collection worth a log line
LAG_INTERVAL = 0.05  # how often the watch's timer fires
LAG_SECONDS = 0.1  # a timer this late is a stall worth a log line


class Collections:
    def __init__(self, long_seconds: float = GC_SECONDS, *, freeze: bool = True) -> None:
        self.long_seconds = long_seconds
        self.freeze = freeze  # False: log only (a fleet embedded in another program's process)
        self.full_collections = 0
        self._frozen_at = 0
        self._started = (0.0, 0.0)

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = (time.perf_counter(), time.thread_time())
            return
        if info.get("generation") == 2:
            self.full_collections += 1
        if (took := time.perf_counter() - self._started[0]) >= self.long_seconds:
            log.info("long garbage collection", generation=info.get("generation"), seconds=round(took, 3),
                        cpu_seconds=round(time.thread_time() - self._started[1], 3), collected=info.get("collected"))

    def tend(self) -> None:
        """Freeze the survivors of a full collection that ran since the last call (from the loop,
        never from inside a collection)."""
        if self.freeze and self.full_collections != self._frozen_at:
            gc.freeze()
            self._frozen_at = self.full_collections


_installed: list[Collections] = []


def install(*, freeze: bool) -> Collections:
    """Once per process (tests run several fleets in one). `freeze`: only nodesim's own process
    freezes its heap; a fleet embedded in another process (the tests) leaves that process's
    collector alone."""
    if not _installed:
        collections = Collections(freeze=freeze)
        gc.callbacks.append(collections.callback)
        _installed.append(collections)
    return _installed[0]


async def watch(collections: Collections, interval: float = LAG_INTERVAL, long_seconds: float = LAG_SECONDS) -> None:
    """Until cancelled: tends the collections and logs every stall of `long_seconds` or more."""
    loop = asyncio.get_running_loop()
    while True:
        due, cpu = loop.time() + interval, time.thread_time()
        await asyncio.sleep(interval)
        if (late := loop.time() - due) >= long_seconds:
            log.info("event loop stalled", seconds=round(late, 3), cpu_seconds=round(time.thread_time() - cpu, 3))
        collections.tend()
