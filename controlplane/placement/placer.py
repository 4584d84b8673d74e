"""Placing one allocation: plan with the capacity index (or the SQL shortlist), commit under the
pool lock, re-plan on a lost race.

The pool lock and the lock order: controlplane.common.locks.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane.config import Settings
from controlplane.ids import new_id
from controlplane.metrics import Metrics
from controlplane.placement import planner, queries
from controlplane.placement.index import Window
from controlplane.placement.index_sync import CapacityIndex

log = structlog.get_logger(__name__)

GIB = 1 << 30

_rng = random.SystemRandom()


@dataclass(frozen=True)
class Ask:
    """What one allocation needs, on one node, for one window (epoch ms)."""

    pool_id: str
    count: int
    topology: str
    model: str
    selector: dict[str, str]
    start_ms: int
    end_ms: int
    # Labels required beyond the selector, matched whole (value and source): a binding's capability.
    required: dict[str, dict[str, str]] = field(default_factory=dict)
    device_class: str = "gpu"  # the atoms' kind: gpu, gpu.mig or gpu.slot
    profile: str = ""  # a MIG profile ('' any)
    # Host resources booked on the node with the devices ({"vcpu": 4, "memoryGiB": 64, ...}).
    host: dict[str, int] = field(default_factory=dict)

    def host_amounts(self) -> dict[str, int]:
        """The host resources this allocation books (those above 0)."""
        return {k: v for k, v in sorted(self.host.items()) if v > 0}

    def params(self, **extra: Any) -> dict[str, Any]:
        return {
            "pool_id": self.pool_id,
            "device_class": self.device_class,
            "profile": self.profile,
            "count": self.count,
            "topology": self.topology,
            "model": self.model,
            "selector": Jsonb({**{k: {"value": v} for k, v in self.selector.items()}, **self.required}),
            "start": self.start_ms,
            "end": self.end_ms,
            "host": Jsonb(self.host_amounts()),
            "device": Jsonb(self.device()),  # the shape the commits check (atoms_as_asked)
            **extra,
        }

    def device(self) -> dict[str, str]:
        """The device shape its atoms must have (the commits' atoms_as_asked, migration 0063)."""
        return {"class": self.device_class, "model": self.model, "profile": self.profile, "topology": self.topology}

    def window(self) -> Window:
        required = tuple((k, v.get("value", ""), v.get("source", "")) for k, v in sorted(self.required.items()))
        return Window(self.count, self.topology, self.model, self.selector, self.start_ms, self.end_ms,
                      required=required, device_class=self.device_class, profile=self.profile,
                      host=tuple(self.host_amounts().items()))


@dataclass
class Placement:
    allocation_id: str
    node_id: str
    atom_ids: tuple[str, ...]
    device_uuids: tuple[str, ...]


@dataclass
class Planned:
    plan: planner.Plan | None
    uuids: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)  # set again by `plan` before its reads


async def plan(
    conn: AsyncConnection, ask: Ask, settings: Settings, exclude: frozenset[str] = frozenset(),
    index: CapacityIndex | None = None,
) -> Planned:
    """The best node (a random pick among the placement_top_n best), or no plan when nothing fits.

    With the capacity index: planned in memory, no read. When the index has no plan (its pool is
    not built yet, or nothing fits there, which may be a change it has not heard of yet) the SQL
    shortlist answers, so "does not fit" is always PostgreSQL's word."""
    started = time.perf_counter()
    if index is not None:
        planned = plan_from_index(index, ask, settings, exclude)
        if planned is not None:
            planned.started = started
            return planned
    return await plan_from_sql(conn, ask, settings, exclude, started)


def plan_from_index(index: CapacityIndex, ask: Ask, settings: Settings, exclude: frozenset[str]) -> Planned | None:
    pool = index.pool(ask.pool_id)
    if pool is None:
        return None
    window = ask.window()
    candidates = pool.candidates(window, enough=settings.placement_top_n, exclude=exclude, rng=_rng)
    chosen = planner.choose(candidates, ask.count, ask.topology, top_n=settings.placement_top_n, rng=_rng,
                            exclude=exclude)
    if chosen is None:
        return None
    node = pool.nodes[chosen.node_id]
    index.planned += 1
    return Planned(chosen, {a: node.atoms[a].device_uuid for a in chosen.atom_ids})


async def plan_from_sql(
    conn: AsyncConnection, ask: Ask, settings: Settings, exclude: frozenset[str], started: float
) -> Planned:
    """The best node of a shortlist (placement_shortlist nodes) read from the tables."""
    rows = await (
        await conn.execute(queries.SHORTLIST, ask.params(exclude=list(exclude), limit=settings.placement_shortlist))
    ).fetchall()
    by_node: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_node[row["node_id"]].append(row)
    candidates = [
        planner.Candidate(
            node_id=node_id,
            node_name=atoms[0]["node_name"],
            free=tuple(planner.FreeAtom(a["atom_id"], a["numa_node"], a["nvlink_domain"]) for a in atoms),
        )
        for node_id, atoms in by_node.items()
    ]
    chosen = planner.choose(candidates, ask.count, ask.topology, top_n=settings.placement_top_n, rng=_rng,
                            exclude=exclude)
    return Planned(chosen, {r["atom_id"]: r["device_uuid"] for r in rows}, started)


async def commit(
    conn: AsyncConnection,
    ask: Ask,
    reservation_id: str,
    planned: Planned,
    settings: Settings,
    exclude: frozenset[str] = frozenset(),
    metrics: Metrics | None = None,
    index: CapacityIndex | None = None,
) -> Placement | None:
    """Insert the planned allocation and bookings (the pool lock must be held). A lost race
    deletes the partial allocation, refreshes that node in the index and plans again (a node that
    loses twice is excluded: `lost_on`), at most placement_max_attempts times, the last plan read
    from the tables.
    `metrics` gets the time from the first plan to the outcome."""
    placement = await _commit(conn, ask, reservation_id, planned, settings, exclude, index)
    if metrics is not None:
        metrics.placement(planned.started, placement is not None)
    return placement


async def _commit(
    conn: AsyncConnection, ask: Ask, reservation_id: str, planned: Planned, settings: Settings,
    exclude: frozenset[str], index: CapacityIndex | None,
) -> Placement | None:
    excluded: set[str] = set(exclude)
    lost: set[str] = set()
    for attempt in range(settings.placement_max_attempts):
        if planned.plan is None:
            return None
        chosen = planned.plan
        allocation_id = new_id("alloc")
        uuids = tuple(planned.uuids[a] for a in chosen.atom_ids)
        cur = await conn.execute(
            queries.INSERT_PLACEMENT,
            ask.params(allocation_id=allocation_id, reservation_id=reservation_id, node_id=chosen.node_id,
                       device_ids=list(uuids), atom_ids=list(chosen.atom_ids)),
        )
        booked = len(await cur.fetchall())  # rows, not rowcount: also right in pipeline mode
        if booked == len(chosen.atom_ids) and await book_host(conn, ask, allocation_id, chosen.node_id):
            return Placement(allocation_id, chosen.node_id, chosen.atom_ids, uuids)
        # Lost: an overlapping booking (skipped by ON CONFLICT DO NOTHING, the EXCLUDE constraint's
        # word) or an atom or the node no longer schedulable. The allocation goes, with whatever
        # bookings it got; no savepoint needed, so the won case is one round trip.
        await conn.execute(queries.DELETE_ALLOCATION, {"id": allocation_id})
        log.info("placement race lost", node_id=chosen.node_id, attempt=attempt + 1,
                 booked=booked, wanted=len(chosen.atom_ids))
        lost_on(lost, excluded, chosen.node_id)
        if index is not None:  # what the index missed about that node, read under the lock
            await index.refresh(conn, {chosen.node_id: ask.pool_id})
        if attempt + 1 == settings.placement_max_attempts:
            break
        if attempt + 2 == settings.placement_max_attempts:
            # The last attempt is planned from the tables under the pool lock (PostgreSQL's word,
            # the caller's exclusions only), so a stale index cannot spend every attempt on nodes
            # it believes have room and leave the request pending with room elsewhere.
            planned = await plan_from_sql(conn, ask, settings, exclude, time.perf_counter())
        else:
            planned = await plan(conn, ask, settings, exclude=frozenset(excluded), index=index)
    return None


def lost_on(lost: set[str], excluded: set[str], node_id: str) -> None:
    """A race lost on `node_id`: the next plan may use it again, since it plans on what was just
    read of it under the pool lock (the index had missed a booking or a health change there: in a
    pool of one fitting node, excluding it would leave the request pending with room for it). A
    second loss on the same node excludes it."""
    if node_id in lost:
        excluded.add(node_id)
    lost.add(node_id)


async def book_host(conn: AsyncConnection, ask: Ask, allocation_id: str, node_id: str) -> bool:
    """Book the ask's host resources for the allocation (its devices booked in this transaction)
    and set its limits; False when the node cannot give them (nothing booked: the guard of
    migration 0018 decides, under a lock of the node's resource rows). True at once when the ask
    books none."""
    amounts = ask.host_amounts()
    if not amounts:
        return True
    row = await (await conn.execute(queries.BOOK_HOST, ask.params(
        allocation_id=allocation_id, node_id=node_id, limits=Jsonb(limits_of(amounts))))).fetchone()
    return bool(row["ok"])


def limits_of(amounts: dict[str, int]) -> dict[str, int]:
    """An allocation's limits from its host resources: what DeviceAssignment.limits carries, and
    the booked amounts its cpuset is sized from (controlplane.nodes.desired)."""
    vcpu, memory, pages = amounts.get("vcpu", 0), amounts.get("memoryGiB", 0), amounts.get("hugepages1Gi", 0)
    return {"cpu_millis": vcpu * 1000, "memory_bytes": memory * GIB, "hugepages_1gi": pages,
            "vcpu": vcpu, "memoryGiB": memory}


async def explain(conn: AsyncConnection, ask: Ask) -> str:
    """A human reason for an Unschedulable condition."""
    facts = await (await conn.execute(queries.DIAGNOSE, ask.params())).fetchone()
    shape = planner.shape_words(ask.count, ask.device_class, ask.profile, ask.model, ask.topology, "free healthy")
    if ask.host_amounts():
        shape += " with " + ", ".join(f"{v} {k}" for k, v in ask.host_amounts().items()) + " of host resources free"
    parts = [f"no node has {shape} for the window"]
    if facts["nodes"] == 0:
        return "the pool has no nodes"
    parts.append(f"{facts['nodes']} nodes in the pool")
    for key, words in (("cordoned", "cordoned"), ("unreachable", "unreachable"),
                       ("unlabelled", "without the selected labels")):
        if facts[key]:
            parts.append(f"{facts[key]} {words}")
    parts.append(f"at most {facts['most_free']} free {planner.noun(ask.device_class)}s on one eligible node")
    return "; ".join(parts)
