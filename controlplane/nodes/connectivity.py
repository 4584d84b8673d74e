"""Whether a node is heard from: a hello or heartbeat makes it connected (node_seen), the
unreachable sweep marks the silent ones unreachable (sweep_unreachable; both SQL functions in
controlplane/migrations/0003_pki.sql), and an operator may set it. Each change wakes the
reservations with live allocations on the node.

A gateway keeps the freshest time it heard each of its nodes in memory (Liveness): a heartbeat
writes no row, and each sweep round refreshes `last_seen` in one statement, only where the stored
time trails by more than a fraction of the grace, before it sweeps.

Liveness takes no pool lock (controlplane.common.locks); the operator's override does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db, errors
from controlplane.nodes import queries, registry
from controlplane.nodes.locking import lock_for_placement_change

log = structlog.get_logger("nodes.connectivity")

STORE_BATCH = 1000  # nodes per `last_seen` refresh transaction


async def seen(pool: AsyncConnectionPool, node_id: str, applied_generation: int | None = None) -> bool:
    """The node was heard from (and, from a heartbeat, converged to `applied_generation`).
    True when that made it connected again."""

    async def work(conn: AsyncConnection) -> bool:
        changed = (await (await conn.execute(queries.SEEN, {"node_id": node_id})).fetchone())["changed"]
        if applied_generation is not None:
            await conn.execute(queries.SET_APPLIED_GENERATION, {"generation": applied_generation, "node_id": node_id})
        return changed

    changed = await db.run_in_transaction(pool, work)
    if changed:
        log.info("node connected", node_id=node_id)
    return changed


async def sweep(pool: AsyncConnectionPool, grace_seconds: float) -> list[str]:
    """Mark nodes not heard from within the grace unreachable; the ids of those this call changed.
    Safe with several gateways: the SQL function makes each change once."""

    async def work(conn: AsyncConnection) -> list[str]:
        rows = await (await conn.execute(queries.SWEEP_UNREACHABLE, {"grace_seconds": grace_seconds})).fetchall()
        return [r["node_id"] for r in rows]

    changed = await db.run_in_transaction(pool, work)
    for node_id in changed:
        log.info("node unreachable", node_id=node_id, grace_seconds=grace_seconds)
    return changed


async def set_by_operator(pool: AsyncConnectionPool, node_id: str, connectivity: str) -> dict[str, Any]:
    """`connected` (seen now, by the database's clock; the pool's pending reservations retry now)
    or `unreachable`, under the pool lock."""

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        node = await lock_for_placement_change(conn, node_id)
        if node is None:
            raise errors.NotFound("no such node", nodeId=node_id)
        if connectivity == "connected" and node["revoked_at"] is not None:  # back only once readmitted
            raise errors.InvalidState("the node is revoked: readmit it, it is connected once heard from",
                                      nodeId=node_id)
        await conn.execute(queries.SET_CONNECTIVITY, {"connectivity": connectivity, "node_id": node_id})
        await conn.execute(queries.WAKE_RESERVATIONS, {"node_id": node_id})
        if connectivity == "connected":  # as node_seen: placement skips unreachable nodes
            await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": node["pool_id"]})
        return await registry.node(conn, node_id)

    return await db.run_in_transaction(pool, work)


class Liveness:
    """One gateway's memory of when it last heard each node it holds a session of.

    A hello writes at once (node_seen: the node may become connected). A heartbeat only updates
    memory, and writes `applied_generation` when that changed. Each round (`sweep`) first stores,
    in batched statements, the time each node was last heard wherever the stored `last_seen`
    trails it by more than `every` seconds (the grace times the write fraction; exactly, for a
    node not heard within `every` or whose session ended); then, in one transaction, it stores
    again the rows of nodes heard here that still look half the grace old (a row skipped because
    it was locked, or written by someone else), makes connected again the nodes heard here that
    someone else marked otherwise, and sweeps. A node heard here within the grace is never swept,
    whatever its row said; the stored time of a node this gateway holds trails the truth by at
    most `every` plus a round, well inside the grace, so no other gateway's sweep marks it either;
    a node that stops is swept once its last heartbeat is older than the grace.

    Nothing is swept before the gateway has been up for the grace (a node whose session was on a
    gateway that restarted cannot have been heard before it came back), nor while sessions that
    arrived within the grace still wait for their hello: a gateway taking in a reconnect storm has
    not heard the nodes still queued in it. A node's sessions hold it only within the grace of its
    first session still waiting for a hello (`identified`), so a node reopening sessions without a
    hello cannot hold it for ever. The shutdown stores every node's exact last time."""

    def __init__(self, pool: AsyncConnectionPool, grace_seconds: float, write_fraction: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.grace, self.every = pool, grace_seconds, grace_seconds * write_fraction
        self._clock = clock
        self._started = clock()
        self._heard: dict[str, float] = {}  # node id -> when last heard (clock)
        self._applied: dict[str, int] = {}  # node id -> the applied generation last written
        self._ended: set[str] = set()  # sessions gone: stored once more, then forgotten
        self._arriving: dict[object, float] = {}  # sessions not past their hello yet -> when they came
        # node id -> when its first session still waiting for a hello came (cleared by a hello)
        self._waiting: dict[str, float] = {}

    def arriving(self) -> object:
        """A session came in (its hello is still to be taken in); pass the token to `arrived`."""
        token = object()
        self._arriving[token] = self._clock()
        return token

    def identified(self, token: object, node_id: str) -> None:
        """The arriving session is `node_id`'s: it holds the sweep only within the grace of the
        node's first session still waiting for a hello, so a node that opens session after session
        and never says hello holds it once, not for ever (and again only two graces later)."""
        at = self._arriving.get(token)
        if at is None:
            return
        since = self._waiting.get(node_id)
        if since is None or at - since >= 2 * self.grace:
            since = self._waiting[node_id] = at
        self._arriving[token] = since

    def arrived(self, token: object) -> None:
        """Its hello was taken in, or the session ended before."""
        self._arriving.pop(token, None)

    def holding(self, now: float) -> bool:
        """Whether the sweep holds: too soon after start, or sessions still waiting for their hello."""
        for token in [t for t, at in self._arriving.items() if now - at >= self.grace]:
            del self._arriving[token]  # a session that never says hello holds no sweep for longer
        for node_id in [n for n, at in self._waiting.items() if now - at >= 2 * self.grace]:
            del self._waiting[node_id]
        return now - self._started < self.grace or bool(self._arriving)

    def heard_at(self, node_id: str) -> float | None:
        return self._heard.get(node_id)

    async def hello(self, node_id: str) -> None:
        self._note(node_id)
        self._waiting.pop(node_id, None)
        self._applied.pop(node_id, None)
        await seen(self.pool, node_id)

    def writes(self, node_id: str, applied_generation: int) -> bool:
        """Whether a heartbeat with this applied generation would write a row (`heartbeat`)."""
        return self.every <= 0 or self._applied.get(node_id) != applied_generation

    async def heartbeat(self, node_id: str, applied_generation: int) -> bool:
        """True when this heartbeat wrote a row (its applied generation changed, or no fraction)."""
        self._note(node_id)
        if not self.writes(node_id, applied_generation):
            return False

        async def work(conn: AsyncConnection) -> int:
            return (await conn.execute(queries.SET_APPLIED_GENERATION_SEEN, {
                "generation": applied_generation, "node_id": node_id})).rowcount

        if self.every <= 0 or not await db.run_in_transaction(self.pool, work):
            await seen(self.pool, node_id, applied_generation)  # not connected in the row: it is now
        self._applied[node_id] = applied_generation
        return True

    def ended(self, node_id: str) -> None:
        """The node's last session here ended: its last heartbeat is stored on the next round."""
        self._ended.add(node_id)
        self._applied.pop(node_id, None)

    def _note(self, node_id: str) -> None:
        self._heard[node_id] = self._clock()
        self._ended.discard(node_id)

    async def store_all(self) -> None:
        """On shutdown (no more heartbeats come): the exact time each node was last heard, so the
        nodes of a gateway that restarts get their whole grace to come back."""
        heard = {n: t for n, t in self._heard.items() if self._clock() - t < self.grace}
        await self._store(heard, lambda node_id: 0.0)

    def _ages(self, heard: dict[str, float], ids: list[str]) -> list[float]:
        """Seconds since each was heard, taken when the statement is about to run."""
        now = self._clock()
        return [max(0.0, now - heard[n]) for n in ids]

    async def _store(self, heard: dict[str, float], slack: Callable[[str], float]) -> None:
        """REFRESH_SEEN in batches, each its own short transaction (its row locks are brief)."""
        ids = list(heard)
        for i in range(0, len(ids), STORE_BATCH):
            batch = ids[i:i + STORE_BATCH]

            async def work(conn: AsyncConnection, batch: list[str] = batch) -> None:
                await conn.execute(queries.REFRESH_SEEN, {"ids": batch, "ages": self._ages(heard, batch),
                                                          "slack": [slack(n) for n in batch]})

            await db.run_in_transaction(self.pool, work)

    async def sweep(self) -> list[str]:
        """One round; the ids of the nodes it made unreachable."""
        now = self._clock()
        heard = {n: t for n, t in self._heard.items() if now - t < self.grace}
        live = [n for n in heard if n not in self._ended]
        for node_id in [n for n in self._heard if n not in heard or n in self._ended]:
            del self._heard[node_id]
        ended, self._ended = self._ended, set()
        ids = list(heard)

        def slack(node_id: str) -> float:
            # Exact for a node gone quiet (no heartbeat within `every`, or its session ended): the
            # sweep then marks it once the grace has passed since its last heartbeat, not earlier.
            return 0.0 if node_id in ended or now - heard[node_id] >= self.every else self.every

        sweeping = not self.holding(now)
        if not sweeping and self._arriving:
            log.info("sweep held: sessions arriving", arriving=len(self._arriving))

        await self._store(heard, slack)

        async def work(conn: AsyncConnection) -> tuple[list[str], list[str]]:
            if sweeping and ids:
                await conn.execute(queries.REFRESH_IN_DANGER, {"ids": ids, "ages": self._ages(heard, ids),
                                                               "danger": self.grace / 2})
            back = [r["id"] for r in await (await conn.execute(queries.RECONNECT_HEARD, {"ids": live})).fetchall()
                    if r["changed"]] if live else []
            gone = [r["node_id"] for r in await (await conn.execute(
                queries.SWEEP_UNREACHABLE, {"grace_seconds": self.grace})).fetchall()] if sweeping else []
            return back, gone

        back, gone = await db.run_in_transaction(self.pool, work)
        for node_id in back:
            log.info("node connected", node_id=node_id)
        for node_id in gone:
            log.info("node unreachable", node_id=node_id, grace_seconds=self.grace)
        return gone
