"""Smoke test of `python -m bench --quick --resources` (docs/benchmarks.md): after the plain creates
the same workload runs on hosts with resources booked; both rates are printed in one table and the
second phase really booked host resources.

A benchmark, so not part of `make test`: run it with `pytest -m bench`."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BOUND_S = 180  # the run's own bounds end it earlier; this only guards against a hang

pytestmark = pytest.mark.bench


@pytest.mark.timeout(BOUND_S + 30)
def test_quick_bench_reports_the_create_rate_with_host_resources_next_to_the_plain_one() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "bench", "--quick", "--resources", "--no-baselines"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"bench --quick --resources ran over {BOUND_S}s; output so far:\n{exc.stdout}")
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{out[-6000:]}\nstderr:\n{done.stderr[-3000:]}"
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^(Reservations\.Create|Create \+ host resources)\s+\d+\s+\d+\s+[0-9.]+\s+([0-9.]+)", out, re.M)}
    assert set(rows) == {"Reservations.Create", "Create + host resources"} and all(rows.values()), out
    booked = re.search(r"^\s+(\d+) allocations with host resources booked", out, re.M)
    assert booked and int(booked.group(1)) > 0, out
