"""Whole machines for a window: a node lease books every bookable atom of one ready, connected,
platform-trusted node whose daemon advertises binding.node.

Planned and committed under the pool lock, in one transaction (whole machines are few and a node
lease always places inline, like a gang), straight from the tables: the capacity index plans
device counts, not machines. The EXCLUDE constraint on bookings stays the last word.

A node-lease gang (several machines, spec 004) would call `commit` once per member with the
members' nodes excluded; gangs are built separately, so one machine per lease today.
"""

from __future__ import annotations

from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane.config import Settings
from controlplane.ids import new_id
from controlplane.metal import queries
from controlplane.nodes.inventory import CAP_PREFIX, SYSTEM
from controlplane.placement import placer

log = structlog.get_logger(__name__)

CAPABILITY = "binding.node"
CAPABILITY_LABEL = CAP_PREFIX + CAPABILITY
_CAPABILITY = {CAPABILITY_LABEL: {"value": "true", "source": SYSTEM}}


def _params(ask: placer.Ask, **extra: Any) -> dict[str, Any]:
    selector = {**{k: {"value": v} for k, v in ask.selector.items()}, **_CAPABILITY}
    return {"pool_id": ask.pool_id, "count": ask.count, "model": ask.model, "selector": Jsonb(selector),
            "start": ask.start_ms, "end": ask.end_ms, **extra}


async def commit(
    conn: AsyncConnection, ask: placer.Ask, reservation_id: str, settings: Settings,
    exclude: frozenset[str] = frozenset(),
) -> placer.Placement | None:
    """Book a whole machine for the ask's window (the pool lock must be held), or None when no
    node is leasable for it. A booking lost to the EXCLUDE constraint excludes that node and tries
    another, at most placement_max_attempts times."""
    excluded = set(exclude)
    for attempt in range(settings.placement_max_attempts):
        found = await (await conn.execute(queries.LEASABLE_NODE, _params(ask, exclude=list(excluded)))).fetchone()
        if found is None:
            return None
        allocation_id = new_id("alloc")
        atom_ids, device_ids = list(found["atom_ids"]), list(found["device_ids"] or [])
        booked = await (await conn.execute(queries.INSERT_LEASE, _params(
            ask, allocation_id=allocation_id, reservation_id=reservation_id, node_id=found["node_id"],
            device_ids=device_ids, atom_ids=atom_ids))).fetchall()
        if len(booked) == len(atom_ids):
            return placer.Placement(allocation_id, found["node_id"], tuple(atom_ids), tuple(device_ids))
        await conn.execute(queries.DELETE_ALLOCATION, {"id": allocation_id})
        log.info("node lease race lost", node_id=found["node_id"], attempt=attempt + 1,
                 booked=len(booked), wanted=len(atom_ids))
        excluded.add(found["node_id"])
    return None


async def leasable(conn: AsyncConnection, ask: placer.Ask) -> dict[str, Any] | None:
    """The machine `commit` would book for the ask now (capacity.preview), or None."""
    return await (await conn.execute(queries.LEASABLE_NODE, _params(ask, exclude=[]))).fetchone()


async def explain(conn: AsyncConnection, ask: placer.Ask) -> str:
    """A human reason for an Unschedulable condition."""
    facts = await (await conn.execute(queries.DIAGNOSE, _params(ask))).fetchone()
    if facts["nodes"] == 0:
        return "the pool has no nodes"
    model = f" {ask.model}" if ask.model else ""
    parts = [f"no ready, platform-trusted node with exactly {ask.count}{model} GPUs is free for the whole window",
             f"{facts['nodes']} nodes in the pool"]
    for key, words in (("not_ready", "not ready (cordoned or leased)"), ("not_connected", "not connected"),
                       ("untrusted", "without a platform certificate"),
                       ("unlabelled", f"without the selected labels or {CAPABILITY_LABEL}"),
                       ("other_size", f"with another number of GPUs than {ask.count}")):
        if facts[key]:
            parts.append(f"{facts[key]} {words}")
    return "; ".join(parts)


async def not_leasable(conn: AsyncConnection, reservation_id: str) -> list[str]:
    """BookingRepair before the window (spec 004): the nodes of a placed node lease that are no
    longer leasable (not ready, unreachable, no longer platform-trusted or advertising the
    binding, or a booked atom unhealthy or gone)."""
    rows = await (await conn.execute(queries.NOT_LEASABLE, {
        "id": reservation_id, "capability": Jsonb(_CAPABILITY)})).fetchall()
    return [r["node_id"] for r in rows]
