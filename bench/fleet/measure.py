"""Measurements of processes: resident memory from /proc, CPU per phase, and the statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from bench import procstat

def rss_kib(pid: int, field_name: str = "VmRSS") -> int | None:
    """Resident set size (or VmHWM, the peak) of a process in KiB, from /proc/<pid>/status."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


def percentile(values: list[float], q: float) -> float:
    """Nearest rank, as bench.load does."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of RSS (KiB) over connected sessions."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / var


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)


class CpuMeter:
    def __init__(self, watch: procstat.Watch) -> None:
        self.watch = watch
        self.phases: list[Phase] = []

    def start(self, name: str) -> tuple[str, float, dict[str, float]]:
        return name, time.perf_counter(), procstat.sample(self.watch)

    def stop(self, token: tuple[str, float, dict[str, float]]) -> Phase:
        name, t0, before = token
        phase = Phase(name, time.perf_counter() - t0, procstat.delta(before, procstat.sample(self.watch)))
        self.phases.append(phase)
        return phase

    def table(self) -> str:
        labels: list[str] = []
        for phase in self.phases:
            labels += [k for k in phase.cpu if k not in labels]
        head = f"{'CPU, % of one core':<24}{'secs':>7}" + "".join(f"{k:>14}" for k in labels)
        lines = [head, "-" * len(head)]
        for phase in self.phases:
            cells = "".join(f"{'-':>14}" if phase.cpu.get(k) is None
                            else f"{100 * phase.cpu[k] / max(phase.seconds, 1e-9):>13.0f}%" for k in labels)
            lines.append(f"{phase.name:<24}{phase.seconds:>7.1f}{cells}")
        return "\n".join(lines)
