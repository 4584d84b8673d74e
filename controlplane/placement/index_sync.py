"""Building the capacity index from PostgreSQL and keeping it current through one channel.

Every writer of bookings, atoms, host resources and the node facts placement filters on notifies
`bc_capacity` with "<pool id> <node id>" (triggers of migration 0015, so no path can forget); the
index re-reads that node's rows. RECONNECTED (the LISTEN helper's re-read rule) rebuilds every
pool from rows: until the first build the index answers nothing and placement uses SQL.

Only the listener task applies notifications, in order; a placement that lost a race refreshes one
node itself. Each read takes a ticket first and a node is replaced only by a read that started
later than the one that wrote it, so an older read never overwrites a newer one.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import structlog
from psycopg import AsyncConnection
from psycopg.rows import dict_row
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
                    try:
                        await self.build()
                    except Exception as exc:  # noqa: BLE001 - logged; the next reconnect rebuilds
                        log.warning("capacity index build failed", error=str(exc))
                        self.ready = False
                        await listener.reset()
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
        async with self._db.connection() as conn:
            conn.row_factory = dict_row
            pool_ids = [r["id"] for r in await (await conn.execute(q.POOLS)).fetchall()]
            pools = {}
            for pool_id in pool_ids:
                pools[pool_id] = PoolIndex(pool_id)
                for node in (await _read(conn, pool=pool_id, nodes=[], ticket=ticket)).values():
                    pools[pool_id].put(node)
        self.pools, self.ready = pools, True
        self.builds += 1
        log.info("capacity index built", pools=len(pools), nodes=sum(len(p.nodes) for p in pools.values()))

    async def _apply(self, payloads: list[str]) -> None:
        node_ids: dict[str, str] = {}  # node -> pool: re-read all of it
        booked: dict[str, str] = {}  # node -> pool: re-read its bookings only
        done: list[str] = []
        for payload in payloads:
            head, _, rest = payload.partition(" ")
            if head == "barrier":
                done.append(rest)
                continue
            node_id, _, what = rest.partition(" ")
            (booked if what == "bookings" else node_ids)[node_id] = head
        booked = {n: p for n, p in booked.items() if n not in node_ids}
        if node_ids or booked:
            async with self._db.connection() as conn:
                conn.row_factory = dict_row
                if node_ids:
                    await self.refresh(conn, node_ids)
                if booked:
                    await self.refresh_bookings(conn, booked)
        for token in done:
            event = self._barriers.get(token)
            if event is not None:
                event.set()

    async def refresh(self, conn: AsyncConnection, node_ids: dict[str, str]) -> None:
        """Re-read these nodes ({node id: pool id it was notified under}); a node no longer in
        that pool (deleted or moved) leaves it."""
        ticket = next(self._tickets)
        nodes = await _read(conn, pool=None, nodes=list(node_ids), ticket=ticket)
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

    async def refresh_bookings(self, conn: AsyncConnection, node_ids: dict[str, str]) -> None:
        """Re-read only the bookings (devices' and host resources') of these nodes; a node the index
        does not hold is read whole."""
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

    async def barrier(self, timeout: float = 10.0) -> None:
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


async def _read(conn: AsyncConnection, *, pool: str | None, nodes: list[str], ticket: int) -> dict[str, Node]:
    params = {"pool": pool, "nodes": nodes}
    cur = conn.cursor(row_factory=dict_row)
    rows = []
    for query in (q.NODES, q.ATOMS, q.BOOKINGS, q.HOST_RESOURCES, q.HOST_BOOKINGS):
        await cur.execute(query, params)
        rows.append(await cur.fetchall())
    return build_nodes(*rows, ticket=ticket)


async def read_pool(conn: AsyncConnection, pool_id: str) -> PoolIndex:
    """One pool's index read from rows on `conn` (its transaction's view, own writes included), for
    a plan that must not rest on the shared index alone (a gang the index found no room for)."""
    pool = PoolIndex(pool_id)
    for node in (await _read(conn, pool=pool_id, nodes=[], ticket=0)).values():
        pool.put(node)
    return pool
