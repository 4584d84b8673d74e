"""CPU seconds per process group over a phase: who used the machine's two cores.

`Watch` maps a label to a root pid and whether its descendants count (PostgreSQL: the postmaster
and its backends; the benchmark itself: only its own process, not the server it started). The
label "machine" is the whole machine's busy time. A backend that exits mid-phase takes its CPU
time with it, so the figures are lower bounds; pooled connections live through a phase.
"""

from __future__ import annotations

import os

import psutil

# label -> (root pid or pids, include descendants)
Watch = dict[str, tuple[int | tuple[int, ...], bool]]


def _cpu(pid: int | tuple[int, ...], descendants: bool) -> float:
    if isinstance(pid, tuple):  # several processes under one label (control-plane replicas)
        return sum(_cpu(one, descendants) for one in pid)
    try:
        root = psutil.Process(pid)
        procs = [root, *(root.children(recursive=True) if descendants else [])]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def _machine_busy() -> float:
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def sample(watch: Watch) -> dict[str, float]:
    out = {label: _cpu(pid, kids) for label, (pid, kids) in watch.items()}
    if watch:
        out["machine"] = _machine_busy()
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per label over the interval, plus "other": busy time none of ours used
    (another job on the machine, or backends that exited), which says how clean the figure is."""
    out = {label: after[label] - before[label] for label in before if label in after}
    if "machine" in out:
        machine = out.pop("machine")
        out["other"] = max(0.0, machine - sum(out.values()))
        out["machine"] = machine
    return out


def watch_for(*, server_pid: int | tuple[int, ...] | None, postmaster_pid: int | None,
              in_process: bool = False) -> Watch:
    """The benchmark process (with the servers when they run inside it), the server, PostgreSQL."""
    watch: Watch = {"bench+servers" if in_process else "bench client": (os.getpid(), False)}
    if server_pid is not None:
        watch["control plane"] = (server_pid, False)
    if postmaster_pid is not None:
        watch["postgres"] = (postmaster_pid, True)
    return watch
