"""Leftovers of the CLI and `make dev` that a user met, each pinned by a test: `better-compute` as a
real process against a real control plane (or, for pure helpers, the client's own functions)."""

from __future__ import annotations

import time

import pytest

from controlplane.client.errors import UsageError
from controlplane.client.times import fmt_duration, parse_duration
from tests.support import World
from tests.test_cli import _iso_in, _ms, _token, cli, tty  # noqa: F401  (cli, tty: fixtures)

HOUR_MS = 3_600_000


# Compound durations ------------------------------------------------------------------------------


def test_compound_durations_are_read_as_people_type_them() -> None:
    assert parse_duration("--for", "1h30m") == 90 * 60_000
    assert parse_duration("--for", "2d12h") == 60 * HOUR_MS
    assert parse_duration("--for", "90m") == 90 * 60_000
    assert parse_duration("--for", "1h30m15s") == 5_415_000
    assert parse_duration("--for", "1w2d") == 9 * 24 * HOUR_MS
    assert parse_duration("--for", "250ms") == 250
    assert parse_duration("--for", "7200000") == 2 * HOUR_MS  # a bare number: milliseconds, as the API
    assert parse_duration("--step", "90", bare_ms=60_000) == 90 * 60_000


def test_every_duration_list_prints_is_read_back_to_the_same_length() -> None:
    """`list` shows the two largest units: whatever it prints reads back, to what it shows."""
    for ms in (1, 999, 1000, 59_999, 60_000, 5_400_000, 5_415_000, 86_399_999, 216_000_000, 3 * 86_400_000 + 1,
               400 * 86_400_000 + 7 * HOUR_MS):
        shown = fmt_duration(ms)
        read = parse_duration("--for", shown)
        assert fmt_duration(read) == shown, (ms, shown, read)


@pytest.mark.parametrize("text", ["1h1h", "30m1h", "h", "-1h", "1.5.h", "1.5h", "", " ", "1H", "1h30", "8 hours",
                                  "٨h", "1e3h", "9999999999999h", "99999999999999", "999999999999d", "+1h"])
def test_garbage_durations_are_a_usage_error_naming_the_option(text: str) -> None:
    with pytest.raises(UsageError, match="^--by "):
        parse_duration("--by", text)


def test_compound_durations_work_wherever_the_cli_takes_one(cli, tty, world: World) -> None:
    start = _iso_in(3)
    placed = cli("reserve", "--gpus", "1", "--for", "1h30m", "--start", start).json
    assert int(placed["during"]["end"]) - int(placed["during"]["start"]) == 90 * 60_000
    assert placed["request"]["duration"] == "5400000ms"

    listed = tty("list")
    assert listed.code == 0, listed
    [row] = [line.split() for line in listed.out.splitlines() if placed["id"][:12] in line]
    shown = row[-2]
    assert shown == "1h30m"
    again = cli("reserve", "--gpus", "1", "--for", shown, "--start", _iso_in(6)).json  # what list prints
    assert int(again["during"]["end"]) - int(again["during"]["start"]) == 90 * 60_000

    extended = cli("extend", placed["id"], "--by", "1h30m").json
    assert int(extended["reservation"]["during"]["end"]) == _ms(start) + 3 * HOUR_MS
    before = int(time.time() * 1000)
    extended = cli("extend", placed["id"], "--until", "+4h30m").json
    assert int(extended["reservation"]["during"]["end"]) >= before + 4 * HOUR_MS + 30 * 60_000

    leased = cli("reserve", "--gpus", "1", "--lease", "1m30s").json
    assert int(leased["request"]["leaseSeconds"]) == 90

    later = cli("reserve", "--gpus", "1", "--for", "2d12h", "--start", "+1d1h").json
    assert int(later["during"]["end"]) - int(later["during"]["start"]) == 60 * HOUR_MS

    buckets = cli("capacity", "timeline", "--from", start, "--to", "+1d", "--step", "1h30m").json["buckets"]
    assert int(buckets[0]["end"]) - int(buckets[0]["start"]) == 90 * 60_000

    preview = cli("capacity", "--preview", "--gpus", "1", "--for", "1h30m", "--earliest", "--horizon", "1d12h").json
    assert preview["fits"] is True

    joined = cli("nodes", "join-token", "cli-compound", "--ttl", "1h30m", token=_token(world.root)).json
    assert int(joined["expiresAt"]) - time.time() * 1000 > 80 * 60_000


def test_garbage_durations_exit_2_naming_the_option(cli) -> None:
    for args, flag in (
        (("reserve", "--gpus", "1", "--for", "1h1h"), "--for"),
        (("reserve", "--gpus", "1", "--for", "-1h"), "--for"),
        (("reserve", "--gpus", "1", "--for", "999999999999d"), "--for"),
        (("reserve", "--gpus", "1", "--lease", "h"), "--lease"),
        (("reserve", "--gpus", "1", "--start", "+1.5.h"), "--start"),
        (("capacity", "--preview", "--gpus", "1", "--earliest", "--horizon", "1d1d"), "--horizon"),
        (("extend", "rsv_x", "--by", "1.5.h"), "--by"),
        (("extend", "rsv_x", "--until", "+h"), "--until"),
        (("capacity", "timeline", "--step", "30m1h"), "--step"),
        (("nodes", "join-token", "n", "--ttl", "1h1h"), "--ttl"),
    ):
        run = cli(*args)
        assert run.code == 2 and flag in run.err and not run.out, (args, run)
        assert "Traceback" not in run.err, run.err
