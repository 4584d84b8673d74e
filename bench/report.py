"""The printed report: one table of the three phases, outcomes, CPU shares, ratios, server log."""

from __future__ import annotations

import json
import pathlib
import statistics
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from bench.load import Result

if TYPE_CHECKING:
    from bench.phases import Round

OTHER_WARN = 0.15  # of one core: above it, another workload shared the machine during a phase


def _ms(value: float) -> str:
    return f"{value:8.2f}"


def phase_table(results: list[Result]) -> str:
    head = f"{'phase':<28}{'conc':>5}{'calls':>8}{'secs':>7}{'calls/s':>10}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"
    lines = [head, "-" * len(head)]
    for res in results:
        lines.append(
            f"{res.name:<28}{res.concurrency:>5}{res.calls:>8}{res.seconds:>7.1f}{res.rate:>10.0f}"
            f"{_ms(res.percentile_ms(50)):>9}{_ms(res.percentile_ms(95)):>9}{_ms(res.percentile_ms(99)):>9}"
        )
    return "\n".join(lines)


def outcome_table(res: Result) -> str:
    lines = [f"outcomes of {res.name}:"]
    for label, count, pct in res.share():
        lines.append(f"  {label:<40}{count:>8}{pct:>7.1f}%")
    return "\n".join(lines)


def cpu_table(results: list[Result]) -> str:
    """CPU per phase: percent of one core per process group, and CPU ms per call."""
    labels: list[str] = []
    for res in results:
        labels += [k for k in res.cpu if k not in labels]
    labels.sort(key=lambda k: (k in ("other", "machine"), k == "machine"))  # those two last
    if not labels:
        return ""
    head = f"{'CPU, % of one core (ms/call)':<28}" + "".join(f"{k:>17}" for k in labels)
    lines = [head, "-" * len(head)]
    for res in results:
        cells = []
        for k in labels:
            sec = res.cpu.get(k)
            cells.append(
                f"{'-':>17}" if sec is None
                else f"{100 * sec / res.seconds:>7.0f}% ({1000 * sec / max(res.calls, 1):>6.2f})"
            )
        lines.append(f"{res.name:<28}" + "".join(cells))
    for res in results:
        other = res.cpu.get("other", 0.0) / res.seconds if res.seconds else 0.0
        if other > OTHER_WARN:
            lines.append(f"note: during {res.name!r} something else on the machine used {100 * other:.0f}% "
                         "of a core (\"other\"): its figures are low; run again on a quiet machine")
    return "\n".join(lines)


def ratios(create: Result, echo: Result | None, sql: Result | None) -> str:
    parts = []
    if echo and echo.rate:
        parts.append(f"create/echo = {create.rate / echo.rate:.3f}")
    if sql and sql.rate:
        parts.append(f"create/sql = {create.rate / sql.rate:.3f}")
    return "ratios: " + ", ".join(parts) if parts else ""


def rounds_table(rounds: list[Round]) -> str:
    """--rounds: each round's three rates, its two ratios and the machine's CPU per create, then
    the median ratio with the range. A machine whose speed drifts by the minute moves a single
    round's ratios; the median over rounds, each ratio taken from phases seconds apart, less."""
    head = (f"{'round':<7}{'creates/s':>11}{'echo/s':>9}{'SQL/s':>8}{'create/echo':>13}{'create/sql':>12}"
            f"{'machine ms/create':>19}")
    lines = ["rounds: the echo floor, the raw-SQL floor and the closed-loop creates, in turn", head, "-" * len(head)]
    by_echo, by_sql = [], []
    for n, r in enumerate(rounds, 1):
        echo_ratio = r.create.rate / r.echo.rate if r.echo.rate else float("nan")
        sql_ratio = r.create.rate / r.sql.rate if r.sql.rate else float("nan")
        by_echo.append(echo_ratio)
        by_sql.append(sql_ratio)
        machine = r.create.cpu.get("machine")
        cell = f"{1000 * machine / max(r.create.calls, 1):>19.2f}" if machine is not None else f"{'-':>19}"
        lines.append(f"{n:<7}{r.create.rate:>11.0f}{r.echo.rate:>9.0f}{r.sql.rate:>8.0f}"
                     f"{echo_ratio:>13.3f}{sql_ratio:>12.3f}{cell}")
    lines.append(f"median of {len(rounds)} rounds: create/echo = {statistics.median(by_echo):.3f} "
                 f"({min(by_echo):.3f}-{max(by_echo):.3f}), create/sql = {statistics.median(by_sql):.3f} "
                 f"({min(by_sql):.3f}-{max(by_sql):.3f})")
    return "\n".join(lines)


def server_log_summary(paths: list[pathlib.Path], top: int = 8) -> str:
    """What the control plane logged (BC_LOG_FORMAT=json): its canonical "rpc" line per call, by
    method and code, with the server-side duration; then the other events by count. Every
    measured control plane (the replicas, not the one that seeded), warm-ups included."""
    paths = [p for p in paths if p.exists()]
    if not paths:
        return ""
    rpcs: dict[str, list[float]] = defaultdict(list)
    codes: dict[str, Counter[str]] = defaultdict(Counter)
    events: Counter[str] = Counter()
    other = 0
    for line in _lines(paths):
        try:
            entry = json.loads(line)
        except ValueError:
            other += 1
            continue
        if not isinstance(entry, dict):
            other += 1
        elif entry.get("event") == "rpc" and isinstance(entry.get("duration_ms"), (int, float)):
            method = str(entry.get("method", "")).rsplit(".", 1)[-1]
            rpcs[method].append(float(entry["duration_ms"]))
            codes[method][str(entry.get("code", ""))] += 1
        else:
            events[f"{entry.get('level', '')} {entry.get('event', '')}"[:70]] += 1
    names = ", ".join(p.name for p in paths)
    lines = [f"server log ({names}), measured phases and warm-ups; server-side time of each RPC:"]
    for method, values in sorted(rpcs.items(), key=lambda kv: -len(kv[1])):
        values.sort()
        pct = _percentiles(values)
        code_text = ", ".join(f"{c} {n}" for c, n in codes[method].most_common())
        lines.append(f"  {method:<36}{len(values):>7}  p50 {pct[50]:8.2f}  p95 {pct[95]:8.2f}  "
                     f"p99 {pct[99]:8.2f} ms  ({code_text})")
    for event, count in events.most_common(top):
        lines.append(f"  {count:>7}  {event}")
    if other:
        lines.append(f"  {other:>7}  lines that are not JSON")
    return "\n".join(lines)


def phase_split(name: str, spans: list[tuple[pathlib.Path, int, int]], method: str = "Create") -> str:
    """The server's side of one measured phase (its `rpc` lines for `method`, warm-ups not
    included): the duration's percentiles, and where the time of the slowest 1 % went against all
    calls': waiting for a pooled connection (db_wait_ms), holding one (db_ms), the rest."""
    calls = sorted(
        (float(e["duration_ms"]), float(e.get("db_wait_ms", 0.0)), float(e.get("db_ms", 0.0)))
        for e in _entries(spans)
        if e.get("event") == "rpc" and str(e.get("method", "")).endswith("/" + method)
        and isinstance(e.get("duration_ms"), (int, float)))
    if not calls:
        return ""
    pct = _percentiles([c[0] for c in calls])

    def means(part: list[tuple[float, float, float]]) -> str:
        total, wait, held = (sum(c[i] for c in part) / len(part) for i in range(3))
        return f"{total:.1f} = {wait:.1f} + {held:.1f} + {total - wait - held:.1f}"

    slowest = calls[-max(1, len(calls) // 100):]
    return (f"server side of {name}: {len(calls)} {method} calls, p50 {pct[50]:.2f}, p95 {pct[95]:.2f}, "
            f"p99 {pct[99]:.2f} ms\n"
            f"  mean ms = waiting for a connection + holding one + the rest: slowest 1 % {means(slowest)}; "
            f"all {means(calls)}")


def _percentiles(ordered: list[float]) -> dict[int, float]:
    return {q: ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] for q in (50, 95, 99)}


def _entries(spans: list[tuple[pathlib.Path, int, int]]):
    """The JSON objects of each log's lines between two byte offsets."""
    for path, start, end in spans:
        if not path.exists():
            continue
        with path.open("rb") as handle:
            handle.seek(start)
            for raw in handle.read(max(0, end - start)).splitlines():
                try:
                    entry = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(entry, dict):
                    yield entry


def _lines(paths: list[pathlib.Path]):
    for path in paths:
        with path.open(errors="replace") as handle:
            yield from handle
