"""PostgreSQL's side of a create, from the server's own counters (on by default, `--no-pg-stat`
turns it off): `pg_stat_statements` (shipped with the embedded server, loaded through
shared_preload_libraries, which needs one restart at the start of the run) counts every top-level
statement a client sent, with its execution time; `pg_stat_database` counts transactions.

Both are reset when a create phase starts and read when it ends, so the figures cover that phase:
every client of the database (the control plane's handlers, its capacity index listener, its
workers), divided by the creates the phase finished. One statement is one round trip unless the
client pipelines several; BEGIN and COMMIT count (track_utility). Execution time includes lock
waits (a contended pool lock shows), not parsing or planning, and not the time on the network.

`--pg-plans` also counts planning, nested statements included (`track = all`, `track_planning`):
the summary then lists the statements planned on most of their calls (a statement the plan cache
never keeps a plan for costs its planning every time; migration 0058 found one so). The counts
per create stay those of the top-level statements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import psycopg

EXCLUDE = "%pg_stat_%"  # this module's own reads and resets


def enable(conninfo: str, *, plans: bool = False) -> None:
    """Set shared_preload_libraries (and with `plans`, nested statements and planning counted);
    takes effect at the next restart of the server."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        conn.execute("ALTER SYSTEM SET pg_stat_statements.track_utility = on")
        conn.execute("ALTER SYSTEM SET pg_stat_statements.max = 5000")
        if plans:
            conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
            conn.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")


def create_extension(conninfo: str) -> bool:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        loaded = conn.execute("SELECT 'pg_stat_statements' = ANY(string_to_array(current_setting("
                              "'shared_preload_libraries'), ', '))").fetchone()[0]
        if loaded:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        return bool(loaded)


def reset(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
        conn.execute("SELECT pg_stat_reset()")


@dataclass
class Statements:
    calls: int
    exec_ms: float
    commits: int
    rollbacks: int
    rows: list[tuple[str, int, float]] = field(default_factory=list)  # text, calls, total ms
    replanned: list[tuple[str, int, int, float]] = field(default_factory=list)  # text, calls, plans, plan ms


STATEMENTS = """
SELECT query, sum(calls)::bigint, sum(total_exec_time)
FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
WHERE d.datname = current_database() AND query NOT LIKE %s AND s.toplevel
GROUP BY query ORDER BY 3 DESC
"""
# Planned on more than half their calls (none unless track_planning is on), nested ones included.
REPLANNED = """
SELECT query, sum(calls)::bigint, sum(plans)::bigint, sum(total_plan_time)
FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
WHERE d.datname = current_database() AND query NOT LIKE %s
GROUP BY query HAVING sum(calls) >= 20 AND sum(plans) * 2 > sum(calls) ORDER BY 4 DESC
"""
DATABASE = "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = current_database()"


def collect(conninfo: str) -> Statements:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = [(q, int(c), float(t)) for q, c, t in conn.execute(STATEMENTS, (EXCLUDE,)).fetchall()]
        replanned = [(q, int(c), int(n), float(t)) for q, c, n, t in conn.execute(REPLANNED, (EXCLUDE,)).fetchall()]
        # Backends flush these counters about once a second: a lower bound for a short phase.
        commits, rollbacks = conn.execute(DATABASE).fetchone()
    return Statements(sum(r[1] for r in rows), sum(r[2] for r in rows), int(commits), int(rollbacks), rows,
                      replanned)


def summary(stats: Statements, *, name: str, calls: int, top: int = 15) -> str:
    per = max(calls, 1)
    lines = [f"PostgreSQL per create, {name} ({calls} creates; pg_stat_statements, every client): "
             f"{stats.calls / per:.1f} statements, {stats.exec_ms / per:.2f} ms executing, "
             f"{stats.commits / per:.1f} commits, {stats.rollbacks / per:.2f} rollbacks",
             f"  {'calls':>8} {'per create':>10} {'mean ms':>8} {'ms/create':>9} {'share':>6}  statement"]
    for text, count, total in stats.rows[:top]:
        lines.append(f"  {count:>8} {count / per:>10.2f} {total / max(count, 1):>8.3f} {total / per:>9.3f}"
                     f" {100 * total / (stats.exec_ms or 1):>5.1f}%  {_shown(text)}")
    if stats.replanned:
        lines.append("  planned on most of their calls (--pg-plans; nested statements included):")
        lines.append(f"  {'calls':>8} {'plans':>8} {'plan ms':>8} {'ms/create':>9}  statement")
        for text, count, plans, plan_ms in stats.replanned[:top]:
            lines.append(f"  {count:>8} {plans:>8} {plan_ms / max(plans, 1):>8.3f} {plan_ms / per:>9.3f}  {_shown(text)}")
    return "\n".join(lines)


def _shown(text: str) -> str:
    """A statement on one line, cut to its first 100 characters."""
    return re.sub(r"\s+", " ", text).strip()[:100]
