"""`python -m bench.profiled OUT MODULE ARGS...`: run MODULE as `python -m MODULE ARGS...` with
cProfile switched on by SIGUSR1 and off by SIGUSR2, which also writes the profile to OUT. The
benchmark sends them at the start and the end of the create phase (`--profile-server`), so the
profile covers that window only: not the start, the seeding or the baselines.

The handlers run in the main thread, where the control plane's event loop and handlers run; work
in other threads (gRPC's own threads) is not in the profile."""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys


def main() -> None:
    out, module, *rest = sys.argv[1:]
    profiler = cProfile.Profile()

    def start(signum, frame) -> None:  # noqa: ANN001 - signal handler
        profiler.enable()

    def stop(signum, frame) -> None:  # noqa: ANN001 - signal handler
        profiler.disable()
        profiler.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
