"""The gang phase (`--gang`): time to place one gang of `--gang-size` whole 8-GPU nodes out of the
seeded pool (issue goal: a 64-node gang out of 5,000 nodes in at most 200 ms).

Each repetition is one `Reservations.Create` of a single 8-GPU reservation (for scale, under the
same load) and then one of a new gang (no topology key, so every node of the
pool is one group), an hour ahead for an hour, measured at the client: the draft transaction, the
IAM decision, and the pool-locked transaction that plans every node on the capacity index and
commits all members. The in-memory plan alone is measured too, on a pool read from the database by
this process (`controlplane.placement.gang.plan_in`), so the report separates planning from the
rest of the create.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid

import grpc
import psycopg
from psycopg.rows import dict_row

from bench.seed import Seeded, bearer
from bettercompute.v1 import reservations_pb2 as r
from bettercompute.v1 import reservations_pb2_grpc
from controlplane.placement import gang
from controlplane.placement.index import Window
from controlplane.placement.index_sync import read_pool

HOUR_MS = 3_600_000
GPUS_PER_NODE = 8
GOAL_MS = 200.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gang", action="store_true",
                   help="gang phase: time to place a gang of whole 8-GPU nodes (use with --nodes 5000)")
    p.add_argument("--gang-size", type=int, default=64, help="nodes per gang in the gang phase (default 64)")
    p.add_argument("--gang-repeats", type=int, default=5, help="gangs created one after another (default 5)")


async def _plan_only_ms(conninfo: str, pool_id: str, size: int, now_ms: int) -> tuple[float, float]:
    """The plan of every node on a pool just read (each node planned for the first time), then
    again on the same pool (idle nodes' plans remembered, as in a serving control plane)."""
    async with await psycopg.AsyncConnection.connect(conninfo, row_factory=dict_row) as conn:
        pool = await read_pool(conn, pool_id)
    window = Window(GPUS_PER_NODE, "any", "", {}, now_ms + HOUR_MS, now_ms + 2 * HOUR_MS)
    times = []
    for _ in range(2):
        started = time.perf_counter()
        planned = gang.plan_in(pool, window, gang.Gang(size, ""), top_n=3, rng=random.Random())
        times.append((time.perf_counter() - started) * 1000)
        assert planned.plan is not None, planned.reason
    return times[0], times[1]


async def gang_phase(args: argparse.Namespace, channel: grpc.aio.Channel, seeded: Seeded, conninfo: str) -> str:
    """Create `gang_repeats` gangs one at a time; the report's lines."""
    stub = reservations_pb2_grpc.ReservationsStub(channel)
    md = bearer(seeded.token)
    now_ms = int(time.time() * 1000)
    run = uuid.uuid4().hex[:10]
    times: list[float] = []
    singles: list[float] = []  # one 8-GPU node, not a gang, under the same load: for scale
    states: list[str] = []
    for i in range(args.gang_repeats):
        for kind in ("single", "gang"):
            request = r.CreateReservationRequest(
                tenant_id=seeded.tenant_id, pool_id=seeded.pool_id,
                devices=[r.DeviceRequest(device_class="gpu", count=GPUS_PER_NODE)],
                duration="1h", start=now_ms + HOUR_MS, idempotency_key=f"bench-{kind}-{run}-{i}",
            )
            if kind == "gang":
                request.gang.CopyFrom(r.Gang(size=args.gang_size))
            started = time.perf_counter()
            reply = await stub.Create(request, metadata=md, timeout=120)
            (times if kind == "gang" else singles).append((time.perf_counter() - started) * 1000)
            if kind == "gang":
                states.append(f"{reply.state} ({len(reply.allocations)} nodes)")
    cold_ms, warm_ms = await _plan_only_ms(conninfo, seeded.pool_id, args.gang_size, now_ms)
    median = statistics.median(times)
    verdict = "within" if median <= GOAL_MS else "over"
    return "\n".join([
        f"gang phase: {args.gang_repeats} gangs of {args.gang_size} x {GPUS_PER_NODE}-GPU nodes out of "
        f"{seeded.nodes} nodes, one Create each, one after another",
        f"  time to place (Create, client side): median {median:.0f} ms, min {min(times):.0f} ms, "
        f"max {max(times):.0f} ms ({verdict} the {GOAL_MS:.0f} ms goal)",
        f"  for scale, a single 8-GPU create before each gang: median {statistics.median(singles):.0f} ms",
        f"  of which planning every node in memory (this process): {warm_ms:.0f} ms "
        f"({cold_ms:.0f} ms the first time each node is planned)",
        f"  outcomes: {', '.join(states)}",
    ])
