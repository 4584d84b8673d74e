"""A closed-loop load driver: N coroutines keep one call each in flight until a count or a time.

Every phase of the benchmark (creates, echo, raw SQL) runs through `drive`, so the three share the
same concurrency, the same bounds and the same latency bookkeeping.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bench import procstat

Call = Callable[[int], Awaitable[str]]  # call number -> outcome label


@dataclass
class Result:
    name: str
    concurrency: int
    calls: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, one per finished call
    outcomes: Counter[str] = field(default_factory=Counter)
    cpu: dict[str, float] = field(default_factory=dict)  # process label -> CPU seconds

    @property
    def rate(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
        return ordered[index] * 1000

    def share(self) -> list[tuple[str, int, float]]:
        total = sum(self.outcomes.values()) or 1
        return [(k, n, 100 * n / total) for k, n in self.outcomes.most_common()]


async def drive(
    name: str,
    call: Call,
    *,
    concurrency: int,
    max_calls: int,
    max_seconds: float,
    first_call: int = 0,
    progress_every: float = 5.0,
    cpu_of: procstat.Watch | None = None,
) -> Result:
    """Run `call` with `concurrency` in flight until `max_calls` started or `max_seconds` passed."""
    result = Result(name, concurrency)
    numbers = itertools.count(first_call)
    last_call = first_call + max_calls
    started = time.perf_counter()
    deadline = started + max_seconds

    async def worker() -> None:
        while True:
            number = next(numbers)
            if number >= last_call or time.perf_counter() >= deadline:
                return
            await _timed(call, number, time.perf_counter(), result)

    before = procstat.sample(cpu_of or {})
    reporter = asyncio.create_task(_progress(name, result, started, progress_every))
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        reporter.cancel()
    result.seconds = time.perf_counter() - started
    result.calls = len(result.latencies)
    result.cpu = procstat.delta(before, procstat.sample(cpu_of or {}))
    return result


async def warm_up(call: Call, *, concurrency: int, calls: int, first_call: int) -> None:
    """A few calls first, not counted: connections opened, statements prepared, imports done."""
    await drive("warm-up", call, concurrency=concurrency, max_calls=calls, max_seconds=10,
                first_call=first_call, progress_every=3600)


async def drive_open(
    name: str,
    call: Call,
    *,
    rate: float,
    max_calls: int,
    max_seconds: float,
    first_call: int = 0,
    max_in_flight: int = 5000,
    progress_every: float = 5.0,
    cpu_of: procstat.Watch | None = None,
) -> Result:
    """Open loop: call i starts at t0 + i / rate whether or not earlier calls have answered, until
    `max_calls` started or `max_seconds` passed; then the calls in flight are awaited. A call's
    latency runs from the moment it was due, so a client that falls behind shows in the figure
    (no coordinated omission). Above `max_in_flight` a due call is not sent but counted as
    "not sent: N in flight"; `concurrency` in the result is the most calls seen in flight."""
    result = Result(name, 0)
    started = time.perf_counter()
    deadline = started + max_seconds
    in_flight: set[asyncio.Task] = set()
    peak = 0

    async def one(number: int, due: float) -> None:
        await _timed(call, number, due, result)

    def progress() -> Awaitable[None]:
        return _progress(name, result, started, progress_every, lambda: f", {len(in_flight)} in flight")

    before = procstat.sample(cpu_of or {})
    reporter = asyncio.create_task(progress())
    try:
        for i in range(max_calls):
            due = started + i / rate
            if due >= deadline:
                break
            pause = due - time.perf_counter()
            if pause > 0:
                await asyncio.sleep(pause)
            if len(in_flight) >= max_in_flight:
                result.outcomes[f"not sent: {max_in_flight} in flight"] += 1
                continue
            task = asyncio.create_task(one(first_call + i, due))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            peak = max(peak, len(in_flight))
        if in_flight:
            await asyncio.gather(*in_flight)
    finally:
        reporter.cancel()
    result.seconds = time.perf_counter() - started
    result.calls = len(result.latencies)
    result.concurrency = peak
    result.cpu = procstat.delta(before, procstat.sample(cpu_of or {}))
    return result


async def _timed(call: Call, number: int, since: float, result: Result) -> None:
    """One call: its latency from `since` (when it started, or when it was due) and its outcome."""
    try:
        outcome = await call(number)
    except Exception as exc:  # noqa: BLE001 - a benchmark counts failures, it does not stop
        outcome = f"exception:{type(exc).__name__}"
    result.latencies.append(time.perf_counter() - since)
    result.outcomes[outcome] += 1


async def _progress(name: str, result: Result, started: float, every: float,
                    extra: Callable[[], str] = lambda: "") -> None:
    while True:
        await asyncio.sleep(every)
        done = len(result.latencies)
        elapsed = time.perf_counter() - started
        print(f"  {name}: {done} calls in {elapsed:.0f}s ({done / elapsed:.0f}/s){extra()}", flush=True)
