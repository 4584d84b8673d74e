"""The pool-lease placer's lease worker (DESIGN.md section 9): every control-plane process runs one.

It holds leases of lease-policy pools (`pool_leases`, one row per pool: holder, deadline, fencing
epoch). Every third of BC_PLACER_LEASE_SECONDS one statement renews the leases it holds and takes
every lapsed one, so a killed holder's pools have a new holder within about a lease. On shutdown
its leases lapse at once and the other replicas are told to take them.

For each pool it holds, a drainer task places the pool's queued reservations: `drain(pool_id,
holder, epoch)` (handed in by the server's assembly, controlplane.reservations.queued) places one
batch and answers how many reservations it took; a full batch is followed by the next at once.
Drainers are woken by `bc_queued` (a create queued a reservation in that pool), when the lease is
taken, after a reconnect, and at every tick (the safety net for a lost notification).

The worker also wakes the creates waiting for their operation (`wait`) in this process when a
batch decided their reservations (`bc_placed`, the ids), so a wait answers without polling. A
batch of this process hands its waiters their reservations as it moved them, after its commit
(`Waiters.handing`): those answer without reading at all.

The lease statements run on the listener's own connection: a busy connection pool never delays a
renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import psycopg
import structlog
from psycopg.rows import dict_row

from controlplane.config import Settings
from controlplane.listen import RECONNECTED, TICK, Listener, listen
from controlplane.placement import lease_queries as q

log = structlog.get_logger(__name__)

PLACERS = frozenset({"inline", "lease"})
QUEUED_CHANNEL = "bc_queued"  # payload: the pool id
PLACED_CHANNEL = "bc_placed"  # payload: comma-separated reservation ids a batch decided
LEASES_CHANNEL = "bc_pool_leases"  # payload: a pool whose lease was dropped, or a new lease pool
RETRY_SECONDS = 0.5  # after a failed batch

Drain = Callable[[str, str, int], Awaitable[int]]


def check_default(settings: Settings) -> None:
    """BC_DEFAULT_PLACER names a placer (checked at start, not at the first CreatePool)."""
    if settings.default_placer not in PLACERS:
        raise ValueError(f"BC_DEFAULT_PLACER must be one of {sorted(PLACERS)}, not {settings.default_placer!r}")


async def announce(conn: psycopg.AsyncConnection, pool_id: str, policy: dict) -> None:
    """A pool was created: if it is a lease pool, the lease workers take it at once (at commit)."""
    if policy.get("placer") == "lease":
        await conn.execute(q.ANNOUNCE, {"pool_id": pool_id})


class Waiter:
    """One create waiting for its reservation: `event` ends its pause; `view` is the reservation as
    this process's batch committed it, when the batch handed it one (the waiter answers with it
    instead of reading)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.view: dict[str, Any] | None = None


class Waiters:
    """Creates of this process waiting for their reservation's operation, by reservation id.

    A batch of this process claims the ids it moved before its commit and hands each waiter its
    view after (`handing`); the batch's own `bc_placed` does not wake a claimed id, so a waiter
    woken by the notification before the hand-off does not read what it is about to be given."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[Waiter]] = {}
        self._claimed: set[str] = set()

    @contextlib.contextmanager
    def watching(self, rid: str) -> Iterator[Waiter]:
        waiter = Waiter()
        self._waiting.setdefault(rid, set()).add(waiter)
        try:
            yield waiter
        finally:
            waiters = self._waiting.get(rid)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiting[rid]

    def wake(self, ids: Iterable[str]) -> None:
        for rid in ids:
            if rid not in self._claimed:
                for waiter in self._waiting.get(rid, ()):
                    waiter.event.set()

    @contextlib.contextmanager
    def handing(self) -> Iterator[HandOff]:
        """A batch's hand-off; whatever it claimed and did not hand is woken at the end (the
        waiters read: a failed commit may or may not have moved them)."""
        hand_off = HandOff(self)
        try:
            yield hand_off
        finally:
            self._claimed.difference_update(hand_off.views)
            self.wake(hand_off.views)

    def _claim(self, ids: Iterable[str]) -> None:
        self._claimed.update(ids)

    def _hand(self, rid: str, view: dict[str, Any]) -> None:
        self._claimed.discard(rid)
        for waiter in self._waiting.get(rid, ()):
            waiter.view = dict(view)
            waiter.event.set()


class HandOff:
    """The views one batch moved, claimed before its commit and handed to their waiters after."""

    def __init__(self, waiters: Waiters) -> None:
        self._waiters = waiters
        self.views: dict[str, dict[str, Any]] = {}

    def claim(self, views: dict[str, dict[str, Any]]) -> None:
        """Inside the batch's transaction, before its commit (which sends `bc_placed`)."""
        self.views.update(views)
        self._waiters._claim(views)

    def hand(self) -> None:
        """After the commit: each view to its reservation's waiters, if any (one without a waiter
        is dropped: a create that begins waiting later reads)."""
        views, self.views = self.views, {}
        for rid, view in views.items():
            self._waiters._hand(rid, view)


class LeaseWorker:
    def __init__(self, settings: Settings, drain: Drain | None = None) -> None:
        self.settings = settings
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.drain = drain
        self.held: dict[str, int] = {}  # pool id -> epoch
        self.waiters = Waiters()
        self.ticks = 0
        self._wanted: dict[str, asyncio.Event] = {}
        self._drainers: dict[str, asyncio.Task] = {}
        self._stopped: list[asyncio.Task] = []  # cancelled drainers not yet awaited

    @property
    def interval(self) -> float:
        return self.settings.placer_lease_seconds / 3

    async def run(self, conninfo: str, stopping: asyncio.Event) -> None:
        next_tick = 0.0
        try:
            async with listen(conninfo, [QUEUED_CHANNEL, PLACED_CHANNEL, LEASES_CHANNEL], stopping,
                              name="placer-lease", timeout=self.interval, own_connection=True) as listener:
                async for item in listener:
                    due = item is RECONNECTED or item is TICK or time.monotonic() >= next_tick
                    if isinstance(item, psycopg.Notify):
                        due |= self._heard([item, *listener.received()])
                    if due:
                        try:
                            await self._tick(listener)
                        except psycopg.Error as exc:
                            log.warning("pool lease tick failed; reconnecting", error=str(exc))
                            await listener.reset()
                        next_tick = time.monotonic() + self.interval
                    listener.timeout = max(0.0, next_tick - time.monotonic())
                await self._drop(listener)
        finally:
            for pool_id in list(self._drainers):
                self._stop_draining(pool_id)
            tasks, self._stopped = self._stopped, []
            await asyncio.gather(*tasks, return_exceptions=True)

    def _heard(self, notes: list[psycopg.Notify]) -> bool:
        """Wake drainers and waiters; True when a dropped lease asks for a tick now."""
        tick = False
        for note in notes:
            if note.channel == QUEUED_CHANNEL:
                self._want(note.payload)
            elif note.channel == PLACED_CHANNEL:
                self.waiters.wake(note.payload.split(","))
            elif note.channel == LEASES_CHANNEL:
                tick = True
        return tick

    async def _tick(self, listener: Listener) -> None:
        conn = listener.connection
        assert conn is not None
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(q.TAKE_AND_RENEW, {"holder": self.holder, "seconds": self.settings.placer_lease_seconds})
        now = {r["pool_id"]: r["epoch"] for r in await cur.fetchall()}
        self.ticks += 1
        for pool_id in set(self.held) - set(now):
            log.warning("pool lease lost", pool_id=pool_id, holder=self.holder, epoch=self.held[pool_id])
            self._stop_draining(pool_id)
        for pool_id, epoch in now.items():
            if self.held.get(pool_id) != epoch:
                log.info("pool lease taken", pool_id=pool_id, holder=self.holder, epoch=epoch)
            self.held[pool_id] = epoch
            if pool_id not in self._drainers:
                self._wanted[pool_id] = asyncio.Event()
                self._drainers[pool_id] = asyncio.create_task(self._drain_loop(pool_id), name=f"placer:{pool_id}")
            self._want(pool_id)  # a new lease, a reconnect, or the safety net: anything queued is placed

    def _want(self, pool_id: str) -> None:
        event = self._wanted.get(pool_id)
        if event is not None and pool_id in self.held:
            event.set()

    def _stop_draining(self, pool_id: str) -> None:
        self.held.pop(pool_id, None)
        self._wanted.pop(pool_id, None)
        task = self._drainers.pop(pool_id, None)
        if task is not None:
            task.cancel()
            self._stopped = [t for t in self._stopped if not t.done()] + [task]  # awaited by `run`

    async def _drain_loop(self, pool_id: str) -> None:
        wanted = self._wanted[pool_id]
        while True:
            await wanted.wait()
            wanted.clear()
            while pool_id in self.held and self.drain is not None:
                try:
                    taken = await self.drain(pool_id, self.holder, self.held[pool_id])
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - logged; the batch rolled back and is tried again
                    log.exception("placer batch failed; retrying", pool_id=pool_id)
                    await asyncio.sleep(RETRY_SECONDS)
                    wanted.set()
                    break
                if taken < self.settings.placer_batch:
                    break  # drained; the next queued create wakes it again

    async def _drop(self, listener: Listener) -> None:
        """Shutdown: drop this holder's leases, so another replica takes them now, not at lapse.
        First, so a batch still open fails its fencing check and rolls back; then the drainers
        stop (awaited by `run`)."""
        conn = listener.connection
        if conn is not None and not conn.closed and self.held:
            try:
                await conn.execute(q.DROP, {"holder": self.holder})
                log.info("pool leases dropped", holder=self.holder, pools=len(self.held))
            except psycopg.Error as exc:
                log.warning("pool leases not dropped; they lapse", error=str(exc))
        for pool_id in list(self._drainers):
            self._stop_draining(pool_id)
