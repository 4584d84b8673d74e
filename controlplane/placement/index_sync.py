"""Building the capacity index from PostgreSQL and keeping it current through one channel.

Every writer of bookings, atoms, host resources and the node facts placement filters on notifies
`bc_capacity` (triggers, so no path can forget), one of:
- "<pool id> <node id> delta <seq> <ops>" (migration 0025): the intervals a statement added to or
  removed from the node's atoms, applied as they are, with no read;
- "<pool id> <node id> bookings": too many for one payload (a bulk load): the node's bookings are
  re-read;
- "<pool id> <node id> node" (migration 0015): anything else; the node's facts (node, atoms, host
  resources) are re-read and its atoms keep their intervals.
RECONNECTED (the LISTEN helper's re-read rule) rebuilds every pool from rows: until the first
build the index answers nothing and placement uses SQL.

Only the listener task applies notifications, in commit order; a placement that lost a race
refreshes one node itself. Each read takes a ticket first and a node is replaced only by a read
that started later than the one that wrote it, so an older read never overwrites a newer one;
applying a delta takes a ticket too, so a read that started before it is dropped. A delta is
idempotent (adding an interval the atom has, or removing one it has not, changes nothing), so a
delta whose commit a read already saw, arriving after that read, changes nothing either: after
every notification up to a commit is applied, the index holds what that commit left.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

import structlog
from psycopg import AsyncConnection
from psycopg.rows import dict_row, tuple_row
from psycopg_pool import AsyncConnectionPool

from controlplane.listen import RECONNECTED, TICK, listen
from controlplane.placement import index_queries as q
from controlplane.placement.index import Node, PoolIndex, build_nodes

log = structlog.get_logger(__name__)

CHANNEL = "bc_capacity"


class CapacityIndex:
    def __init__(self, db: AsyncConnectionPool) -> None:
        self.pools: dict[str, PoolIndex] = {}
        self.ready = False
        self.builds = 0  # full builds so far (one per (re)connect)
        self.planned = 0  # plans the index made (the rest fell back to SQL)
        self._db = db
        self._tickets = itertools.count(1)
        self._barriers: dict[str, asyncio.Event] = {}

    def pool(self, pool_id: str) -> PoolIndex | None:
        return self.pools.get(pool_id) if self.ready else None

    # -- the listener ------------------------------------------------------------------------

    async def run(self, conninfo: str, stopping: asyncio.Event) -> None:
        async with listen(conninfo, [CHANNEL], stopping, name="capacity-index") as listener:
            async for item in listener:
                if item is TICK:
                    continue
                if item is RECONNECTED:
                    # A barrier waiting now may have been notified while no one listened; the build
                    # reads every change committed before it was asked, so it answers it.
                    waiting = list(self._barriers.values())
                    try:
                        await self.build()
                    except Exception as exc:  # noqa: BLE001 - logged; the next reconnect rebuilds
                        log.warning("capacity index build failed", error=str(exc))
                        self.ready = False
                        await listener.reset()
                        continue
                    for event in waiting:
                        event.set()
                    continue
                notes = [item, *listener.received()]
                try:
                    await self._apply([n.payload for n in notes])
                except Exception as exc:  # noqa: BLE001 - a reconnect rebuilds from rows
                    log.warning("capacity index refresh failed; rebuilding", error=str(exc))
                    self.ready = False
                    await listener.reset()

    async def build(self) -> None:
        """Every pool from rows (after each (re)connect: what was missed is re-read)."""
        ticket = next(self._tickets)
        started = time.perf_counter()
        async with self._db.connection() as conn:
            conn.row_factory = dict_row
            pool_ids = [r["id"] for r in await (await conn.execute(q.POOLS)).fetchall()]
            pools = {}
            for pool_id in pool_ids:
                pools[pool_id] = PoolIndex(pool_id)
                pools[pool_id].load((await _read(conn, pool=pool_id, nodes=[], ticket=ticket)).values())
        self.pools, self.ready = pools, True
        self.builds += 1
        log.info("capacity index built", pools=len(pools), nodes=sum(len(p.nodes) for p in pools.values()),
                 bookings=sum(len(a.intervals) for p in pools.values() for n in p.nodes.values() for a in n.atoms.values()),
                 seconds=round(time.perf_counter() - started, 3))

    async def _apply(self, payloads: list[str]) -> None:
        """One batch of notifications: deltas applied at once, in order; then the reads."""
        whole: dict[str, str] = {}  # node -> pool: re-read all of it
        facts: dict[str, str] = {}  # node -> pool: re-read its facts, keep its intervals
        booked: dict[str, str] = {}  # node -> pool: re-read its bookings only
        done: list[str] = []
        ticket = next(self._tickets)
        for payload in payloads:
            head, _, rest = payload.partition(" ")
            if head == "barrier":
                done.append(rest)
                continue
            node_id, _, what = rest.partition(" ")
            if what.startswith("delta "):
                if not self._delta(head, node_id, what, ticket):
                    whole[node_id] = head
            else:
                (booked if what == "bookings" else facts)[node_id] = head
        booked = {n: p for n, p in booked.items() if n not in whole}
        facts = {n: p for n, p in facts.items() if n not in whole}
        if whole or facts or booked:
            async with self._db.connection() as conn:
                conn.row_factory = dict_row
                if whole:
                    await self.refresh(conn, whole)
                if facts:
                    await self.refresh_facts(conn, facts)
                if booked:
                    await self.refresh_bookings(conn, booked)
        for token in done:
            event = self._barriers.get(token)
            if event is not None:
                event.set()

    def _delta(self, pool_id: str, node_id: str, what: str, ticket: int) -> bool:
        """Apply "delta <seq> <op>;<op>;..." to a node the index holds; False when it must be read
        instead (a node or atom the index does not hold yet)."""
        pool = self.pools.get(pool_id)
        node = pool.nodes.get(node_id) if pool is not None else None
        if node is None:
            return not self.ready  # before the first build there is nothing to keep current
        ops = what.split(" ", 2)[2]
        for op in ops.split(";"):
            atom_id, start, end = op[1:].split(",")
            if op[0] == "+":
                if not pool.book(node_id, atom_id, int(start), int(end)):
                    return False
            else:
                pool.unbook(node_id, atom_id, int(start), int(end))
        node.ticket = ticket
        return True

    async def refresh(self, conn: AsyncConnection, node_ids: dict[str, str]) -> None:
        """Re-read these nodes ({node id: pool id it was notified under}); a node no longer in
        that pool (deleted or moved) leaves it."""
        ticket = next(self._tickets)
        nodes = await _read(conn, pool=None, nodes=list(node_ids), ticket=ticket)
        self._replace(node_ids, nodes, ticket)

    def _replace(self, node_ids: dict[str, str], nodes: dict[str, Node], ticket: int) -> None:
        for node_id, pool_id in node_ids.items():
            fresh = nodes.get(node_id)
            for index in {pool_id, fresh.pool_id if fresh else pool_id}:
                pool = self.pools.get(index)
                if pool is None:
                    if fresh is None or not self.ready:
                        continue
                    pool = self.pools[index] = PoolIndex(index)  # a pool made after the build
                current = pool.nodes.get(node_id)
                if current is not None and current.ticket > ticket:
                    continue  # a later read already wrote it
                if fresh is not None and fresh.pool_id == index:
                    pool.put(fresh)
                else:
                    pool.remove(node_id)

    async def refresh_facts(self, conn: AsyncConnection, node_ids: dict[str, str]) -> None:
        """Re-read these nodes' facts, not their bookings: each atom the index holds keeps its
        intervals. An atom new to the index starts with none: its bookings were inserted after it
        (they reference it), so their deltas come after this notification. A node the index does
        not hold in that pool is read whole."""
        known = {n: p for n, p in node_ids.items() if p in self.pools and n in self.pools[p].nodes}
        rest = {n: p for n, p in node_ids.items() if n not in known}
        if known:
            ticket = next(self._tickets)
            nodes = await _read(conn, pool=None, nodes=list(known), ticket=ticket, bookings=False)
            for node_id, pool_id in known.items():
                fresh, current = nodes.get(node_id), self.pools[pool_id].nodes.get(node_id)
                if fresh is not None and current is not None:
                    for atom_id, atom in fresh.atoms.items():
                        held = current.atoms.get(atom_id)
                        if held is not None:
                            atom.intervals = list(held.intervals)
            self._replace(known, nodes, ticket)
        if rest:
            await self.refresh(conn, rest)

    async def refresh_bookings(self, conn: AsyncConnection, node_ids: dict[str, str]) -> None:
        """Re-read only the bookings (devices' and host resources') of these nodes (a change too
        large for a delta, or host bookings, which send no delta); a node the index does not hold
        is read whole."""
        ticket = next(self._tickets)
        known = {n: p for n, p in node_ids.items() if p in self.pools and n in self.pools[p].nodes}
        cur = conn.cursor(row_factory=dict_row)
        rows = await (await cur.execute(q.BOOKINGS, {"pool": None, "nodes": list(known)})).fetchall()
        host_rows = await (await cur.execute(q.HOST_BOOKINGS, {"pool": None, "nodes": list(known)})).fetchall()
        by_node: dict[str, list[dict]] = {n: [] for n in known}
        for row in rows:
            by_node.setdefault(row["node_id"], []).append(row)
        host_by_node: dict[str, list[dict]] = {n: [] for n in known}
        for row in host_rows:
            host_by_node.setdefault(row["node_id"], []).append(row)
        for node_id, pool_id in known.items():
            pool = self.pools.get(pool_id)
            current = pool.nodes.get(node_id) if pool else None
            if current is None or current.ticket > ticket:
                continue
            pool.put(current.with_bookings(by_node[node_id], ticket, host_by_node[node_id]))
        rest = {n: p for n, p in node_ids.items() if n not in known}
        if rest:
            await self.refresh(conn, rest)

    async def barrier(self, timeout: float = 30.0) -> None:
        """Return once every change committed before this call is in the index."""
        token = uuid.uuid4().hex
        event = self._barriers[token] = asyncio.Event()
        try:
            async with self._db.connection() as conn:
                await conn.execute(q.BARRIER, {"token": token})
                await conn.commit()
            await asyncio.wait_for(event.wait(), timeout)
        finally:
            self._barriers.pop(token, None)


async def _read(
    conn: AsyncConnection, *, pool: str | None, nodes: list[str], ticket: int, bookings: bool = True,
) -> dict[str, Node]:
    params = {"pool": pool, "nodes": nodes}
    cur = conn.cursor(row_factory=dict_row)
    rows = []
    for query in (q.NODES, q.ATOMS, q.HOST_RESOURCES, q.HOST_BOOKINGS):
        await cur.execute(query, params)
        rows.append(await cur.fetchall())
    built = build_nodes(rows[0], rows[1], [], rows[2], rows[3], ticket=ticket)
    if bookings:  # as tuples: a million of them are read a second faster than as dicts
        atoms = {a.id: a for node in built.values() for a in node.atoms.values()}
        booked = conn.cursor(row_factory=tuple_row)
        await booked.execute(q.BOOKINGS, params)
        for atom_id, _node_id, start, end in await booked.fetchall():
            atom = atoms.get(atom_id)
            if atom is not None:
                atom.intervals.append((start, end))
        for atom in atoms.values():
            atom.intervals.sort()
    return built


async def read_pool(conn: AsyncConnection, pool_id: str) -> PoolIndex:
    """One pool's index read from rows on `conn` (its transaction's view, own writes included), for
    a plan that must not rest on the shared index alone (a gang the index found no room for)."""
    pool = PoolIndex(pool_id)
    pool.load((await _read(conn, pool=pool_id, nodes=[], ticket=0)).values())
    return pool
