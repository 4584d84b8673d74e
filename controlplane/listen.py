"""The one LISTEN helper: every listener (the work queue, the pending worker, webhook delivery,
the Watch hub, the gateway) takes its notifications from here.

    async with listen(conninfo, ["bc_work"], stopping, name="work-queue") as listener:
        async for item in listener:
            ...  # a Notify (channel, payload), RECONNECTED or TICK

The listener holds one dedicated autocommit connection (application_name "bc-listen:<name>")
that LISTENs to the channels. Its one rule for what was missed while disconnected: re-read.
RECONNECTED comes right after every (re)connect, the first one included, once the LISTENs are in
place; a notification sent while no connection listened is lost, so a consumer answers the marker
by reading everything it would otherwise have been told about. TICK comes when `timeout` seconds
(settable between items; None: never) pass without a notification: the consumer's safety-net poll.
WOKEN comes when the consumer's own code calls `interrupt()` (from another task): it ends the
current wait for notifications at once (or the next one, if none is in progress).

A lost connection is reconnected with back-off (BACKOFF_SECONDS, doubling; a connection that stayed
up longer than the cap starts again from the first step), logged once when lost and once when
restored, not at every attempt. Iteration ends as soon as `stopping` is set, even mid-wait; leaving
the `async with` closes the connection and leaves no task behind.

Between items the connection is free: a consumer may run its own queries on
`listener.connection` (the Watch hub does). If such a query fails, or the consumer wants to start
over, `listener.reset()` drops the connection, and the next item is RECONNECTED.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import asynccontextmanager
from typing import Final, TypeVar

import psycopg
import structlog
from psycopg import Notify, sql

log = structlog.get_logger(__name__)

APPLICATION_NAME = "bc-listen:{name}"
BACKOFF_SECONDS = (0.05, 5.0)  # the first retry after a loss, the longest wait between attempts

T = TypeVar("T")


class _Marker:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


RECONNECTED: Final = _Marker("RECONNECTED")  # (re)connected and listening: re-read everything
TICK: Final = _Marker("TICK")  # `timeout` seconds without a notification
WOKEN: Final = _Marker("WOKEN")  # interrupt() was called

Item = Notify | _Marker


class _Stopped(Exception):
    pass


class _Interrupted(Exception):
    pass


class Listener:
    """An async iterator of Notify, RECONNECTED, TICK and WOKEN; made by `listen()`."""

    def __init__(self, conninfo: str, channels: Iterable[str], stopping: asyncio.Event, *, name: str,
                 timeout: float | None, interruptible: bool = False) -> None:
        self.channels = list(channels)
        if not self.channels:
            raise ValueError("listen to at least one channel")
        self.name = name
        self.timeout = timeout
        self.connection: psycopg.AsyncConnection | None = None
        self.connects = 0  # successful (re)connects so far
        self.failed_attempts = 0  # connection attempts that failed so far
        self._conninfo = conninfo
        self._stopping = stopping
        self._received: deque[Notify] = deque()
        # Only a listener made interruptible watches for interrupt() while it waits: the watch is
        # one more task per wait, and every other listener's waits are the hot path of its loop.
        self._interrupted: asyncio.Event | None = asyncio.Event() if interruptible else None
        self._connected_at = 0.0
        self._delay = 0.0  # before the next connection attempt
        self._outage_since: float | None = None

    def __aiter__(self) -> Listener:
        return self

    async def __anext__(self) -> Item:
        try:
            return await self._next()
        except _Stopped:
            raise StopAsyncIteration from None

    def received(self) -> list[Notify]:
        """The notifications already received and not yet yielded (no waiting): for a consumer
        that handles a burst in one go."""
        notes, self._received = list(self._received), deque()
        return notes

    def interrupt(self) -> None:
        """End the current wait for notifications now (or the next one): the next item is WOKEN,
        after the notifications already received (or RECONNECTED, if the connection is down).
        Only for a listener made with `interruptible`."""
        if self._interrupted is None:
            raise RuntimeError(f"listener {self.name} was not made interruptible")
        self._interrupted.set()

    async def reset(self) -> None:
        """Drop the connection: the next item is RECONNECTED (after the back-off)."""
        if self.connection is not None:
            await self._lost("reset by its consumer")

    async def close(self) -> None:
        conn, self.connection = self.connection, None
        if conn is not None:
            await conn.close()

    async def _next(self) -> Item:
        while True:
            if self._stopping.is_set():
                raise _Stopped
            if self._received:
                return self._received.popleft()
            if self.connection is None or self.connection.closed:
                await self._connect()
                return RECONNECTED
            if self._interrupted is not None and self._interrupted.is_set():
                self._interrupted.clear()
                return WOKEN
            try:
                heard = await self._until_stopped(self._receive(self.connection, self.timeout), self._interrupted)
            except _Interrupted:
                continue  # WOKEN, after whatever came in meanwhile
            except psycopg.Error as exc:
                await self._lost(exc)
                continue
            if not heard:
                return TICK

    async def _receive(self, conn: psycopg.AsyncConnection, timeout: float | None) -> bool:
        """Wait up to `timeout` for notifications; keep every one that came in the same read."""
        async for note in conn.notifies(timeout=timeout, stop_after=1):
            self._received.append(note)  # consumed to the end: the rest of a packet is not lost
        return bool(self._received)

    async def _connect(self) -> None:
        while True:
            if self._delay:
                await self._until_stopped(asyncio.sleep(self._delay))
            try:
                conn = await self._until_stopped(self._open())
            except psycopg.Error as exc:
                self.failed_attempts += 1
                self._outage(exc)
                self._delay = min(BACKOFF_SECONDS[1], max(BACKOFF_SECONDS[0], self._delay * 2))
                continue
            self.connection, self._connected_at = conn, time.monotonic()
            self.connects += 1
            if self._outage_since is not None:
                log.info("listen connection restored", listener=self.name,
                         outage_seconds=round(time.monotonic() - self._outage_since, 3),
                         failed_attempts=self.failed_attempts)
                self._outage_since = None
            return

    async def _open(self) -> psycopg.AsyncConnection:
        conn = await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, application_name=APPLICATION_NAME.format(name=self.name))
        try:
            for channel in self.channels:
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _lost(self, why: object) -> None:
        lived = time.monotonic() - self._connected_at
        await self.close()
        self._delay = (BACKOFF_SECONDS[0] if lived > BACKOFF_SECONDS[1] or not self._delay
                       else min(BACKOFF_SECONDS[1], self._delay * 2))
        self._outage(why)

    def _outage(self, why: object) -> None:
        if self._outage_since is None:  # once per outage
            self._outage_since = time.monotonic()
            log.warning("listen connection lost; reconnecting", listener=self.name, channels=self.channels,
                        error=str(why))

    async def _until_stopped(self, work: Awaitable[T], interrupted: asyncio.Event | None = None) -> T:
        """`work`'s result, or _Stopped (with `work` cancelled and awaited) once `stopping` is set;
        _Interrupted (`work` cancelled likewise) if `interrupted` is set first."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stopping.wait())
        waiters = {task, stop}
        if interrupted is not None:
            waiters.add(asyncio.ensure_future(interrupted.wait()))
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        if self._stopping.is_set():
            if task.done() and not task.cancelled() and task.exception() is None:
                result = task.result()
                if isinstance(result, psycopg.AsyncConnection):
                    await result.close()  # opened just as we stopped
            raise _Stopped
        if task.cancelled():
            raise _Interrupted  # what `work` had received is kept (see _receive)
        return task.result()


@asynccontextmanager
async def listen(conninfo: str, channels: Iterable[str], stopping: asyncio.Event, *, name: str,
                 timeout: float | None = None, interruptible: bool = False) -> AsyncIterator[Listener]:
    """A Listener on `channels` until `stopping` is set; its connection is closed on leaving.
    `interruptible`: its consumer may end a wait with `interrupt()`."""
    listener = Listener(conninfo, channels, stopping, name=name, timeout=timeout, interruptible=interruptible)
    try:
        yield listener
    finally:
        await listener.close()
