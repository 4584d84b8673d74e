"""The earliest-fit phase (`--earliest`): time to answer `Capacity.Preview` with start_earliest
over a 14-day horizon (issue goal: at 1,000 nodes with 100,000 bookings, at most 100 ms; use with
`--bookings 100000 --horizon-days 14`).

Each repetition asks, one after another, for a few shapes: 8 GPUs for 2 h (free now on some
node), 8 GPUs and 1 GPU for longer than a preload slot (no node has such a stretch before its last
booking: the search walks every node's bookings, and answers near the end of the horizon), and a
gang of 4 whole nodes for each length. Measured at the client (validation, the IAM decision, the index barrier and
the search); the search alone is measured too, on a pool read from the database by this process
(`controlplane.placement.earliest.search`), so the report separates the search from the rest.
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc
import psycopg
from psycopg.rows import dict_row

from bench.seed import Seeded, bearer
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import reservations_pb2 as r
from controlplane.placement import earliest
from controlplane.placement.gang import Gang
from controlplane.placement.index import Window
from controlplane.placement.index_sync import read_pool

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
HORIZON_MS = 14 * DAY_MS
GOAL_MS = 100.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--earliest", action="store_true",
                   help="earliest-fit phase: Preview with start_earliest over 14 days "
                        "(use with --bookings 100000 --horizon-days 14)")
    p.add_argument("--earliest-repeats", type=int, default=5, help="rounds of the earliest-fit shapes (default 5)")


def shapes(slot_hours: float) -> list[tuple[str, int, int, int]]:
    """(name, GPUs, hours, gang size) of the asked shapes. `slot_hours` is the preload's slot: a
    request longer than a slot fits on no node before its last booking (the preload staggers the
    nodes by up to one slot, so anything shorter finds a free stretch now on some node)."""
    long_hours = max(3, int(slot_hours) + 3)
    return [("8 GPUs, 2 h", 8, 2, 0), (f"8 GPUs, {long_hours} h", 8, long_hours, 0),
            (f"1 GPU, {long_hours} h", 1, long_hours, 0), ("gang 4 x 8 GPUs, 2 h", 8, 2, 4),
            (f"gang 4 x 8 GPUs, {long_hours} h", 8, long_hours, 4)]


async def _search_only_ms(conninfo: str, pool_id: str, asks: list[tuple[str, int, int, int]]) -> list[float]:
    async with await psycopg.AsyncConnection.connect(conninfo, row_factory=dict_row) as conn:
        pool = await read_pool(conn, pool_id)
    now_ms = int(time.time() * 1000)
    out = []
    for _, count, hours, size in asks:
        window = Window(count, "any", "", {}, now_ms, now_ms + hours * HOUR_MS)
        earliest.search(pool, window, now=now_ms, until=now_ms + HORIZON_MS, gang=Gang(size, "") if size else None)
        started = time.perf_counter()  # the second search: the idle fits of each node remembered
        earliest.search(pool, window, now=now_ms, until=now_ms + HORIZON_MS, gang=Gang(size, "") if size else None)
        out.append((time.perf_counter() - started) * 1000)
    return out


async def earliest_phase(args: argparse.Namespace, channel: grpc.aio.Channel, seeded: Seeded, conninfo: str,
                         slot_hours: float) -> str:
    stub = capacity_pb2_grpc.CapacityStub(channel)
    md = bearer(seeded.token)
    asks = shapes(slot_hours)
    times: dict[str, list[float]] = {name: [] for name, *_ in asks}
    answers: dict[str, str] = {}
    for _ in range(args.earliest_repeats):
        for name, count, hours, size in asks:
            request = r.CreateReservationRequest(
                tenant_id=seeded.tenant_id, pool_id=seeded.pool_id,
                devices=[r.DeviceRequest(device_class="gpu", count=count)], duration=f"{hours}h",
                start_earliest=True, horizon_ms=HORIZON_MS)
            if size:
                request.gang.CopyFrom(r.Gang(size=size))
            started = time.perf_counter()
            reply = await stub.Preview(request, metadata=md, timeout=120)
            times[name].append((time.perf_counter() - started) * 1000)
            answers[name] = (f"start in {max(0.0, (reply.start - time.time() * 1000) / HOUR_MS):.1f} h"
                             if reply.fits else "nothing within 14 days")
    search_ms = await _search_only_ms(conninfo, seeded.pool_id, asks)
    lines = [f"earliest-fit phase: Capacity.Preview with start_earliest over 14 days, {seeded.nodes} nodes, "
             f"{args.earliest_repeats} rounds; the machine is shared, so these are what this run measured"]
    for (name, *_), alone in zip(asks, search_ms):
        median = statistics.median(times[name])
        verdict = "within" if median <= GOAL_MS else "over"
        lines.append(f"  {name}: median {median:.0f} ms, max {max(times[name]):.0f} ms at the client "
                     f"({verdict} the {GOAL_MS:.0f} ms goal); search alone {alone:.1f} ms; {answers[name]}")
    return "\n".join(lines)
