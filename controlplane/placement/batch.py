"""Placing a batch of allocations in one transaction (the pool-lease placer, DESIGN.md section 9).

The caller holds the pool lock. Every member is planned in memory with the capacity index, in the
batch's order, and each plan is marked in the index at once (its atoms booked for its window), so
the next member plans around it. Then one statement inserts every planned allocation and booking
(batch_queries.INSERT_BATCH). The bookings' EXCLUDE constraint is the last word: a member whose
bookings it refused (a booking the index had not heard of) loses only its own allocation, the
index re-reads that node under the lock, and the member is planned again without it, at most
placement_max_attempts times. A member the index finds no room for is planned from the tables
(the SQL shortlist, which sees this batch's inserts), as the inline placer does, so "does not
fit" is always PostgreSQL's word.

The marks stay after the commit: they are what was committed, and the commit's deltas add the
same intervals again, which changes nothing. After a rollback the caller re-reads the nodes the batch
touched (`forget`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane.config import Settings
from controlplane.ids import new_id
from controlplane.placement import batch_queries as q
from controlplane.placement import placer
from controlplane.placement.index_sync import CapacityIndex

log = structlog.get_logger(__name__)


@dataclass
class Member:
    """One allocation to place: its reservation and what it needs."""

    reservation_id: str
    ask: placer.Ask
    placement: placer.Placement | None = None
    excluded: set[str] = field(default_factory=set)
    lost_on: set[str] = field(default_factory=set)  # nodes it lost a race on once (see placer.lost_on)
    attempts: int = 0
    _planned: placer.Planned | None = None
    _allocation_id: str = ""


class Counted:
    """A connection that counts the statements sent through it (round trips to PostgreSQL)."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn
        self.statements = 0

    async def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
        self.statements += 1
        return await self._conn.execute(query, params, **kw)

    def cursor(self, *args: Any, **kw: Any) -> _CountedCursor:
        return _CountedCursor(self, self._conn.cursor(*args, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _CountedCursor:
    def __init__(self, owner: Counted, cursor: Any) -> None:
        self._owner = owner
        self._cursor = cursor

    async def execute(self, query: Any, params: Any = None, **kw: Any) -> _CountedCursor:
        self._owner.statements += 1
        await self._cursor.execute(query, params, **kw)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


@dataclass
class Batch:
    pool_id: str
    members: list[Member]
    touched: set[str] = field(default_factory=set)  # nodes the index was told about (marks, refreshes)
    lost_races: int = 0


async def place(conn: AsyncConnection, batch: Batch, settings: Settings, index: CapacityIndex | None) -> None:
    """Place what fits; a member left without `placement` fits nowhere (PostgreSQL's word)."""
    todo = list(batch.members)
    from_tables: list[Member] = []
    while todo:
        planned = []
        for m in todo:
            m.attempts += 1
            found = placer.plan_from_index(index, m.ask, settings, frozenset(m.excluded)) if index else None
            if found is None or found.plan is None:
                from_tables.append(m)
                continue
            m._planned, m._allocation_id = found, new_id("alloc")
            _mark(index, batch, found.plan.node_id, found.plan.atom_ids, m.ask)
            planned.append(m)
        lost = await _insert(conn, batch, planned)
        if lost:
            batch.lost_races += len(lost)
            nodes = {m._planned.plan.node_id for m in lost if m._planned and m._planned.plan}
            log.info("batch placement races lost", pool_id=batch.pool_id, members=len(lost), nodes=sorted(nodes))
            await conn.execute(q.DELETE_ALLOCATIONS, {"ids": [m._allocation_id for m in lost]})
            if index is not None:  # what the index missed about those nodes, read under the lock
                await index.refresh(conn, {n: batch.pool_id for n in nodes})
                batch.touched |= nodes
            for m in lost:  # planned again on what was read; a second loss there excludes the node
                placer.lost_on(m.lost_on, m.excluded, m._planned.plan.node_id)
        todo = [m for m in lost if m.attempts < settings.placement_max_attempts]
        # Attempts spent on nodes the index thought had room: planned from the tables (below).
        from_tables.extend(m for m in lost if m.attempts >= settings.placement_max_attempts)
    for m in from_tables:
        started = time.perf_counter()
        planned_sql = await placer.plan_from_sql(conn, m.ask, settings, frozenset(), started)  # the tables' word
        m.placement = await placer.commit(conn, m.ask, m.reservation_id, planned_sql, settings,
                                          index=index)
        if m.placement is not None and index is not None:
            _mark(index, batch, m.placement.node_id, m.placement.atom_ids, m.ask)


async def _insert(conn: AsyncConnection, batch: Batch, planned: list[Member]) -> list[Member]:
    """Insert the planned members' allocations and bookings in one statement; the members that
    did not get every booking they planned."""
    if not planned:
        return []
    atom_allocations: list[str] = []
    atom_ids: list[str] = []
    for m in planned:
        for atom_id in m._planned.plan.atom_ids:
            atom_allocations.append(m._allocation_id)
            atom_ids.append(atom_id)
    rows = await (await conn.execute(q.INSERT_BATCH, {
        "pool_id": batch.pool_id,
        "allocation_ids": [m._allocation_id for m in planned],
        "reservation_ids": [m.reservation_id for m in planned],
        "node_ids": [m._planned.plan.node_id for m in planned],
        "starts": [m.ask.start_ms for m in planned],
        "ends": [m.ask.end_ms for m in planned],
        "selectors": [Jsonb(m.ask.params()["selector"].obj) for m in planned],
        "devices": [Jsonb(m.ask.device()) for m in planned],
        "atom_allocations": atom_allocations,
        "atom_ids": atom_ids,
    })).fetchall()
    booked = Counter(r["allocation_id"] for r in rows)
    lost = []
    for m in planned:
        plan = m._planned.plan
        # Host resources go through the same guarded statement as an inline commit (one more
        # statement for a member that books any); a node that cannot give them lost the race.
        if booked[m._allocation_id] == len(plan.atom_ids) and await placer.book_host(
                conn, m.ask, m._allocation_id, plan.node_id):
            m.placement = placer.Placement(m._allocation_id, plan.node_id, plan.atom_ids,
                                           tuple(m._planned.uuids[a] for a in plan.atom_ids))
        else:
            lost.append(m)
    return lost


def _mark(index: CapacityIndex, batch: Batch, node_id: str, atom_ids: tuple[str, ...], ask: placer.Ask) -> None:
    """Book `atom_ids` of the node for the ask's window in the index (this process's view; the
    commit's deltas add the same intervals, which changes nothing)."""
    pool = index.pool(batch.pool_id)
    if pool is None or node_id not in pool.nodes:
        return
    for atom_id in atom_ids:
        pool.book(node_id, atom_id, ask.start_ms, ask.end_ms)
    host_booked = dict(pool.nodes[node_id].host_booked)  # host resources: no delta, a new node value
    for resource, amount in ask.host_amounts().items():
        host_booked[resource] = sorted([*host_booked.get(resource, ()), (ask.start_ms, ask.end_ms, float(amount))])
    if host_booked != pool.nodes[node_id].host_booked:
        pool.nodes[node_id] = dataclasses.replace(pool.nodes[node_id], host_booked=host_booked)
    batch.touched.add(node_id)


async def forget(index: CapacityIndex | None, conn: AsyncConnection, batch: Batch) -> None:
    """After a rollback: re-read the nodes the batch marked or refreshed, so the index holds no
    booking that was never committed."""
    if index is not None and batch.touched:
        await index.refresh(conn, {n: batch.pool_id for n in batch.touched})
