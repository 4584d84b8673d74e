"""The flags of `python -m bench.fleet` and the constants every phase shares."""

from __future__ import annotations

import argparse

import bench.fleet

TENANT = "fleet"
IDENTITY = "fleet-user"
POLICY = "permit(principal, action, resource);"
GPUS_PER_NODE = 8  # nodesim's default inventory: 8 x H100-SXM5-80GB on two NUMA nodes
RPC_TIMEOUT = 30.0
POLL_SECONDS = 2.0  # ListNodes of 1,000 nodes costs the control plane ~0.2 s: poll gently
POLL_SECONDS_PER_1000 = 1.0  # ...and more gently with more nodes (5 s at 5,000)
QUICK_POLL_SECONDS = 0.5  # up to 100 nodes
PROGRESS_SECONDS = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=bench.fleet.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, help="simulated nodes, 8 H100 each (default 1000; 50 with --quick)")
    p.add_argument("--reservations", type=int, help="reservations to create (default 300; 50 with --quick)")
    p.add_argument("--concurrency", type=int, default=8, help="Create calls in flight (default 8)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="pace the creates at this many per second (default 0: as fast as --concurrency allows)")
    p.add_argument("--connect-timeout", type=float,
                   help="seconds for the whole fleet to connect (default 60 + 0.25 s per node)")
    p.add_argument("--active-timeout", type=float, default=120.0,
                   help="seconds after the last create for every reservation to be active (default 120)")
    p.add_argument("--hold", type=float, help="idle seconds with the fleet connected, before the creates "
                   "(steady-state CPU; default 10; 3 with --quick)")
    p.add_argument("--heartbeat", type=float, default=5.0, help="nodesim heartbeat period (default 5 s)")
    p.add_argument("--connect-rate", type=float, default=100.0,
                   help="nodes nodesim starts per second (default 100, its own default)")
    p.add_argument("--no-analyze", action="store_true",
                   help="skip the ANALYZE after the fleet connected (planner statistics then lag the enrolment)")
    p.add_argument("--pg-statements", action="store_true",
                   help="diagnostic: log every SQL statement while the reservations run and print the top ones "
                   "(lock waits included; slows the run)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=None,
                   help="after the reservations, restart the gateway and measure the reconnect storm "
                   "(default on; off with --quick)")
    p.add_argument("--restart-timeout", type=float, default=120.0,
                   help="seconds after the gateway's SIGTERM for every node to reconnect (default 120)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (database, logs, sandbox)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 50 nodes, 50 reservations, 3 s hold (flags given win)")
    args = p.parse_args(argv)
    defaults = {"nodes": 50, "reservations": 50, "hold": 3.0} if args.quick else \
               {"nodes": 1000, "reservations": 300, "hold": 10.0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.restart is None:
        args.restart = not args.quick
    if args.connect_timeout is None:
        args.connect_timeout = 60.0 + 0.25 * args.nodes
    if args.nodes < 1 or args.reservations < 0 or args.concurrency < 1 or args.rate < 0:
        p.error("--nodes and --concurrency must be at least 1, --reservations and --rate at least 0")
    return args


def say(text: str = "") -> None:
    print(text, flush=True)
