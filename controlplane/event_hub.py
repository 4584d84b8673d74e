"""The event hub (controlplane.watch streams through it): the process's only LISTEN on bc_events,
its watchers' wake-ups, and the safe frontier the streams read up to.

One `EventHub` per process holds the only LISTEN bc_events connection and wakes the watchers of
the tenants it hears about; watchers never poll. Its safety net for a lost notification is one
indexed query every POLL_SECONDS for the tenants that have events past the last checked frontier:
only their watchers are woken, so an idle watcher costs nothing until its tenant has news.

Open streams are capped per identity and per tenant (`StreamSlots`, in each process): the
stream beyond either cap is QUOTA_EXCEEDED, and a stream gives its slot back however it ends. A
stream also ends, UNAUTHENTICATED, when the token it was opened with expires or is revoked; and
it ends (cancelled) when one message waits longer than Settings.watch_send_seconds on a consumer
that does not read, or the token expires while it waits (a revoked one ends it before the next
event, once the send under way is read). A notice that access changed (authorize.ACCESS_CHANNEL)
has every stream of the tenant decide again before its next event; after a reconnect, when such
a notice may have been lost, every stream does.

Event ids come from a sequence, so a transaction that commits later can hold a smaller id than
one already visible: streaming every visible id would skip it for good, and a resumed stream
would never see it. The hub therefore streams only up to a *safe frontier*: an id such that
every event at or below it has either committed or will never exist.

Every event writer holds a shared advisory lock from before it takes an id until it ends
(`next_event_id()`, migration 0005), and releases it only after its commit is visible. (A second
one, keyed by a floor of its ids, lets the webhook claim read the same frontier statelessly:
`events_final_below()`, migration 0050.) One
statement reads M = max(id) of the visible events and, after its snapshot was taken, W = the
transactions holding that lock (pg_locks). A transaction holding an id below M took the lock
before M's writer took its id, so it has either ended (its event is visible from now on, or
rolled back) or is in W. Once none of W holds the lock any more, every id <= M is final. So
each wake-up records the candidate (M, W) and the frontier moves to M as soon as a later read
shows W all gone; a candidate with an empty W is safe at once. The cost: the stream trails an
event writer still open when a later event committed, by that writer's remaining length;
other transactions, however long, do not hold it back.

Snapshots are taken only while this process has watchers: every create writes events, so a hub
that nobody uses would otherwise pay one query per round of notifications. With no subscription
the hub notes that its frontier is out of date (`stale`) and takes no snapshot; the first
watcher to subscribe interrupts the hub's wait, and the hub's next round takes the snapshot,
wakes every watcher once it resolves, and restarts the safety net from there (as after a
reconnect). Skipping snapshots is safe: a candidate is any (M, W) read in one statement, and it
resolves on any later read that shows W gone, however long after. A watcher reads nothing
before the hub's frontier is fresh again (`ready()`), so it pays one snapshot, not a stale read
and a wake-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
import structlog

from controlplane import authorize, errors, tokens
from controlplane.listen import RECONNECTED, WOKEN, Item, Listener, listen

log = structlog.get_logger(__name__)

# While a candidate frontier waits on writers still open, re-check at this pace (backing off);
# a transaction that wrote an event notifies on commit anyway.
RECHECK_SECONDS = (0.02, 0.5)
# The safety net for a lost notification: how often the hub looks for tenants with events it
# was not told about.
POLL_SECONDS = 10.0
# Candidates kept while a long transaction holds the frontier back; beyond this the newest two
# are merged (their writer sets united: stricter, so still safe).
MAX_CANDIDATES = 64

_ALL = "*"  # wake every watcher
CHANNEL = "bc_events"

# The lock of next_event_id(): (7311005, 1) in pg_advisory_xact_lock_shared's two-key form.
_SNAPSHOT = """
SELECT coalesce(max(id), 0) AS hi,
       array(SELECT l.virtualtransaction FROM pg_locks l
             WHERE l.locktype = 'advisory' AND l.classid = 7311005 AND l.objid = 1 AND l.objsubid = 2
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       ) AS writers
FROM events
"""

# The safety net: tenants with events above a frontier (a range scan of the primary key).
_TENANTS_SINCE = "SELECT DISTINCT tenant_id FROM events WHERE id > %s"

_REVOKED = "SELECT id FROM api_tokens WHERE id = ANY(%s) AND (revoked_at IS NOT NULL OR expires_at <= compute_now())"


@dataclass
class _Candidate:
    hi: int
    writers: frozenset[str]  # virtual transaction ids of the event writers open at the time
    tenants: set[str]


@dataclass(eq=False)  # hashed by identity: one per watcher
class Subscription:
    tenant_id: str
    token_id: str = ""
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    revoked: bool = False
    # What the tenant's members may read may have narrowed (authorize.ACCESS_CHANNEL): the watcher
    # decides again on a fresh read before its next event.
    access_changed: bool = False
    wakes: int = 0  # how often the hub woke it (each wake-up costs the watcher one query)


class StreamSlots:
    """Open Watch streams per identity and per tenant, each under its cap (this process's count)."""

    def __init__(self, per_identity: int, per_tenant: int) -> None:
        self.per_identity, self.per_tenant = per_identity, per_tenant
        self.by_identity: dict[str, int] = {}
        self.by_tenant: dict[str, int] = {}

    def acquire(self, identity_id: str, tenant_id: str) -> Callable[[], None]:
        """Take a slot (QUOTA_EXCEEDED when a cap is reached); the answer gives it back, once."""
        if self.by_identity.get(identity_id, 0) >= self.per_identity:
            raise errors.QuotaExceeded("too many open Watch streams for this identity", resource="watchStreams",
                                       scope="identity", limit=self.per_identity)
        if self.by_tenant.get(tenant_id, 0) >= self.per_tenant:
            raise errors.QuotaExceeded("too many open Watch streams for this tenant", resource="watchStreams",
                                       scope="tenant", limit=self.per_tenant, tenantId=tenant_id)
        _bump(self.by_identity, identity_id, 1)
        _bump(self.by_tenant, tenant_id, 1)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                _bump(self.by_identity, identity_id, -1)
                _bump(self.by_tenant, tenant_id, -1)

        return release


def _bump(counts: dict[str, int], key: str, by: int) -> None:
    value = counts.get(key, 0) + by
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)


class EventHub:
    """The process's one listener: keeps the safe frontier and wakes watchers by tenant."""

    def __init__(self, conninfo: str, slots: StreamSlots) -> None:
        self._conninfo = conninfo
        self.slots = slots
        self.safe_id = 0
        # Set while the frontier is up to date: cleared when a round goes unread for lack of
        # subscribers (and before the first snapshot), set again by the next snapshot.
        self._fresh = asyncio.Event()
        self._listener: Listener | None = None
        self._candidates: list[_Candidate] = []
        self._subs: dict[str, set[Subscription]] = {}
        self._by_token: dict[str, set[Subscription]] = {}
        self._checked_to = 0  # the safety net has looked at every event id up to here
        self.safety_net_runs = 0
        self.snapshots = 0  # frontier snapshots taken (each one query on the hub's own connection)
        self.notifications = 0  # bc_events notifications heard, read or not

    @property
    def stale(self) -> bool:
        """No snapshot yet, or rounds (notifications, a reconnect) went unread while no one subscribed."""
        return not self._fresh.is_set()

    def subscribe(self, tenant_id: str, token_id: str = "") -> Subscription:
        """Register a watcher; on a stale hub, its wait ends now so that it takes a snapshot."""
        sub = Subscription(tenant_id, token_id)
        self._subs.setdefault(tenant_id, set()).add(sub)
        if token_id:
            self._by_token.setdefault(token_id, set()).add(sub)
        if self.stale and self._listener is not None:
            self._listener.interrupt()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        for index, key in ((self._subs, sub.tenant_id), (self._by_token, sub.token_id)):
            subs = index.get(key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del index[key]

    def subscriptions(self, tenant_id: str) -> list[Subscription]:
        return list(self._subs.get(tenant_id, ()))

    @property
    def watching(self) -> int:
        """Subscriptions open in this process, every tenant's."""
        return sum(len(subs) for subs in self._subs.values())

    async def ready(self) -> int:
        """The safe frontier, once it is up to date: for a subscriber, at most one snapshot away."""
        await self._fresh.wait()
        return self.safe_id

    async def run(self, stop: asyncio.Event) -> None:
        async with listen(self._conninfo, [CHANNEL, tokens.REVOKED_CHANNEL, authorize.ACCESS_CHANNEL], stop,
                          name="event-hub",
                          interruptible=True, own_connection=True) as listener:
            self._listener = listener
            recheck = RECHECK_SECONDS[0]
            try:
                async for item in listener:
                    try:
                        tenants = await self._handle(listener, item)
                    except Exception:
                        log.exception("event hub failed; reconnecting")
                        await listener.reset()  # and re-read everything once reconnected
                        continue
                    busy = tenants or item is RECONNECTED
                    recheck = RECHECK_SECONDS[0] if busy else min(recheck * 2, RECHECK_SECONDS[1])
                    # While a candidate waits on writers still open, re-check soon; else the safety
                    # net; with no one subscribed, neither (a subscriber interrupts the wait).
                    listener.timeout = (None if not self._subs else
                                        recheck if self._candidates else POLL_SECONDS)
            finally:
                self._listener = None

    async def _handle(self, listener: Listener, item: Item) -> set[str]:
        """One round: the tenants it woke or will wake. Queries run on the listener's own connection
        (free between items; notifications that arrive meanwhile are kept for the next round)."""
        conn = listener.connection
        assert conn is not None
        tenants: set[str] = set()
        if isinstance(item, psycopg.Notify):
            for note in [item, *listener.received()]:
                if note.channel == tokens.REVOKED_CHANNEL:
                    self._revoke(note.payload.split(","))
                elif note.channel == authorize.ACCESS_CHANNEL:
                    self._access_changed(note.payload)
                else:
                    tenants.add(note.payload)
                    self.notifications += 1
        if not self._subs:
            # Nobody to wake: note that the frontier is out of date (this round may have brought
            # events, lost ones, or left a candidate unchecked) and take no snapshot.
            self._fresh.clear()
            return set()
        if item is RECONNECTED:
            await self._recheck_tokens(conn)  # revoked while no one listened
            for tenant_id in list(self._subs):  # a policy or membership changed while no one listened
                self._access_changed(tenant_id)
        if item is RECONNECTED or self.stale:
            # Anything may have committed while no one listened, or no one subscribed.
            await self._tick(conn, {_ALL})
            self._checked_to = self.safe_id  # everyone will be woken: the net starts from here
            return {_ALL}
        if item is WOKEN:
            return set()  # a subscriber asked for a frontier that is already fresh
        if not isinstance(item, psycopg.Notify) and not self._candidates:
            # The safety net, in case a NOTIFY was lost: only tenants with unseen events.
            frontier = self.safe_id
            rows = await (await conn.execute(_TENANTS_SINCE, (self._checked_to,))).fetchall()
            tenants = {row[0] for row in rows}
            self._checked_to = frontier
            self.safety_net_runs += 1
        await self._tick(conn, tenants)
        return tenants

    async def _tick(self, conn: psycopg.AsyncConnection, tenants: set[str]) -> None:
        """Take a snapshot, record it as a candidate frontier, advance to the resolved ones.

        `tenants` were notified before this snapshot, so their new events are at or below its
        `hi`: they are woken when a candidate at or above it resolves (or now, if already safe).
        """
        row = await (await conn.execute(_SNAPSHOT)).fetchone()
        assert row is not None
        self.snapshots += 1
        hi, writers = int(row[0]), frozenset(row[1])
        last = self._candidates[-1] if self._candidates else None
        if last is not None and last.hi >= hi:
            last.tenants |= tenants  # same events: the older, smaller writer set decides
        elif hi > self.safe_id:
            self._candidates.append(_Candidate(hi, writers, set(tenants)))
            if len(self._candidates) > MAX_CANDIDATES:
                newest = self._candidates.pop()
                kept = self._candidates[-1]
                self._candidates[-1] = _Candidate(newest.hi, kept.writers | newest.writers,
                                                  kept.tenants | newest.tenants)
        else:
            self._wake(tenants)
        resolved = [c.hi for c in self._candidates if not (c.writers & writers)]
        if resolved:
            self.safe_id = max(self.safe_id, *resolved)
            done = [c for c in self._candidates if c.hi <= self.safe_id]
            self._candidates = [c for c in self._candidates if c.hi > self.safe_id]
            self._wake(set().union(*(c.tenants for c in done)))
        self._fresh.set()

    async def _recheck_tokens(self, conn: psycopg.AsyncConnection) -> None:
        if self._by_token:
            rows = await (await conn.execute(_REVOKED, (list(self._by_token),))).fetchall()
            self._revoke([row[0] for row in rows])

    def _revoke(self, token_ids: list[str]) -> None:
        """The streams of those tokens end UNAUTHENTICATED before their next event (one suspended
        in a send, once that send is done: the reader gets the status)."""
        for token_id in token_ids:
            for sub in self._by_token.get(token_id, ()):
                sub.revoked = True
                sub.wakes += 1
                sub.woken.set()

    def _access_changed(self, tenant_id: str) -> None:
        for sub in self._subs.get(tenant_id, ()):
            sub.access_changed = True
            sub.wakes += 1
            sub.woken.set()

    def _wake(self, tenants: set[str]) -> None:
        targets = self._subs.keys() if _ALL in tenants else tenants & self._subs.keys()
        for tenant_id in list(targets):
            for sub in self._subs[tenant_id]:
                sub.wakes += 1
                sub.woken.set()
