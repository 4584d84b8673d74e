"""Opt-in diagnostics: where a create's time goes. Both slow the run down; their figures are for
finding the dominant phase, not for the table.

--pg-statements: PostgreSQL logs every statement with its duration (log_min_duration_statement=0);
  the summary groups them by text: count, mean, total, share of the logged time. Lock waits count
  in a statement's duration, so a contended advisory lock or row lock shows up here; COMMIT shows
  the WAL flush.
--profile-server: the control plane runs under cProfile (bench/profiled.py), switched on for the create
  phase only; the summary lists its hottest functions per create.
"""

from __future__ import annotations

import io
import pathlib
import pstats
import re
from collections import defaultdict

import psycopg

# One entry per protocol step: "parse", "bind" and "execute" of the extended protocol (a statement
# psycopg has prepared skips "parse"), or "statement" of the simple one. Durations add up over the
# steps; a statement is counted once, at its "execute" or "statement" entry.
_DURATION = re.compile(r"LOG:\s+duration: ([0-9.]+) ms\s+(parse|bind|execute|statement)[^:]*:\s?(.*)$")
_NEW_ENTRY = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def enable_statement_log(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET log_min_duration_statement = 0")
        conn.execute("ALTER SYSTEM SET log_line_prefix = '%m [%p] '")
        conn.execute("SELECT pg_reload_conf()")


def disable_statement_log(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM RESET log_min_duration_statement")
        conn.execute("ALTER SYSTEM RESET log_line_prefix")
        conn.execute("SELECT pg_reload_conf()")


def log_offset(pg_log: pathlib.Path) -> int:
    return pg_log.stat().st_size if pg_log.exists() else 0


def _entries(pg_log: pathlib.Path, offset: int):
    """(duration ms, counts as a call, statement text) per log entry, continuation lines joined."""
    current: list = []
    with pg_log.open(errors="replace") as handle:
        handle.seek(offset)
        for line in handle:
            if _NEW_ENTRY.match(line):
                if current:
                    yield current[0], current[1], " ".join(current[2:])
                match = _DURATION.search(line)
                current = ([float(match.group(1)), match.group(2) in ("execute", "statement"), match.group(3)]
                           if match else [])
            elif current and line.startswith("\t"):
                current.append(line.strip())
        if current:
            yield current[0], current[1], " ".join(current[2:])


def statement_summary(pg_log: pathlib.Path, offset: int, *, calls: int, top: int = 15) -> str:
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ms, is_call, text in _entries(pg_log, offset):
        key = re.sub(r"\s+", " ", text).strip()[:90]
        totals[key][0] += is_call
        totals[key][1] += ms
    grand = sum(v[1] for v in totals.values()) or 1.0
    lines = [f"PostgreSQL statements during the create phase ({calls} creates; "
             f"{grand:.0f} ms logged, {grand / max(calls, 1):.2f} ms per create):",
             f"  {'count':>7} {'per create':>10} {'mean ms':>8} {'total ms':>9} {'share':>6}  statement"]
    for key, (count, total) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {count:>7} {count / max(calls, 1):>10.2f} {total / max(count, 1):>8.3f} {total:>9.0f}"
                     f" {100 * total / grand:>5.1f}%  {key}")
    return "\n".join(lines)


def profile_summary(paths: list[pathlib.Path], *, calls: int, top: int = 25) -> str:
    """The control plane's functions by cumulative time over the create phase, per create (all
    replicas' profiles added up), then the top ones by own time."""
    found = [str(p) for p in paths if p.exists()]
    if not found:
        return "no profile written (did the control plane get the signals?)"
    stats = pstats.Stats(*found, stream=io.StringIO())
    per = max(calls, 1)
    total = sum(tt for _, _, tt, _, _ in stats.stats.values())  # type: ignore[attr-defined]
    rows = [(f"{pathlib.Path(file).name}:{line}({name})", nc, tt, ct)
            for (file, line, name), (_, nc, tt, ct, _) in stats.stats.items()]  # type: ignore[attr-defined]
    lines = [f"control plane profile over the create phase (cProfile, main thread, {len(found)} "
             f"process(es)): {1000 * total / per:.2f} ms of profiled time per create ({calls} creates)",
             f"  by cumulative time:  {'ms/create':>9} {'own ms':>7} {'calls/create':>12}  function"]
    for name, nc, tt, ct in sorted(rows, key=lambda r: -r[3])[:top]:
        lines.append(f"  {'':<19} {1000 * ct / per:>9.3f} {1000 * tt / per:>7.3f} {nc / per:>12.2f}  {name}")
    lines.append(f"  by own time:         {'own ms':>9} {'cum ms':>7} {'calls/create':>12}  function")
    for name, nc, tt, ct in sorted(rows, key=lambda r: -r[2])[:top]:
        lines.append(f"  {'':<19} {1000 * tt / per:>9.3f} {1000 * ct / per:>7.3f} {nc / per:>12.2f}  {name}")
    lines.append("  (cProfile slows the server roughly twofold: read shares, not absolute times)")
    return "\n".join(lines)
