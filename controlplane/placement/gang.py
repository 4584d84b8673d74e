"""Gang placement (spec "How a gang is placed"): `size` nodes sharing one value of a node label,
each taking all of the per-node request, committed all together or not at all.

1. Every node of the pool is planned for the per-node request on the capacity index, with the
   normal filters, atom pick and scorer (controlplane.placement.planner). Gangs never use the SQL
   shortlist: without a built index the pool is read from rows into an index of its own.
2. The fitting nodes are grouped by their `topologyKey` label value (nodes without the label never
   join; without a key the whole pool is one group). Each group with at least `size` fitting nodes
   contributes a candidate gang of its `size` best nodes (ties between equally good nodes broken
   at random).
3. Candidate gangs are ranked by the sum of their members' scores, then by group name, and one is
   picked at random among the best `topN`.
4. All members are committed inside one outer savepoint, one allocation per node. If any member
   loses a race the whole gang rolls back, that node is excluded (and refreshed in the index), and
   the gang is planned again, up to `placement_max_attempts` times. A cheap probe first finds
   planned atoms already booked in the window (a change the index has not heard of yet), which are
   lost the same way without paying for the whole gang's insert and rollback.

The plan is pure (`plan_in`); `plan` finds the index to plan on, `commit` writes under the pool lock.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane.config import Settings
from controlplane.ids import new_id
from controlplane.metrics import Metrics
from controlplane.placement import gang_queries, placer, planner
from controlplane.placement.index import Node, PoolIndex, Window
from controlplane.placement.index_sync import CapacityIndex, read_pool
from controlplane.placement.placer import Ask, Placement

log = structlog.get_logger(__name__)

_rng = random.SystemRandom()

# The plan of a node with no booking in the window depends only on the node (its atoms, health and
# NUMA/NVLink layout) and the request's shape, so it is kept per node object and shape: the index
# replaces a node's object whenever it re-reads the node, which retires the entry. A gang plans every
# node of the pool, and in a large pool most nodes are idle for any one window.
_IDLE_PLANS: dict[tuple[str, int, str, str, str, str], tuple[Node, planner.Plan | None]] = {}
_IDLE_PLANS_MAX = 500_000


@dataclass(frozen=True)
class Gang:
    size: int
    key: str  # the node label every member shares; "" for any nodes of the pool

    @classmethod
    def of(cls, request: dict[str, Any]) -> Gang | None:
        """The stored request's gang, or None when it is not one."""
        raw = request.get("gang")
        return cls(raw["size"], raw.get("topologyKey") or "") if raw else None


@dataclass(frozen=True)
class GangPlan:
    group: str  # the members' label value ("" without a key)
    members: tuple[planner.Plan, ...]
    uuids: dict[str, str]  # atom id -> device uuid, for every member's atoms

    @property
    def score(self) -> float:
        return sum(m.score for m in self.members)

    @property
    def node_ids(self) -> list[str]:
        return [m.node_id for m in self.members]


@dataclass
class GangPlanned:
    plan: GangPlan | None
    reason: str = ""  # why nothing fits, when plan is None
    started: float = field(default_factory=time.perf_counter)


def label_value(labels: dict[str, Any], key: str) -> str | None:
    """The node's value of label `key` (any source), or None when it has none."""
    label = labels.get(key)
    if not isinstance(label, dict):
        return None
    value = label.get("value")
    return value if isinstance(value, str) and value else None


def no_fit_reason(size: int, key: str, most: int, *, within: str | None = None) -> str:
    """The Unschedulable message: `no gang of 4 nodes fits in one fabric.domain (at most 3 nodes fit
    together)`."""
    where = f"{key}={within}" if within is not None and key else (f"one {key}" if key else "the pool")
    noun = "node" if size == 1 else "nodes"
    return f"no gang of {size} {noun} fits in {where} (at most {most} {'node fits' if most == 1 else 'nodes fit'} together)"


def plan_in(
    pool: PoolIndex, window: Window, gang: Gang, *, top_n: int, rng: random.Random,
    exclude: frozenset[str] = frozenset(), within: str | None = None,
) -> GangPlanned:
    """The gang to commit, planned on `pool`; `within` keeps to one label value (a member repair)."""
    fitting: dict[str, list[planner.Plan]] = defaultdict(list)
    busy = pool.touched(window.start_ms, window.end_ms)
    for node in pool.nodes.values():
        if node.id in exclude or not node.matches(window) or not node.host_fits(window):
            continue
        group = label_value(node.labels, gang.key) if gang.key else ""
        if group is None or (within is not None and group != within):
            continue
        if node.id in busy:
            chosen = planner.plan_node(pool.candidate(node, window), window.count, window.topology)
        else:
            chosen = _idle_plan(pool, node, window)
        if chosen is not None:
            fitting[group].append(chosen)
    gangs: list[GangPlan] = []
    for group, plans in fitting.items():
        if len(plans) < gang.size:
            continue
        # The best nodes; among equally good ones a random pick, so concurrent gangs (and a gang
        # planned on an index that has not yet heard of the last one) spread out instead of all
        # reaching for the same nodes.
        members = tuple(heapq.nsmallest(gang.size, plans, key=lambda p: (-p.score, rng.random())))
        uuids = {a: pool.nodes[m.node_id].atoms[a].device_uuid for m in members for a in m.atom_ids}
        gangs.append(GangPlan(group, members, uuids))
    if not gangs:
        most = max((len(p) for p in fitting.values()), default=0)
        return GangPlanned(None, no_fit_reason(gang.size, gang.key, most, within=within))
    gangs.sort(key=lambda g: (-g.score, g.group))
    return GangPlanned(rng.choice(gangs[: max(1, top_n)]))


def _idle_plan(pool: PoolIndex, node: Node, window: Window) -> planner.Plan | None:
    """plan_node for a node with no booking in the window, remembered per node object and shape."""
    key = (node.id, window.count, window.topology, window.model, window.device_class, window.profile)
    cached = _IDLE_PLANS.get(key)
    if cached is not None and cached[0] is node:
        return cached[1]
    if len(node.usable_sorted(window.model, window.device_class, window.profile)) < window.count:
        return None  # not remembered: a model or profile made up would fill the cache
    chosen = planner.plan_node(pool.candidate(node, window), window.count, window.topology)
    if len(_IDLE_PLANS) >= _IDLE_PLANS_MAX:
        _IDLE_PLANS.clear()
    _IDLE_PLANS[key] = (node, chosen)
    return chosen


async def plan(
    conn: AsyncConnection, ask: Ask, gang: Gang, settings: Settings, *, index: CapacityIndex | None = None,
    exclude: frozenset[str] = frozenset(), within: str | None = None,
) -> GangPlanned:
    """Plan on the capacity index. When it has no plan (its pool not built yet, or nothing fits
    there, which may be a change it has not heard of yet, or this transaction's own), the pool is
    read from rows in this transaction and planned again, so "does not fit" is PostgreSQL's word."""
    started = time.perf_counter()
    window = ask.window()
    pool = index.pool(ask.pool_id) if index is not None else None
    if pool is not None:
        planned = plan_in(pool, window, gang, top_n=settings.placement_top_n, rng=_rng, exclude=exclude,
                          within=within)
        if planned.plan is not None:
            planned.started = started
            return planned
    fresh = await read_pool(conn, ask.pool_id)
    planned = plan_in(fresh, window, gang, top_n=settings.placement_top_n, rng=_rng, exclude=exclude, within=within)
    planned.started = started
    return planned


class _Lost(Exception):
    """A member did not get all its bookings: the savepoint rolls the whole gang back."""

    def __init__(self, nodes: list[str]) -> None:
        super().__init__(", ".join(nodes))
        self.nodes = nodes


@dataclass
class Committed:
    placements: list[Placement] | None
    group: str = ""
    reason: str = ""  # why nothing was placed

    @property
    def node_ids(self) -> list[str]:
        return [p.node_id for p in self.placements or []]


async def commit(
    conn: AsyncConnection, ask: Ask, gang: Gang, reservation_id: str, planned: GangPlanned, settings: Settings,
    *, index: CapacityIndex | None = None, exclude: frozenset[str] = frozenset(), within: str | None = None,
    metrics: Metrics | None = None,
) -> Committed:
    """Insert every member (the pool lock must be held), re-planning after a lost race."""
    started = planned.started
    outcome = await _commit(conn, ask, gang, reservation_id, planned, settings, index, exclude, within)
    if metrics is not None:
        metrics.placement(started, outcome.placements is not None)
    return outcome


async def _commit(
    conn: AsyncConnection, ask: Ask, gang: Gang, reservation_id: str, planned: GangPlanned, settings: Settings,
    index: CapacityIndex | None, exclude: frozenset[str], within: str | None,
) -> Committed:
    excluded = set(exclude)
    lost_before: set[str] = set()  # nodes a race was lost on (placer.lost_on)
    for attempt in range(settings.placement_max_attempts):
        chosen = planned.plan
        if chosen is None:
            return Committed(None, reason=planned.reason)
        ids = [new_id("alloc") for _ in chosen.members]
        selector = dict(ask.selector)
        if gang.key:
            selector[gang.key] = chosen.group  # re-read under the lock: every member still carries it
        params = dataclasses.replace(ask, selector=selector).params(
            reservation_id=reservation_id, group=chosen.group,
            members=Jsonb([{"allocation_id": i, "node_id": m.node_id, "device_ids": [chosen.uuids[a] for a in m.atom_ids]}
                           for i, m in zip(ids, chosen.members)]),
            member_of=[i for i, m in zip(ids, chosen.members) for _ in m.atom_ids],
            atom_ids=[a for m in chosen.members for a in m.atom_ids],
        )
        try:
            taken = await (await conn.execute(gang_queries.TAKEN_NODES, params)).fetchall()
            if taken:
                raise _Lost([r["node_id"] for r in taken])
            async with conn.transaction():  # the outer savepoint: every member, or none
                rows = await (await conn.execute(gang_queries.INSERT_GANG, params)).fetchall()
                got = Counter(r["allocation_id"] for r in rows)
                lost = [m.node_id for i, m in zip(ids, chosen.members) if got[i] != len(m.atom_ids)]
                if lost:
                    raise _Lost(lost)
                for i, m in zip(ids, chosen.members):  # each member's host resources, as inline
                    if not await placer.book_host(conn, ask, i, m.node_id):
                        raise _Lost([m.node_id])
        except _Lost as exc:
            log.info("gang placement race lost", nodes=exc.nodes, attempt=attempt + 1, size=gang.size)
            for node_id in exc.nodes:  # planned again on what is read now; a second loss excludes it
                placer.lost_on(lost_before, excluded, node_id)
            if index is not None:  # what the index missed about those nodes, read under the lock
                await index.refresh(conn, {n: ask.pool_id for n in exc.nodes})
            if attempt + 1 == settings.placement_max_attempts:
                break
            # The last attempt is planned from the tables (under the pool lock, PostgreSQL's word),
            # so a stale index cannot spend every attempt and leave it pending with room for it.
            last = attempt + 2 == settings.placement_max_attempts
            planned = await plan(conn, ask, gang, settings, index=None if last else index,
                                 exclude=frozenset(exclude if last else excluded), within=within)
            continue
        placements = [Placement(i, m.node_id, m.atom_ids, tuple(chosen.uuids[a] for a in m.atom_ids))
                      for i, m in zip(ids, chosen.members)]
        return Committed(placements, chosen.group)
    return Committed(None, reason=f"no gang of {gang.size} nodes could be committed in "
                                  f"{settings.placement_max_attempts} attempts (lost races)")
