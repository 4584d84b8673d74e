"""`python -m bench --earliest`: the earliest-fit phase runs and reports each shape's time at the
client, the search alone and the answer (issue 11's goal figure comes from this phase at 1,000
nodes with 100,000 bookings)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from bench.__main__ import parse_args

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_earliest_flags_parse() -> None:
    args = parse_args(["--earliest", "--earliest-repeats", "2"])
    assert (args.earliest, args.earliest_repeats) == (True, 2)
    assert parse_args([]).earliest is False


@pytest.mark.bench
@pytest.mark.timeout(400)
def test_tiny_run_with_earliest() -> None:
    argv = [sys.executable, "-m", "bench", "--quick", "--nodes", "20", "--seconds", "1", "--no-baselines",
            "--concurrency", "2", "--bookings", "2000", "--horizon-days", "14", "--earliest",
            "--earliest-repeats", "1", "--no-pg-stat"]
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                          text=True, timeout=360)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out[-6000:]}\n{done.stderr[-3000:]}"
    assert "earliest-fit phase: Capacity.Preview with start_earliest over 14 days, 20 nodes" in out, out
    shapes = re.findall(r"^  (.+): median \d+ ms, max \d+ ms at the client \((within|over) the 100 ms goal\); "
                        r"search alone [0-9.]+ ms; (start in [0-9.]+ h|nothing within 14 days)$", out, re.M)
    assert len(shapes) == 5, out
    # Longer than a preload slot: no node has room before its last booking, days away.
    long_single = next(s for s in shapes if s[0].startswith("8 GPUs") and not s[0].endswith(" 2 h"))
    assert long_single[2].startswith("start in") and float(long_single[2].split()[2]) > 24, out
