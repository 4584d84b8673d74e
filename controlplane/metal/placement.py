"""Whole machines for a window: a node lease books every bookable atom of ready, connected,
platform-trusted nodes whose daemon advertises binding.node: one machine, or with `gang` (spec 004:
"a binding: 'node' lease can be a gang of whole machines") `size` machines sharing one value of the
gang's topologyKey label.

Planned and committed under the pool lock, in one transaction (whole machines are few and a node
lease always places inline, like a gang), straight from the tables: the capacity index plans
device counts, not machines. Every whole machine is as good as another, so a gang's candidate
groups rank by name alone (spec "How a gang is placed", step 3) and its members are a random
sample of the group. All members are booked inside one savepoint; a member that loses a race to
the EXCLUDE constraint rolls the whole gang back, that node is excluded and the gang is planned
again, at most placement_max_attempts times.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane.config import Settings
from controlplane.ids import new_id
from controlplane.metal import queries
from controlplane.nodes.inventory import CAP_PREFIX, SYSTEM
from controlplane.placement import placer
from controlplane.placement.gang import Committed, Gang, label_value, no_fit_reason

log = structlog.get_logger(__name__)

_rng = random.SystemRandom()

CAPABILITY = "binding.node"
CAPABILITY_LABEL = CAP_PREFIX + CAPABILITY
_CAPABILITY = {CAPABILITY_LABEL: {"value": "true", "source": SYSTEM}}


def _params(ask: placer.Ask, **extra: Any) -> dict[str, Any]:
    selector = {**{k: {"value": v} for k, v in ask.selector.items()}, **_CAPABILITY}
    return {"pool_id": ask.pool_id, "count": ask.count, "model": ask.model, "selector": Jsonb(selector),
            "start": ask.start_ms, "end": ask.end_ms, **extra}


@dataclasses.dataclass(frozen=True)
class Machines:
    """The machines to book: their rows (LEASABLE_NODES) and the gang's label value ("" without a
    key), or none and why (a gang's reason; "" for one machine: `explain` says why)."""

    nodes: list[dict[str, Any]]
    group: str = ""
    reason: str = ""


async def plan(
    conn: AsyncConnection, ask: placer.Ask, gang: Gang | None, settings: Settings, *,
    exclude: frozenset[str] = frozenset(), within: str | None = None,
) -> Machines:
    """The machines a lease would book now (reads only; under the pool lock for a commit)."""
    key = gang.key if gang else ""
    found = await (await conn.execute(queries.LEASABLE_NODES, _params(
        ask, exclude=list(exclude), key=key, limit=None if gang else 1))).fetchall()
    if gang is None:
        return Machines(found[:1])
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for node in found:  # nodes without the label never join; without a key the pool is one group
        value = label_value({key: node["gang_label"]}, key) if key else ""
        if value is not None and (within is None or value == within):
            groups[value].append(node)
    candidates = sorted(g for g, members in groups.items() if len(members) >= gang.size)
    if not candidates:
        most = max((len(m) for m in groups.values()), default=0)
        reason, facts = no_fit_reason(gang.size, key, most, within=within), await explain(conn, ask, facts_only=most > 0)
        return Machines([], reason=f"{reason}; {facts}" if facts else reason)
    group = _rng.choice(candidates[: max(1, settings.placement_top_n)])
    return Machines(_rng.sample(groups[group], gang.size), group)


class _Lost(Exception):
    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self.node_id = node_id


async def commit(
    conn: AsyncConnection, ask: placer.Ask, gang: Gang | None, reservation_id: str, settings: Settings, *,
    exclude: frozenset[str] = frozenset(), within: str | None = None,
) -> Committed:
    """Book whole machines for the ask's window (the pool lock must be held): one, or every member
    of the gang inside one savepoint. A booking lost to the EXCLUDE constraint rolls them all back,
    excludes that node and plans again, at most placement_max_attempts times."""
    excluded = set(exclude)
    for attempt in range(settings.placement_max_attempts):
        machines = await plan(conn, ask, gang, settings, exclude=frozenset(excluded), within=within)
        if not machines.nodes:
            return Committed(None, reason=machines.reason)
        chosen = dataclasses.replace(ask, selector={**ask.selector, gang.key: machines.group}) if gang and gang.key else ask
        try:
            async with conn.transaction():
                placements = [await _book(conn, chosen, reservation_id, node, machines.group if gang else None)
                              for node in machines.nodes]
        except _Lost as exc:
            log.info("node lease race lost", node_id=exc.node_id, attempt=attempt + 1, size=len(machines.nodes))
            excluded.add(exc.node_id)
            continue
        return Committed(placements, machines.group)
    size = gang.size if gang else 1
    return Committed(None, reason=f"no {size} whole machine{'s' if size > 1 else ''} could be committed in "
                                  f"{settings.placement_max_attempts} attempts (lost races)")


async def _book(conn: AsyncConnection, ask: placer.Ask, reservation_id: str, node: dict[str, Any],
                group: str | None) -> placer.Placement:
    allocation_id = new_id("alloc")
    atom_ids, device_ids = list(node["atom_ids"]), list(node["device_ids"] or [])
    booked = await (await conn.execute(queries.INSERT_LEASE, _params(
        ask, allocation_id=allocation_id, reservation_id=reservation_id, node_id=node["node_id"],
        device_ids=device_ids, atom_ids=atom_ids, group=group))).fetchall()
    if len(booked) != len(atom_ids):
        raise _Lost(node["node_id"])
    return placer.Placement(allocation_id, node["node_id"], tuple(atom_ids), tuple(device_ids))


async def explain(conn: AsyncConnection, ask: placer.Ask, *, facts_only: bool = False) -> str:
    """A human reason for an Unschedulable condition (`facts_only`: the pool's counts, after a
    gang's own reason)."""
    facts = await (await conn.execute(queries.DIAGNOSE, _params(ask))).fetchone()
    if facts["nodes"] == 0:
        return "the pool has no nodes"
    model = f" {ask.model}" if ask.model else ""
    parts = [f"no ready, platform-trusted node with exactly {ask.count}{model} GPUs is free for the whole window",
             f"{facts['nodes']} nodes in the pool"][facts_only:]
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
