"""The small SQL functions every placement calls (migration 0056): epoch_ms and booking_delta_op
give the values they always gave and are inlined into the statements that call them (a function
PostgreSQL cannot inline runs as a statement of its own per call), and schedule_moments inserts
one work item per moment and wakes the queue once, for the earliest.
"""

from __future__ import annotations

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane import db

# The definitions before 0056, as references.
REFERENCE_EPOCH_MS = "(extract(epoch FROM t) * 1000)::bigint"
REFERENCE_DELTA_OP = ("'+' || 'atom-1' || ',' || (extract(epoch FROM lower(d)) * 1000)::bigint || ','"
                      " || coalesce((extract(epoch FROM upper(d)) * 1000)::bigint, 9223372036854775807)")


def test_epoch_ms_gives_the_reference_milliseconds_before_and_after_1970_in_any_time_zone(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        for zone in ("UTC", "America/New_York", "Asia/Kolkata"):
            conn.execute("SELECT set_config('timezone', %s, false)", (zone,))
            row = conn.execute(f"""
                WITH instants AS (
                    SELECT timestamptz '1969-12-31 23:59:59+00' + k * interval '1 microsecond' AS t
                    FROM generate_series(0, 2000000, 37) k
                    UNION ALL SELECT timestamptz '1900-01-01 00:00:00+00' + k * interval '1 hour 0.0005 s'
                    FROM generate_series(0, 2000000, 101) k
                    UNION ALL SELECT NULL)
                SELECT count(*), count(*) FILTER (WHERE epoch_ms(t) IS DISTINCT FROM {REFERENCE_EPOCH_MS})
                FROM instants""").fetchone()
            assert row is not None and row[0] > 70000
            assert row[1] == 0, f"{row[1]} instants differ in {zone}"
        half = conn.execute("SELECT epoch_ms('2026-01-01 00:00:00.0005+00'), "
                            "epoch_ms('1969-12-31 23:59:59.9995+00')").fetchone()
        assert half == (1767225600001, -1)  # half a millisecond rounds away from zero, as before


def test_booking_delta_op_gives_the_reference_text(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        for during in ("[2026-01-01 00:00:00.123+00, 2026-01-02 00:00:00+00)", "[1960-05-05 10:00:00+00,)"):
            got, want = conn.execute(f"SELECT booking_delta_op('+', 'atom-1', d), {REFERENCE_DELTA_OP} "
                                     "FROM (SELECT %s::tstzrange AS d) x", (during,)).fetchone()
            assert got == want


def test_epoch_ms_and_booking_delta_op_are_inlined(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        for call in ("epoch_ms(now())", "booking_delta_op('+', 'a', tstzrange(now(), NULL))"):
            plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN (VERBOSE, COSTS OFF) SELECT {call}"))
            name = call.partition("(")[0]
            assert f"{name}(" not in plan, f"{name} is not inlined:\n{plan}"


def test_schedule_moments_inserts_each_moment_and_wakes_once_for_the_earliest(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as listener, psycopg.connect(database) as conn:
        listener.execute("LISTEN bc_work")
        conn.execute("""SELECT schedule_moments('reservation', 'res-1', ARRAY[
            compute_now() + interval '2 hours', NULL, compute_now() + interval '90 seconds',
            compute_now() + interval '1 day'])""")
        items = conn.execute("SELECT subject, epoch_ms(run_at) - epoch_ms(compute_now()) FROM work_items "
                             "WHERE kind = 'reservation' ORDER BY run_at").fetchall()
        conn.execute("SELECT schedule_moments('reservation', 'res-2', ARRAY[]::timestamptz[])")
        conn.commit()
        assert items == [("res-1", 90_000), ("res-1", 7_200_000), ("res-1", 86_400_000)]
        notes = [n.payload for n in listener.notifies(timeout=2.0)]
        assert notes == ["reservation 90"], notes
        left = conn.execute("SELECT count(*) FROM work_items WHERE subject = 'res-2'").fetchone()
        assert left == (0,)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Any text a request can carry: no NUL (PostgreSQL's text has none) and no lone surrogate (not UTF-8:
# protobuf refuses it before a handler sees it, and psycopg cannot send it).
@given(texts=st.lists(st.one_of(st.none(), st.text(alphabet=st.characters(blacklist_characters="\x00",
                                                                          blacklist_categories=("Cs",)))),
                      max_size=8),
       numbers=st.lists(st.integers(min_value=-2**63, max_value=2**63 - 1), max_size=8),
       flags=st.lists(st.booleans(), max_size=8))
def test_an_array_literal_round_trips_any_text_numbers_and_flags(database: str, texts: list[str | None],
                                                               numbers: list[int], flags: list[bool]) -> None:
    """db.array_literal (PLACE_INLINE's array parameters): whatever a node names its devices, the
    array PostgreSQL reads back is the list given, element for element (quotes, backslashes,
    braces, commas, spaces, "NULL" as text, empty strings)."""
    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute("SELECT %s::text[], %s::bigint[], %s::boolean[]",
                           (db.array_literal(texts), db.array_literal(numbers), db.array_literal(flags))).fetchone()
    assert row == (texts, numbers, flags)
