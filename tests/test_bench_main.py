"""The create benchmark (`python -m bench`, docs/benchmarks.md): its flags, the bookings preload
(rows that keep every invariant of the booking store), and, marked `bench` (run with
`pytest -m bench`), one very small run with every new flag that exits 0 and prints its figures."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import subprocess
import sys

import grpc
import psycopg
import pytest

from bench import pgstat, phases, preload, report, stack
from bench.__main__ import parse_args
from bench.creates import Workload, create_call, make_request
from bench.load import Result, drive_open
from bench.seed import Seeded, seed
from tests.invariants import check_invariants

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_new_flags_parse() -> None:
    args = parse_args(["--quick", "--placer", "lease", "--bookings", "1000000", "--rate", "half",
                       "--replicas", "3"])
    assert (args.placer, args.bookings, args.rate, args.replicas) == ("lease", 1_000_000, "half", 3)
    assert args.wait_ms == 30_000, "a lease placer's creates wait for placement by default"
    assert parse_args(["--rate", "250"]).rate == 250.0
    assert parse_args(["--placer", "inline"]).wait_ms == 0
    defaults = parse_args([])
    assert (defaults.nodes, defaults.placer, defaults.bookings, defaults.rate, defaults.replicas) == (
        1000, None, 0, None, 1)


def test_rounds_flag() -> None:
    assert parse_args([]).rounds == 1
    assert parse_args(["--rounds", "5", "--rate", "half"]).rounds == 5


def test_tenants_flag() -> None:
    assert parse_args([]).tenants == 1
    assert parse_args(["--tenants", "4"]).tenants == 4


@pytest.mark.parametrize("argv", [["--rate", "fast"], ["--rate", "0"], ["--replicas", "0"],
                                  ["--placer", "batch"], ["--server", "inprocess", "--replicas", "2"],
                                  ["--rounds", "0"], ["--rounds", "2", "--no-baselines"],
                                  ["--rounds", "2", "--rate", "50"], ["--tenants", "0"],
                                  ["--pg-plans", "--no-pg-stat"]])
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_the_summary_lists_the_statements_planned_on_most_calls() -> None:
    """--pg-plans: the statements the plan cache planned on most of their calls, with their
    planning per create; none listed when planning was not counted."""
    stats = pgstat.Statements(200, 80.0, 200, 0, [("SELECT place_inline($1)", 100, 70.0)],
                              [("SELECT c.resource FROM unnest(p_resources)", 100, 99, 29.7)])
    text = pgstat.summary(stats, name="Reservations.Create", calls=100)
    assert "planned on most of their calls" in text
    assert re.search(r"\s100\s+99\s+0\.300\s+0\.297\s+SELECT c\.resource FROM unnest", text), text
    quiet = pgstat.summary(pgstat.Statements(200, 80.0, 200, 0, stats.rows), name="Reservations.Create", calls=100)
    assert "planned on most" not in quiet


def test_open_loop_starts_calls_on_time_whatever_the_answers() -> None:
    """Calls are started at the rate while earlier ones are still unanswered (a closed loop of
    one would manage 5 calls in this time), and latency counts from when a call was due."""
    started: list[int] = []

    async def slow(number: int) -> str:
        started.append(number)
        await asyncio.sleep(0.5)
        return "ok"

    result = asyncio.run(drive_open("open", slow, rate=40, max_calls=1000, max_seconds=1.0))
    assert result.calls == len(started) == 40
    assert result.outcomes == {"ok": 40}
    assert result.concurrency >= 15, "calls overlapped: the driver did not wait for answers"
    assert min(result.latencies) >= 0.5


def test_each_round_numbers_its_creates_apart() -> None:
    """No two calls of a run share a number, so no create of a later round replays an earlier
    one's idempotency key: every round's measured and warm-up calls, and the first round's open
    loop (50,000,000 and 91,000,000 on), fall in ranges of their own."""
    max_calls = parse_args([]).max_calls
    ranges = [(50_000_000, 50_000_000 + max_calls), (91_000_000, 91_000_000 + max_calls)]
    for n in range(1, 11):
        first = phases.round_first_call(n)
        ranges += [(first, first + max_calls), (first + phases.WARM_UP_OFFSET, first + phases.WARM_UP_OFFSET + 1000)]
    ranges.sort()
    assert phases.round_first_call(1) == 0, "one round numbers its calls as a run without --rounds"
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), ranges
    work = Workload("t", "p", "run", horizon_days=60)
    keys = {make_request(work, phases.round_first_call(n), 0).idempotency_key for n in range(1, 6)}
    assert len(keys) == 5


def _result(name: str, calls: int, seconds: float, machine: float | None = None) -> Result:
    res = Result(name, 16, calls=calls, seconds=seconds)
    if machine is not None:
        res.cpu = {"machine": machine}
    return res


def test_rounds_table_gives_each_rounds_ratios_and_their_median() -> None:
    rounds = [phases.Round(_result("echo", 2000, 10), _result("sql", 300, 10), _result("create", 3600, 20, 36.0)),
              phases.Round(_result("echo", 2500, 10), _result("sql", 400, 10), _result("create", 3000, 20)),
              phases.Round(_result("echo", 2000, 10), _result("sql", 250, 10), _result("create", 4000, 20, 30.0))]
    text = report.rounds_table(rounds)
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [row[:6] for row in rows] == [
        ["1", "180", "200", "30", "0.900", "6.000"],
        ["2", "150", "250", "40", "0.600", "3.750"],
        ["3", "200", "200", "25", "1.000", "8.000"]]
    assert [row[6] for row in rows] == ["10.00", "-", "7.50"], "machine CPU ms per create, '-' when not watched"
    assert "median of 3 rounds: create/echo = 0.900 (0.600-1.000), create/sql = 6.000 (3.750-8.000)" in text


def test_the_server_side_of_a_phase_splits_the_slowest_creates_time(tmp_path: pathlib.Path) -> None:
    """The rpc lines' database figures (db_wait_ms, db_ms) of the lines a phase wrote: the
    slowest 1 % against all calls."""
    import json

    lines = [{"event": "rpc", "method": "/bettercompute.v1.Reservations/Create", "code": "OK",
              "duration_ms": 10.0, "db_wait_ms": 1.0, "db_ms": 6.0, "db_lent": 3} for _ in range(199)]
    lines.append({"event": "rpc", "method": "/bettercompute.v1.Reservations/Create", "code": "OK",
                  "duration_ms": 110.0, "db_wait_ms": 30.0, "db_ms": 70.0, "db_lent": 3})
    lines.append({"event": "rpc", "method": "/bettercompute.v1.Reservations/Create", "code": "OK",
                  "duration_ms": 90.0, "db_wait_ms": 0.0, "db_ms": 80.0, "db_lent": 3})
    warm_up = json.dumps({**lines[-1], "duration_ms": 900.0}) + "\nnot json\n"
    log = tmp_path / "controlplane-1.log"
    log.write_text(warm_up + "\n".join(json.dumps(e) for e in lines) + "\n")
    text = report.phase_split("the phase", [(log, len(warm_up), log.stat().st_size)])
    assert "201 Create calls" in text  # the warm-up's line before the phase is not counted
    assert "slowest 1 % 100.0 = 15.0 + 75.0 + 10.0" in text  # the two slowest of 201
    assert f"all {(199 * 10 + 200) / 201:.1f} = {(199 + 30) / 201:.1f} + {(199 * 6 + 150) / 201:.1f}" in text


def test_layout_spreads_the_bookings_over_the_horizon() -> None:
    lay = preload.layout(1_000_000, 1000, 60 * 86_400_000, 0.25)
    assert lay.slots == 125
    assert lay.slot_ms == 60 * 86_400_000 // 125
    assert lay.duration_ms == int(lay.slot_ms * 0.25) // 60_000 * 60_000
    rows = list(preload.plan_rows(100, ["n1", "n2"], "t", "i", 0, lay, run_id="r"))
    assert sum(row[5] for row in rows) == 100
    assert len({row[0] for row in rows}) == len(rows)


def test_preloaded_bookings_keep_the_invariants(database: str, tmp_path: pathlib.Path) -> None:
    """A real control plane (a child process) seeds a pool and makes the templates; the bulk
    write then adds 2,000 bookings; the invariants hold for the preload tenant, no atom is
    double-booked, and the control plane started afterwards places a create around them."""
    root = stack.ensure_root(database)

    async def scenario() -> preload.Preloaded:
        server = await stack.start_controlplane("subprocess", tmp_path, database, name="cp-seed")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                seeded = await seed(channel, root, nodes=4)
                prepared = await preload.prepare(channel, database, root, pool_id=seeded.pool_id,
                                                 bookings=2000, horizon_days=10, fill=0.25,
                                                 charge_tenant=preload.TENANT, placer="")
        finally:
            await server.stop()
        return preload.preload(database, prepared)

    done = asyncio.run(scenario())
    # 2,000 preloaded (the plan stops at a whole reservation) and the templates' 1 + 2 + 4 + 8.
    assert done.bookings == 2000 + 15 and done.reservations > 2000 / 8
    check_invariants(database, preload.TENANT)
    with psycopg.connect(database) as conn:
        charged = conn.execute("SELECT sum(amount) FROM quota_charges WHERE tenant_id = %s AND resource = 'gpu' "
                               "AND refunded_at IS NULL", (preload.TENANT,)).fetchone()[0]
        assert charged == done.bookings, "one GPU charged per booking"
        future = conn.execute("SELECT count(*) FROM bookings WHERE lower(during) < now() + interval '1 hour'"
                              ).fetchone()[0]
        assert future == 0, "no preloaded window starts within the hour"



def test_analyze_after_seeding_leaves_the_empty_tables_as_autovacuum_would(database: str) -> None:
    """Only the tables seeding filled are analyzed: an empty table ANALYZE has seen is planned as
    empty, and a backend's first generic plans for it (the foreign-key checks' lookups by primary
    key among them) would be sequential scans kept while the measured creates fill it."""
    stack.ensure_root(database)
    analyzed = stack.analyze(database)
    with psycopg.connect(database, autocommit=True) as conn:
        # PostgreSQL's own record: reltuples is -1 until a table is first analyzed or vacuumed.
        seen = dict(conn.execute(
            "SELECT format('%I.%I', s.schemaname, s.relname), c.reltuples >= 0 FROM pg_stat_user_tables s"
            " JOIN pg_class c ON c.oid = s.relid").fetchall())
        assert sorted(t for t, done in seen.items() if done) == analyzed
        assert "public.identities" in analyzed and "public.allocations" not in analyzed
        for table in seen:
            has_rows = conn.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()[0]
            assert has_rows == (table in analyzed), table
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute("PREPARE fk_check(text) AS SELECT 1 FROM ONLY allocations x WHERE id = $1 FOR KEY SHARE OF x")
        plan = "\n".join(r for (r,) in conn.execute("EXPLAIN EXECUTE fk_check('a')"))
        assert "Index Scan using allocations_pkey" in plan, plan


def test_tenants_each_book_the_pool_as_themselves(database: str, tmp_path: pathlib.Path) -> None:
    """--tenants 3: the owner and two tenants the pool is offered to, each with its own token and
    quota; create n is tenant n mod 3's, placed and charged to that tenant."""
    root = stack.ensure_root(database)

    async def scenario() -> tuple[Seeded, dict[str, int]]:
        server = await stack.start_controlplane("subprocess", tmp_path, database, name="cp-tenants")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                seeded = await seed(channel, root, nodes=4, tenants=3)
                call = create_call(channel, seeded.token, Workload(seeded.tenant_id, seeded.pool_id, "tenants"),
                                   callers=seeded.callers)
                outcomes: dict[str, int] = {}
                for number in range(6):
                    outcome = await call(number)
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
        finally:
            await server.stop()
        return seeded, outcomes

    seeded, outcomes = asyncio.run(scenario())
    assert [tenant for tenant, _ in seeded.callers] == ["bench", "bench-2", "bench-3"]
    assert len({token for _, token in seeded.callers}) == 3
    assert outcomes == {"placed": 6}
    with psycopg.connect(database) as conn:
        keys = conn.execute("SELECT tenant_id, array_agg(idempotency_key ORDER BY idempotency_key) FROM reservations"
                            " GROUP BY 1 ORDER BY 1").fetchall()
        assert keys == [("bench", ["tenants-00000000", "tenants-00000003"]),
                        ("bench-2", ["tenants-00000001", "tenants-00000004"]),
                        ("bench-3", ["tenants-00000002", "tenants-00000005"])]
        owners = conn.execute("SELECT DISTINCT r.tenant_id, i.tenant_id FROM reservations r"
                              " JOIN memberships i ON i.identity_id = r.owner_identity_id ORDER BY 1").fetchall()
        assert owners == [("bench", "bench"), ("bench-2", "bench-2"), ("bench-3", "bench-3")]
        charged = conn.execute("SELECT DISTINCT tenant_id FROM quota_charges ORDER BY 1").fetchall()
        assert charged == [("bench",), ("bench-2",), ("bench-3",)]


@pytest.mark.bench
@pytest.mark.timeout(400)
def test_tiny_run_with_every_new_flag() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "bench", "--quick", "--nodes", "20", "--seconds", "2", "--baseline-seconds", "1",
            "--concurrency", "4", "--bookings", "2000", "--rate", "half", "--replicas", "2", "--placer", "inline",
            "--profile-server", "--rounds", "2", "--tenants", "2", "--pg-plans"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=360)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out[-6000:]}\n{done.stderr[-3000:]}"
    assert re.search(r"^Reservations\.Create\s+4\s+\d+", out, re.M), out
    assert re.search(r"^Create open loop \d+/s\s+\d+\s+\d+", out, re.M), out
    assert re.search(r"VACUUM \(ANALYZE\) after the closed loop: [0-9.]+s", out), out
    assert re.search(r"^server side of Create open loop \d+/s: \d+ Create calls, p50 [0-9.]+", out, re.M), out
    assert re.search(r"slowest 1 % [0-9.]+ = [0-9.]+ \+ [0-9.]+ \+ -?[0-9.]+; all", out), out
    assert re.search(r"^grpc echo \(bytes\)", out, re.M) and re.search(r"^raw SQL 3-tx create", out, re.M), out
    assert re.search(r"preloaded: \d+ bookings in \d+ reservations", out), out
    assert re.search(r"control plane start \(2 processes.*gRPC ready after [0-9.]+s, capacity index built", out), out
    per_create = re.search(r"PostgreSQL per create, Reservations\.Create \(\d+ creates.*: ([0-9.]+) statements", out)
    assert per_create and float(per_create.group(1)) < 10, "--pg-plans counts nested statements; top-level only here"
    assert "control plane profile over the create phase" in out, out
    assert "ratios: create/echo" in out, out
    assert re.search(r"^tenants: 2 \('bench' owns the pool", out, re.M), out
    assert "round 2 of 2" in out and re.search(r"^median of 2 rounds: create/echo = [0-9.]+ \(", out, re.M), out
    temp = re.search(r"^temp dir (\S+)$", out, re.M)
    assert temp and not pathlib.Path(temp.group(1)).exists(), out
