"""`--resources`: the create rate with host resources booked, measured after the plain creates on
the same pool and reported next to them.

The seeded nodes come from the Admin API, which writes no inventory; here every node of the pool
gets the inventory a nodesim host reports (192 vCPUs on two NUMA nodes, 2048 GiB with 256 GiB of
1 GiB huge pages), its host resource rows from it (the capacity.hosts reconciler's SQL function)
and the system label of a daemon that enforces limits. That is the only direct write of the
benchmark, standing in for the gateway applying each node's Hello.

Every create then books the pool's per-GPU share ((192 - 2) / 8 vCPUs and 1792 / 8 GiB per GPU);
a quarter of the calls of 1-4 GPUs also ask a little above it (charged to the vcpu and memoryGiB
quota, which the seed sets large).
"""

from __future__ import annotations

import argparse
import random
import time

import grpc
import psycopg
from psycopg.types.json import Jsonb

from bench import creates, procstat
from bench.load import Result, drive, warm_up
from bench.phases import say
from bench.seed import Seeded, bearer
from bettercompute.v1 import reservations_pb2 as r
from bettercompute.v1 import reservations_pb2_grpc

GIB = 1 << 30
INVENTORY = {
    "vcpus": 192, "memory_bytes": 2048 * GIB, "hugepages_1gi": 256, "hugepages_2mi": 0, "isolated_cpus": "",
    "numa_nodes": [{"id": 0, "cpulist": "0-47,96-143", "memory_bytes": 1024 * GIB},
                   {"id": 1, "cpulist": "48-95,144-191", "memory_bytes": 1024 * GIB}],
}
LIMITS_LABEL = "bc.dev/cap.devices.limits"
ABOVE_SHARE = 0.25  # of the calls of 1-4 GPUs


def provision(conninfo: str, pool_id: str) -> int:
    """Inventory, host resource rows and the limits label on every node of the pool; the nodes."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        nodes = conn.execute(
            "UPDATE nodes SET inventory = inventory || %s,"
            " labels = labels || jsonb_build_object(%s::text, '{\"value\": \"true\", \"source\": \"system\"}'::jsonb)"
            " WHERE pool_id = %s RETURNING id", (Jsonb(INVENTORY), LIMITS_LABEL, pool_id)).fetchall()
        conn.execute("SELECT sync_host_resources(id) FROM nodes WHERE pool_id = %s", (pool_id,))
        conn.execute("ANALYZE host_resources")
    return len(nodes)


def make_request(work: creates.Workload, number: int, now_ms: int) -> r.CreateReservationRequest:
    request = creates.make_request(work, number, now_ms)
    rng = random.Random(f"{work.seed}/{number}/resources")
    gpus = request.devices[0].count
    if gpus <= 4 and rng.random() < ABOVE_SHARE:
        request.resources.CopyFrom(r.HostResources(vcpu=gpus * 24, memory_gib=gpus * 224 + 8, hugepages_1gi=1))
    return request


def create_call(channel: grpc.aio.Channel, token: str, work: creates.Workload, *, timeout: float = 30):
    stub = reservations_pb2_grpc.ReservationsStub(channel)
    md = bearer(token)
    now_ms = int(time.time() * 1000)

    async def call(number: int) -> str:
        try:
            reply = await stub.Create(make_request(work, number, now_ms), metadata=md, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return creates.error_label(exc)
        return reply.state or "(no state)"

    return call


async def resources_phase(args: argparse.Namespace, channel: grpc.aio.Channel, seeded: Seeded,
                          work: creates.Workload, conninfo: str, watch: procstat.Watch) -> Result:
    say(f"host resources: inventory, rows and the limits label on {provision(conninfo, seeded.pool_id)} nodes")
    work = creates.Workload(work.tenant_id, work.pool_id, f"{work.run_id}-res", horizon_days=work.horizon_days,
                            seed=work.seed + 1)
    call = create_call(channel, seeded.token, work)
    await warm_up(call, concurrency=args.concurrency, calls=args.concurrency * 5, first_call=90_000_000)
    say(f"creates with host resources: {args.concurrency} in flight, up to {args.seconds:.0f}s")
    result = await drive("Create + host resources", call, concurrency=args.concurrency,
                         max_calls=args.max_calls, max_seconds=args.seconds, cpu_of=watch)
    with psycopg.connect(conninfo) as conn:
        booked = conn.execute("SELECT count(DISTINCT allocation_id), count(*) FROM host_bookings").fetchone()
    say(f"  {booked[0]} allocations with host resources booked ({booked[1]} host bookings)")
    return result
