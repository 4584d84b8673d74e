"""The one LISTEN helper: every listener (the work queue, the pending worker, webhook delivery,
the Watch hub, the capacity index, the pool-lease placer, the gateway) takes its notifications
from here.

    async with listen(conninfo, ["bc_work"], stopping, name="work-queue") as listener:
        async for item in listener:
            ...  # a Notify (channel, payload), RECONNECTED, TICK or WOKEN

The listeners of one process (one event loop, one conninfo) share one LISTEN connection (a
`_Hub`, application_name "bc-listen:<their names>"): PostgreSQL wakes every backend that listens
in a database at every commit that notifies, whatever its channels, so one connection per process
instead of one per listener spares it most of those wake-ups. Each listener gets the notifications
of its own channels, in the order they were sent.

Its one rule for what was missed while disconnected: re-read. RECONNECTED comes first, once the
listener's channels are LISTENed, and again after every (re)connect of the shared connection; a
notification sent while no connection listened is lost, so a consumer answers the marker by
reading everything it would otherwise have been told about. TICK comes when `timeout` seconds
(settable between items; None: never) pass without a notification: the consumer's safety-net poll.
WOKEN comes when the consumer's own code calls `interrupt()` (from another task): it ends the
current wait for notifications at once (or the next one, if none is in progress).

A lost connection is reconnected with back-off (BACKOFF_SECONDS, doubling; a connection that stayed
up longer than the cap starts again from the first step), logged once when lost and once when
restored, not at every attempt. Iteration ends as soon as `stopping` is set, even mid-wait; leaving
the `async with` leaves no task behind, and the last listener to leave closes the connection.

A consumer that runs its own queries between items asks for `own_connection`: `listener.connection`
is then an autocommit connection of its own (application_name "bc-listen:<name>/queries", not
listening), opened before each RECONNECTED. If such a query fails, or the consumer wants to start
over, `listener.reset()` drops that connection, and the next item is RECONNECTED.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Final

import psycopg
import structlog
from psycopg import Notify, sql
from psycopg.conninfo import conninfo_to_dict

log = structlog.get_logger(__name__)

APPLICATION_NAME = "bc-listen:{name}"  # the shared connection: its listeners' names, comma-separated
QUERIES_NAME = "bc-listen:{name}/queries"  # a listener's own connection for its queries
BACKOFF_SECONDS = (0.05, 5.0)  # the first retry after a loss, the longest wait between attempts


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


class _Backoff:
    """The wait before the next connection attempt, and one warning per outage."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.failed_attempts = 0  # connection attempts that failed so far
        self.connected_at = 0.0
        self._outage_since: float | None = None

    def failed(self, why: object, **who: object) -> None:
        self.failed_attempts += 1
        self.outage(why, **who)
        self.delay = min(BACKOFF_SECONDS[1], max(BACKOFF_SECONDS[0], self.delay * 2))

    def lost(self, why: object, **who: object) -> None:
        lived = time.monotonic() - self.connected_at
        self.delay = (BACKOFF_SECONDS[0] if lived > BACKOFF_SECONDS[1] or not self.delay
                      else min(BACKOFF_SECONDS[1], self.delay * 2))
        self.outage(why, **who)

    def connected(self, **who: object) -> None:
        self.connected_at = time.monotonic()
        if self._outage_since is not None:
            log.info("listen connection restored", **who, outage_seconds=round(time.monotonic() - self._outage_since, 3),
                     failed_attempts=self.failed_attempts)
            self._outage_since = None

    def outage(self, why: object, **who: object) -> None:
        if self._outage_since is None:  # once per outage
            self._outage_since = time.monotonic()
            log.warning("listen connection lost; reconnecting", **who, error=str(why))


class Listener:
    """An async iterator of Notify, RECONNECTED, TICK and WOKEN; made by `listen()`. A marker
    that is due comes before any notification; WOKEN after the notifications already received."""

    def __init__(self, channels: Iterable[str], stopping: asyncio.Event, *, name: str, timeout: float | None,
                 interruptible: bool = False, own_connection: bool = False, conninfo: str = "") -> None:
        self.channels = list(channels)
        if not self.channels:
            raise ValueError("listen to at least one channel")
        self.name = name
        self.timeout = timeout
        self.connection: psycopg.AsyncConnection | None = None  # with own_connection: for the consumer's queries
        self.connects = 0  # RECONNECTED markers given so far
        self._channel_set = frozenset(self.channels)
        self._conninfo = conninfo
        self._own = own_connection
        self._own_backoff = _Backoff()  # its own connection's, and its consumer's resets
        self._pause = False  # wait the back-off before the next RECONNECTED
        self._stopping = stopping
        self._received: deque[Notify] = deque()
        self._interruptible = interruptible
        self._interrupted = False
        self._ready = False  # the shared connection listens to every channel of this listener
        self._need_marker = True
        self._waiter: asyncio.Future[bool] | None = None
        self._hub: _Hub | None = None

    @property
    def failed_attempts(self) -> int:
        """Connection attempts that failed so far (the shared connection's and this listener's own)."""
        return (self._hub.backoff.failed_attempts if self._hub is not None else 0) + self._own_backoff.failed_attempts

    @property
    def waiting(self) -> bool:
        """Its consumer is waiting for the next item."""
        return self._waiter is not None and not self._waiter.done()

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
        after the notifications already received (or RECONNECTED, if one is due).
        Only for a listener made with `interruptible`."""
        if not self._interruptible:
            raise RuntimeError(f"listener {self.name} was not made interruptible")
        self._interrupted = True
        self._wake()

    async def reset(self) -> None:
        """Start over: its own connection (if any) is dropped and the next item is RECONNECTED,
        after the back-off (a consumer that fails at every marker does not spin). Notifications
        received and not yet taken are dropped: the re-read the marker asks for covers them."""
        await self._close_own()
        self._received.clear()
        self._own_backoff.lost("reset by its consumer", listener=self.name, channels=self.channels)
        self._need_marker = self._pause = True
        self._wake()

    async def close(self) -> None:
        await self._close_own()

    async def _close_own(self) -> None:
        conn, self.connection = self.connection, None
        if conn is not None:
            await conn.close()

    async def _next(self) -> Item:
        while True:
            if self._stopping.is_set():
                raise _Stopped
            if self._need_marker and self._ready:  # before any notification: see `_lost`
                if self._pause:
                    self._pause = False
                    await self._sleep(self._own_backoff.delay)
                    continue
                if self._own and (self.connection is None or self.connection.closed):
                    await self._open_own()
                    continue
                self._own_backoff.connected(listener=self.name, channels=self.channels)
                self._need_marker = False
                self.connects += 1
                return RECONNECTED
            if self._received:
                return self._received.popleft()
            if self._interrupted:
                self._interrupted = False
                return WOKEN
            waiting_for_marker = self._need_marker
            timed_out = await self._wait(None if waiting_for_marker else self.timeout)
            if timed_out and not waiting_for_marker:
                return TICK

    async def _wait(self, timeout: float | None) -> bool:
        """Until woken (a notification, the shared connection's news, an interrupt, `stopping`);
        True if `timeout` passed first. No task per wait: a future and a timer."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, _settle, waiter, True) if timeout is not None else None
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None:
            _settle(self._waiter, False)

    async def _open_own(self) -> None:
        try:
            self.connection = await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, application_name=QUERIES_NAME.format(name=self.name))
        except psycopg.Error as exc:
            self._own_backoff.failed(exc, listener=self.name, channels=self.channels)
            self._pause = True

    async def _sleep(self, seconds: float) -> None:
        """A back-off pause that `stopping` ends (the next round of `_next` then stops)."""
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set() and (left := deadline - time.monotonic()) > 0:
            await self._wait(left)

    # -- told by the shared connection ---------------------------------------------------------

    def _deliver(self, note: Notify) -> None:
        self._received.append(note)
        self._wake()

    def _listening(self) -> None:
        """Every channel of this listener is LISTENed on a fresh or extended connection."""
        if not self._ready:
            self._ready = True
            self._wake()

    def _lost(self) -> None:
        """The shared connection is gone: the next item is RECONNECTED once it is back. What was
        received and not yet handed out is dropped (the re-read the marker asks for covers it), and
        what arrives after the new LISTENs comes after the marker, so a consumer with a connection
        of its own never gets a notification while that connection is being reopened."""
        self._ready = False
        self._need_marker = True
        self._received.clear()
        self._wake()

    async def _watch_stopping(self) -> None:
        await self._stopping.wait()
        self._wake()


def _settle(waiter: asyncio.Future[bool], value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


class _Hub:
    """One LISTEN connection for the listeners of one event loop on one database."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.listeners: list[Listener] = []
        self.connection: psycopg.AsyncConnection | None = None
        self.listening: set[str] = set()
        self.pid: int | None = None
        self.backoff = _Backoff()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def join(self, listener: Listener) -> None:
        with _HUBS_LOCK:
            self.listeners.append(listener)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="listen-hub")
        elif listener._channel_set <= self.listening:
            listener._listening()
        else:
            self._changed.set()  # LISTEN its channels on the open connection

    async def leave(self, listener: Listener) -> bool:
        """True when it was the last: the connection is closed and the task gone."""
        with _HUBS_LOCK:
            self.listeners.remove(listener)
            if self.listeners:
                return False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._close()
        return True

    def _who(self) -> dict[str, object]:
        return {"listener": ",".join(sorted({lst.name for lst in self.listeners})),
                "channels": sorted({c for lst in self.listeners for c in lst.channels})}

    def _application_name(self) -> str:
        """The prefix and the names of the listeners it serves (PostgreSQL keeps 63 bytes of it)."""
        return APPLICATION_NAME.format(name=",".join(sorted({lst.name for lst in self.listeners})))[:63]

    def _wanted(self) -> set[str]:
        return {c for lst in self.listeners for c in lst.channels}

    async def _run(self) -> None:
        while True:
            if self.connection is None:
                await self._connect()
            missing = self._wanted() - self.listening
            self._changed.clear()
            if missing:
                try:
                    await self._listen(self.connection, missing)
                    await self.connection.execute("SELECT set_config('application_name', %s, false)",
                                                  (self._application_name(),))
                except psycopg.Error as exc:
                    await self._lost(exc)
                    continue
                self.listening |= missing
            for listener in list(self.listeners):
                if listener._channel_set <= self.listening:
                    listener._listening()
            try:
                await self._read_until_changed()
            except psycopg.Error as exc:
                await self._lost(exc)
            except Exception as exc:  # noqa: BLE001 - never leave the listeners without a connection
                log.exception("listen connection failed")
                await self._lost(exc)

    async def _read_until_changed(self) -> None:
        """Hand out notifications until the connection fails (raised) or a listener with new
        channels joins (returns)."""
        assert self.connection is not None
        reading = asyncio.ensure_future(self._read(self.connection))
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({reading, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reading, changed):
                task.cancel()
            await asyncio.gather(reading, changed, return_exceptions=True)
        if reading.done() and not reading.cancelled() and reading.exception() is not None:
            raise reading.exception()  # type: ignore[misc]

    async def _read(self, conn: psycopg.AsyncConnection) -> None:
        async for note in conn.notifies():
            for listener in self.listeners:
                if listener._ready and note.channel in listener._channel_set:
                    listener._deliver(note)

    async def _connect(self) -> None:
        while True:
            if self.backoff.delay:
                await asyncio.sleep(self.backoff.delay)
            wanted = self._wanted()
            try:
                conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True,
                                                             application_name=self._application_name())
                try:
                    await self._listen(conn, wanted)
                except BaseException:
                    await conn.close()
                    raise
            except psycopg.Error as exc:
                self.backoff.failed(exc, **self._who())
                continue
            self.connection, self.listening, self.pid = conn, wanted, conn.info.backend_pid
            self.backoff.connected(**self._who())
            return

    @staticmethod
    async def _listen(conn: psycopg.AsyncConnection, channels: Iterable[str]) -> None:
        for channel in sorted(channels):
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    async def _lost(self, why: object) -> None:
        await self._close()
        self.backoff.lost(why, **self._who())
        for listener in self.listeners:
            listener._lost()

    async def _close(self) -> None:
        conn, self.connection, self.listening, self.pid = self.connection, None, set(), None
        if conn is not None:
            await conn.close()


_HUBS: dict[tuple[asyncio.AbstractEventLoop, str], _Hub] = {}
_HUBS_LOCK = threading.Lock()


def backend_pids(conninfo: str, name: str) -> list[int]:
    """The backends of the LISTEN connections that serve a listener called `name` on `conninfo`'s
    database in this process (for tests and diagnostics; any thread)."""
    dbname = conninfo_to_dict(conninfo).get("dbname")
    with _HUBS_LOCK:
        hubs = [(hub, [lst.name for lst in hub.listeners]) for hub in _HUBS.values()]
    return [hub.pid for hub, names in hubs
            if name in names and hub.pid is not None and conninfo_to_dict(hub.conninfo).get("dbname") == dbname]


@asynccontextmanager
async def listen(conninfo: str, channels: Iterable[str], stopping: asyncio.Event, *, name: str,
                 timeout: float | None = None, interruptible: bool = False,
                 own_connection: bool = False) -> AsyncIterator[Listener]:
    """A Listener on `channels` until `stopping` is set, on the process's shared LISTEN connection.
    `interruptible`: its consumer may end a wait with `interrupt()`; `own_connection`: it gets a
    connection of its own for its queries (closed on leaving)."""
    listener = Listener(channels, stopping, name=name, timeout=timeout, interruptible=interruptible,
                        own_connection=own_connection, conninfo=conninfo)
    key = (asyncio.get_running_loop(), conninfo)
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        if hub is None:
            hub = _HUBS[key] = _Hub(conninfo)
    listener._hub = hub
    hub.join(listener)
    watch = asyncio.ensure_future(listener._watch_stopping())
    try:
        yield listener
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await listener.close()
        if await hub.leave(listener):
            with _HUBS_LOCK:
                if _HUBS.get(key) is hub and not hub.listeners:
                    del _HUBS[key]
