"""The host resources a reservation books, resolved once when its draft is written (spec "Host
resources"):

- the pool's per-GPU share of CPU and memory times the GPUs asked for, rounded down: policy.perGpu
  where set, otherwise the smallest share any GPU host of the pool can give (from the capacity
  index when built, else SQL), so the share fits on every host;
- the share is the floor: `resources` below it, or {}, are raised to it; hugepages1Gi has no share;
- the share rides on the GPUs; anything booked above it is charged to the vcpu and memoryGiB quota
  (1 GiB huge pages count as memory). A reservation made before host shares existed (no
  host_share) charges its devices only.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from psycopg import AsyncConnection

from controlplane.reservations import queries
from controlplane.reservations.validate import HOST_RESOURCES
from controlplane.runtime import Runtime

SHARED = ("vcpu", "memoryGiB")  # what a GPU carries a share of


async def per_gpu(conn: AsyncConnection, rt: Runtime, pool: dict[str, Any]) -> dict[str, Fraction]:
    """The pool's per-GPU share: policy.perGpu where set, else what its smallest GPU host gives."""
    policy = (pool.get("policy") or {}).get("perGpu") or {}
    out = {r: Fraction(policy[r]) for r in SHARED if policy.get(r) is not None}
    if len(out) == len(SHARED):
        return out
    index = rt.capacity.pool(pool["id"]) if rt.capacity is not None else None
    if index is not None:
        hosts = index.host_share_per_gpu()
    else:
        rows = await (await conn.execute(queries.HOST_SHARE_PER_GPU, {"pool_id": pool["id"]})).fetchall()
        hosts = {r["resource"]: Fraction(r["per_gpu"]) for r in rows}
    return {**hosts, **out}


def resolve(requested: dict[str, int | None] | None, share_per_gpu: dict[str, Fraction],
            gpus: Fraction | int) -> tuple[dict[str, int], dict[str, int]]:
    """(what is booked per node, the share): the share rounded down, the request raised to it."""
    share = {r: math.floor(share_per_gpu[r] * gpus) for r in SHARED if r in share_per_gpu}
    share = {r: v for r, v in share.items() if v > 0}
    requested = requested or {}
    booked = {r: max(requested.get(r) or 0, share.get(r, 0)) for r in HOST_RESOURCES}
    return booked, share


def excess(row: dict[str, Any]) -> dict[str, int]:
    """The quota a reservation's host resources take beyond its share (per node)."""
    share = row.get("host_share")
    booked = (row.get("request") or {}).get("resources")
    if share is None or not booked:
        return {}
    return {"vcpu": max(0, booked.get("vcpu", 0) - share.get("vcpu", 0)),
            "memoryGiB": max(0, booked.get("memoryGiB", 0) - share.get("memoryGiB", 0))
            + booked.get("hugepages1Gi", 0)}


def attributes(row: dict[str, Any]) -> dict[str, int]:
    """What IAM sees: the CPUs and memory booked (1 GiB huge pages counted as memory)."""
    booked = (row.get("request") or {}).get("resources") or {}
    return {"vcpu": booked.get("vcpu", 0), "memoryGiB": booked.get("memoryGiB", 0) + booked.get("hugepages1Gi", 0)}
