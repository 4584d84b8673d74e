"""Linux cpulists ("0-3,8,10-11"), read within bounds (spec "Host resources"): CPU ids up to
MAX_CPU, at most MAX_CHARS characters and MAX_PARTS comma-separated parts. A list beyond any bound,
or one that does not parse, reads as empty, so a node cannot stall the control plane with one.
A node's NUMA lists together get one list's bounds (`parse_all`): they partition its CPUs, and
many lists each within the bounds would otherwise add up to megabytes to parse."""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import compress

from controlplane.config import Settings

_BOUNDS = Settings()  # read once, from the environment (README "Limits")
MAX_CPU = _BOUNDS.cpulist_max_cpu
MAX_CHARS = _BOUNDS.cpulist_max_chars
MAX_PARTS = _BOUNDS.cpulist_max_parts

_PART = re.compile(r"^([0-9]{1,5})(?:-([0-9]{1,5}))?$")  # ASCII digits: the kernel writes no others


def parse(text: str) -> frozenset[int]:
    """The CPU ids of a cpulist; empty when it breaks a bound or does not parse."""
    text = text.strip(" \t\n")
    if not text or len(text) > MAX_CHARS or text.count(",") >= MAX_PARTS:
        return frozenset()
    bits = bytearray(MAX_CPU + 1)  # slices, not Python loops: overlapping ranges cost C time only
    top = -1
    for part in text.split(","):
        m = _PART.fullmatch(part.strip(" \t\n"))
        if m is None:
            return frozenset()
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo or hi > MAX_CPU:
            return frozenset()
        bits[lo:hi + 1] = b"\x01" * (hi + 1 - lo)
        top = max(top, hi)
    return frozenset(compress(range(top + 1), bits))  # in C, and only up to the highest id


def parse_all(texts: Iterable[str]) -> list[frozenset[int]]:
    """Each list's CPU ids, the lists read in order while together they stay within one list's
    bounds (MAX_CHARS characters, MAX_PARTS parts); every list past that budget reads as empty."""
    chars, parts = MAX_CHARS, MAX_PARTS
    out: list[frozenset[int]] = []
    for text in texts:
        size, pieces = len(text), text.count(",") + 1
        if size > chars or pieces > parts:
            chars = parts = 0  # the budget is spent: this list and every later one read as empty
            out.append(frozenset())
            continue
        chars, parts = chars - size, parts - pieces
        out.append(parse(text))
    return out


def format_list(cpus: Iterable[int]) -> str:
    """The shortest cpulist of these ids, ascending ("0-3,8")."""
    out: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(_run(run))
        run = [cpu]
    if run:
        out.append(_run(run))
    return ",".join(out)


def normalise(text: str) -> str:
    """The list as stored: parsed within bounds and written back ("" when out of bounds)."""
    return format_list(parse(text))


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
