"""Host resources (spec "Host resources"): the capacity.hosts reconciler, and the cpuset a hold
with limits is pinned to.

The reconciler keeps each host's bookable vcpu, memoryGiB, hugepages2Mi and hugepages1Gi rows in
step with its applied inventory: at once when an inventory is applied (controlplane.nodes.inventory
calls `sync_node` in that transaction), and in a pass every host_sync_seconds over the nodes whose
rows differ (the arithmetic is the SQL function host_resources_of, migration 0018). Each node is
synced in a transaction of its own, under its pool's lock, as every change placement reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db
from controlplane.nodes import cpulist, queries
from controlplane.nodes.locking import lock_for_placement_change

log = structlog.get_logger(__name__)

GIB = 1 << 30


async def sync_node(conn: AsyncConnection, node_id: str) -> int:
    """The node's rows from its applied inventory (the caller holds its pool lock); rows changed."""
    return (await (await conn.execute(queries.SYNC_HOST_RESOURCES, {"node_id": node_id})).fetchone())["changed"]


async def sync_pass(pool: AsyncConnectionPool) -> int:
    """One pass of the reconciler: every node whose rows differ from its inventory; rows changed."""
    async with db.read_only(pool) as conn:
        stale = [r["id"] for r in await (await conn.execute(queries.HOSTS_OUT_OF_STEP)).fetchall()]
    changed = 0
    for node_id in stale:
        async def work(conn: AsyncConnection, node_id: str = node_id) -> int:
            if await lock_for_placement_change(conn, node_id) is None:
                return 0
            return await sync_node(conn, node_id)

        changed += await db.run_in_transaction(pool, work)
    if changed:
        log.info("host resources brought in step with inventory", nodes=len(stale), rows=changed)
    return changed


async def run(pool: AsyncConnectionPool, every_seconds: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await sync_pass(pool)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("host resources pass failed; continuing")
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_seconds)
        except TimeoutError:
            pass


@dataclasses.dataclass(frozen=True)
class NumaFacts:
    """A node's NUMA facts as a pinned hold needs them, parsed once for all its holds: each NUMA
    node's CPUs (the lists read together within one list's bounds, cpulist.parse_all) and memory,
    the GPUs' NUMA nodes, and the host reserve (the lowest `reserve` non-isolated CPUs)."""
    cpus: dict[int, frozenset[int]]
    memory: dict[int, int]
    numa_of: dict[str, int]
    reserved: frozenset[int]

    @classmethod
    def of(cls, inventory: dict[str, Any], reserve: int) -> NumaFacts:
        nodes = [n for n in inventory.get("numa_nodes") or [] if isinstance(n.get("id"), int)]
        lists = cpulist.parse_all(str(n.get("cpulist") or "") for n in nodes)
        cpus: dict[int, frozenset[int]] = {}
        memory: dict[int, int] = {}
        for n, ids in zip(nodes, lists):
            cpus[n["id"]] = cpus.get(n["id"], frozenset()) | ids
            memory[n["id"]] = memory.get(n["id"], 0) + int(n.get("memory_bytes") or 0)
        isolated = cpulist.parse(str(inventory.get("isolated_cpus") or ""))
        every = frozenset().union(*cpus.values())
        return cls(cpus=cpus, memory=memory,
                   numa_of={g.get("uuid"): g.get("numa_node", 0) for g in inventory.get("gpus") or []},
                   reserved=frozenset(sorted(every - isolated)[:max(0, reserve)]))


def cpuset(facts: NumaFacts, gpu_uuids: Iterable[str], vcpu: int, memory_gib: int) -> tuple[str, str]:
    """(cpus, mems) for a hold of these GPUs: the CPUs of their NUMA nodes when those have at least
    `vcpu` of them, and the NUMA nodes themselves when they have `memory_gib` of memory; "" when
    not. The host reserve is never part of it."""
    wanted = sorted({facts.numa_of[u] for u in (g.split(":", 1)[0] for g in gpu_uuids) if u in facts.numa_of}
                    & facts.cpus.keys())
    if not wanted:
        return "", ""
    cpus = frozenset().union(*(facts.cpus[i] for i in wanted)) - facts.reserved
    memory = sum(facts.memory[i] for i in wanted)
    return (cpulist.format_list(cpus) if 0 < vcpu <= len(cpus) else "",
            ",".join(str(i) for i in wanted) if 0 < memory_gib and memory_gib * GIB <= memory else "")
