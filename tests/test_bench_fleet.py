"""Smoke test of the fleet benchmark (docs/benchmarks-fleet.md): `python -m bench.fleet --quick`
runs the database, control plane, gateway and a 50-node nodesim as real processes, creates 50
reservations, exits 0 with every node connected and every reservation active, and prints its
figures. Bounded: the run takes about 25 s on the 2-core dev machine.

A benchmark, so not part of `make test`: run it with `pytest -m bench`."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BOUND_S = 150  # the run's own bounds end it earlier; this only guards against a hang

pytestmark = pytest.mark.bench


@pytest.mark.timeout(BOUND_S + 30)
def test_quick_fleet_benchmark_runs_and_prints_its_figures() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "bench.fleet", "--quick", "--active-timeout", "60"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"bench.fleet --quick ran over {BOUND_S}s; output so far:\n{exc.stdout}")
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{out[-6000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert re.search(r"all 50 connected in [0-9.]+s", out), out
    assert re.search(r"gateway per session: [0-9.]+ KiB", out), out
    assert re.search(r"50/50 active within", out), out
    row = re.search(r"^placed -> active \(commit times\)\s+50(\s+[0-9.]+){4}$", out, re.M)
    assert row, out
    # The node side of binding -> report, from the processes' logs: one bind and one push a reservation.
    assert re.search(r"^nodesim: report waits in the node's outbox\s+50(\s+[0-9.]+){4}$", out, re.M), out
    assert re.search(r"^gateway: report intake \(database\)\s+50(\s+[0-9.]+){4}$", out, re.M), out
    assert "verdict: HEALTHY" in out, out
    # Every process was stopped and the temp dir removed.
    temp = re.search(r"^temp dir (\S+)$", out, re.M)
    assert temp and not pathlib.Path(temp.group(1)).exists(), out
