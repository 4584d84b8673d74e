"""The node side of binding -> bound report stored, from the processes' own logs: the gateway's
push of each desired state (wait for its turn, the read, the write), nodesim's bind (apply, time
in the node's outbox, the write) and the gateway's intake of the report; and what stopped each
event loop meanwhile (stalls, long garbage collections). Only lines within the phase count."""

from __future__ import annotations

import datetime as dt
import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from bench.fleet.measure import percentile

# (log, event, field, label)
STAGES = (
    ("gateway", "desired state sent", "wait_ms", "gateway: push waits for its session's turn"),
    ("gateway", "desired state sent", "read_ms", "gateway: desired state read (database)"),
    ("gateway", "desired state sent", "write_ms", "gateway: desired state written to the stream"),
    ("nodesim", "bind sent", "apply_ms", "nodesim: apply (CDI spec, env file, sign)"),
    ("nodesim", "bind sent", "queue_ms", "nodesim: report waits in the node's outbox"),
    ("nodesim", "bind sent", "write_ms", "nodesim: report written to the stream"),
    ("gateway", "report stored", "intake_ms", "gateway: report intake (database)"),
)
PAUSES = ("event loop stalled", "long garbage collection")
PAUSE_NAMES = {"event loop stalled": "loop stalls", "long garbage collection": "long collections"}


@dataclass
class Window:
    start: float  # time.time()
    end: float


@dataclass
class Found:
    values: dict[str, list[float]] = field(default_factory=dict)  # label -> milliseconds
    pauses: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)  # (seconds, cpu)


def _lines(path: pathlib.Path, window: Window) -> Iterator[dict]:
    try:
        with path.open(errors="replace") as handle:
            for line in handle:
                if not line.startswith("{"):
                    continue
                try:
                    record = json.loads(line)
                    at = dt.datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
                if window.start <= at <= window.end:
                    yield record
    except OSError:
        return


def collect(logs: pathlib.Path, window: Window) -> Found:
    found = Found()
    for process in ("gateway", "nodesim"):
        for record in _lines(logs / f"{process}.log", window):
            event = record.get("event")
            if event in PAUSES:
                found.pauses.setdefault((process, event), []).append(
                    (float(record.get("seconds") or 0), float(record.get("cpu_seconds") or 0)))
                continue
            if event == "desired state sent" and not record.get("assignments"):
                continue  # a push with nothing to bind
            for log, stage_event, name, label in STAGES:
                if log == process and event == stage_event and name in record:
                    found.values.setdefault(label, []).append(float(record[name]))
    return found


def table(found: Found) -> str:
    head = f"{'milliseconds (from the logs)':<52}{'n':>6}{'p50':>8}{'p95':>8}{'p99':>8}{'max':>8}"
    lines = [head, "-" * len(head)]
    for _, _, _, label in STAGES:
        values = found.values.get(label, [])
        if not values:
            lines.append(f"{label:<52}{0:>6}{'-':>8}{'-':>8}{'-':>8}{'-':>8}")
            continue
        lines.append(f"{label:<52}{len(values):>6}{percentile(values, 50):>8.1f}{percentile(values, 95):>8.1f}"
                     f"{percentile(values, 99):>8.1f}{max(values):>8.1f}")
    for process in ("gateway", "nodesim"):
        parts = []
        for event in PAUSES:
            pauses = found.pauses.get((process, event), [])
            if pauses:
                parts.append(f"{len(pauses)} {PAUSE_NAMES[event]}, {sum(s for s, _ in pauses):.2f}s in all (longest "
                             f"{max(s for s, _ in pauses):.2f}s; CPU {sum(c for _, c in pauses):.2f}s)")
            else:
                parts.append(f"no {PAUSE_NAMES[event]}")
        lines.append(f"  {process}: " + "; ".join(parts))
    return "\n".join(lines)
