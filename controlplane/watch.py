"""Events.Watch: a tenant's stored events in id order, then new ones as they commit.

One `EventHub` per process holds the only LISTEN bc_events connection and wakes the watchers of
the tenants it hears about; watchers never poll. Its safety net for a lost notification is one
indexed query every POLL_SECONDS for the tenants that have events past the last checked frontier:
only their watchers are woken, so an idle watcher costs nothing until its tenant has news.

Open streams are capped per identity and per tenant (`StreamSlots`, in each process): the
stream beyond either cap is QUOTA_EXCEEDED, and a stream gives its slot back however it ends. A
stream also ends, UNAUTHENTICATED, when the token it was opened with expires or is revoked; and
it ends (cancelled) when one message waits longer than Settings.watch_send_seconds on a consumer
that does not read, or the token ends while it waits.

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

"From now" (`_from_now`) means: every event that the stream's start snapshot does not show is
streamed, and none that it shows. Starting after the tenant's largest visible id lost an event
that a writer open at the start committed later with a smaller id. The stream starts instead at B,
read before that snapshot: the smaller of `events_final_below()` and one more than the largest id
that its statement's own (earlier) snapshot shows. Every id below B has committed before the
start snapshot or never will: a writer gone from pg_locks has ended, visibly, and one not yet
holding its floor lock takes ids above every id taken so far, so above that max(id). The stream
reads the ids from B up and skips the ones the start snapshot showed. The
response headers are sent once that start is fixed, so a client that has them knows that whatever
commits from then on reaches it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import structlog

from controlplane import authorize, db, errors, tokens
from controlplane.auth import Caller
from controlplane.common.names import TENANT_ID, match
from controlplane.listen import RECONNECTED, WOKEN, Item, Listener, listen
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

EVENTS_READ = "compute:events:read"

# A type filter entry: an exact type ("reservation.placed") or a prefix ending in "."
# ("reservation.", "reservation-grant.").
TYPE_FILTER = re.compile(r"^[a-z][a-z0-9-]*(\.[a-z0-9-]+)*\.?$")
MAX_TYPE_FILTERS = 32
SUBJECT = re.compile(r"^[A-Za-z0-9._:/-]{1,256}$")

BATCH = 500
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

# Whether the watcher can still act in the tenant (migration 0052), read with each batch's
# policy, and whether its token is unrevoked (expiry has its own timer): an offboarding revokes
# the tokens and ends the membership's effect in one commit, and the stream ends UNAUTHENTICATED
# for it, as when only the hub's revocation notice ended it (which may come after this read).
_CALLER_NOW = """
SELECT can_act_in(%(identity_id)s, %(tenant_id)s) AS member,
       (%(token_id)s = '' OR EXISTS (SELECT 1 FROM api_tokens t WHERE t.id = %(token_id)s
                                      AND t.revoked_at IS NULL)) AS live
"""
_REVOKED = "SELECT id FROM api_tokens WHERE id = ANY(%s) AND (revoked_at IS NOT NULL OR expires_at <= compute_now())"

_FILTER = """tenant_id = %(tenant_id)s
  AND (%(subject)s = '' OR subject = %(subject)s)
  AND event_type_matches(%(types)s::text[], type)"""
_EVENTS = f"""
SELECT id, type, subject, tenant_id, epoch_ms(time) AS time_ms, data
FROM events
WHERE {_FILTER} AND id > %(after)s AND id <= %(upto)s AND id <> ALL(%(skip)s::bigint[])
ORDER BY id
LIMIT %(limit)s
"""
# "From now" (module docstring): every id below `below` is final, as pg_locks is read after the
# snapshot of max(id); then, in a later snapshot (the start), the matching ids from there up.
_FROM_NOW_BELOW = "SELECT least(events_final_below(), (SELECT coalesce(max(id), 0) FROM events) + 1) AS below"
_FROM_NOW_SEEN = f"SELECT id FROM events WHERE {_FILTER} AND id >= %(below)s ORDER BY id"



def parse_types(field_name: str, types: list[str]) -> list[str]:
    """Validate a type filter (see TYPE_FILTER); INVALID_INPUT names the field."""
    if len(types) > MAX_TYPE_FILTERS:
        raise errors.InvalidInput(field_name, f"at most {MAX_TYPE_FILTERS} entries")
    for t in types:
        if len(t) > 128 or not TYPE_FILTER.fullmatch(t):
            raise errors.InvalidInput(field_name, f"{t!r} is not an event type or a prefix ending in '.'")
    return sorted(set(types))


async def authorize_tenant(rt: Runtime, caller: Caller, tenant_id: str, action: str,
                           attributes: dict[str, Any]) -> None:
    """Membership, then IAM on the tenant (policy read in its own transaction, decided outside)."""
    match("tenantId", tenant_id, TENANT_ID)
    caller.require_member(tenant_id)
    await authorize.require(rt.pool, caller, tenant_id, action, "Tenant", tenant_id, attributes, tenantId=tenant_id)


@dataclass
class _Candidate:
    hi: int
    writers: frozenset[str]  # virtual transaction ids of the event writers open at the time
    tenants: set[str]


@dataclass(eq=False)  # hashed by identity: one per watcher
class _Subscription:
    tenant_id: str
    token_id: str = ""
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    revoked: bool = False
    end: Callable[[], Any] | None = None  # while suspended in a send: ends the stream's RPC
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
        self._subs: dict[str, set[_Subscription]] = {}
        self._by_token: dict[str, set[_Subscription]] = {}
        self._checked_to = 0  # the safety net has looked at every event id up to here
        self.safety_net_runs = 0
        self.snapshots = 0  # frontier snapshots taken (each one query on the hub's own connection)
        self.notifications = 0  # bc_events notifications heard, read or not

    @property
    def stale(self) -> bool:
        """No snapshot yet, or rounds (notifications, a reconnect) went unread while no one subscribed."""
        return not self._fresh.is_set()

    def subscribe(self, tenant_id: str, token_id: str = "") -> _Subscription:
        """Register a watcher; on a stale hub, its wait ends now so that it takes a snapshot."""
        sub = _Subscription(tenant_id, token_id)
        self._subs.setdefault(tenant_id, set()).add(sub)
        if token_id:
            self._by_token.setdefault(token_id, set()).add(sub)
        if self.stale and self._listener is not None:
            self._listener.interrupt()
        return sub

    def unsubscribe(self, sub: _Subscription) -> None:
        for index, key in ((self._subs, sub.tenant_id), (self._by_token, sub.token_id)):
            subs = index.get(key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del index[key]

    def subscriptions(self, tenant_id: str) -> list[_Subscription]:
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
        async with listen(self._conninfo, [CHANNEL, tokens.REVOKED_CHANNEL], stop, name="event-hub",
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
        for token_id in token_ids:
            for sub in self._by_token.get(token_id, ()):
                sub.revoked = True
                if sub.end is not None:
                    sub.end()
                sub.wakes += 1
                sub.woken.set()

    def _wake(self, tenants: set[str]) -> None:
        targets = self._subs.keys() if _ALL in tenants else tenants & self._subs.keys()
        for tenant_id in list(targets):
            for sub in self._subs[tenant_id]:
                sub.wakes += 1
                sub.woken.set()


@dataclass(frozen=True)
class WatchInput:
    tenant_id: str
    after_id: int
    from_now: bool
    types: list[str]
    subject: str


def parse_watch(raw: dict[str, Any]) -> WatchInput:
    tenant_id = match("tenantId", raw.get("tenant_id", ""), TENANT_ID)
    after_id = int(raw.get("after_id") or 0)
    if after_id < 0:
        raise errors.InvalidInput("afterId", "must be 0 or an event id")
    from_now = bool(raw.get("from_now"))
    if from_now and after_id:
        raise errors.InvalidInput("fromNow", "give either afterId or fromNow")
    subject = raw.get("subject") or ""
    if subject:
        match("subject", subject, SUBJECT)
    return WatchInput(tenant_id, after_id, from_now, parse_types("types", list(raw.get("types") or [])), subject)


async def watch(rt: Runtime, hub: EventHub, caller: Caller, raw: dict[str, Any],
                opened: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[dict[str, Any]]:
    """Yield the tenant's matching events after `after_id` (or from now) until cancelled;
    `opened()` is awaited once the stream is allowed and its start fixed, before any event.

    The stream holds a slot (see StreamSlots) from before IAM is asked until it ends, however it
    ends; membership is checked first, so no outsider can use up a tenant's slots. IAM decides
    again on each batch of events, with the policy read beside them: a stream the tenant's policy
    no longer allows, or whose caller was removed from the tenant, ends ACCESS_DENIED before its
    next event."""
    req = parse_watch(raw)
    caller.require_member(req.tenant_id)
    release = hub.slots.acquire(caller.identity_id, req.tenant_id)
    sub = hub.subscribe(req.tenant_id, caller.token_id)
    attributes = {"types": req.types, "subject": req.subject}
    try:
        await authorize_tenant(rt, caller, req.tenant_id, EVENTS_READ, attributes)
        # skip: ids above `after` already committed at the start (from now only), never streamed
        after, skip = await _from_now(rt, req) if req.from_now else (req.after_id, [])
        await hub.ready()  # after an idle stretch: once the snapshot this watcher asked for is in
        if opened is not None:
            await opened()
        while True:
            sub.woken.clear()  # before reading: a wake-up during the read is kept
            upto = hub.safe_id
            async with db.read_only(rt.pool) as conn:
                rows = await (await conn.execute(_EVENTS, {
                    "tenant_id": req.tenant_id, "after": after, "upto": upto, "subject": req.subject,
                    "types": req.types, "skip": skip, "limit": BATCH,
                })).fetchall()
                policy = await authorize.read_policy(conn, req.tenant_id) if rows else None
                now = await (await conn.execute(_CALLER_NOW, {
                    "identity_id": caller.identity_id, "tenant_id": req.tenant_id, "token_id": caller.token_id,
                })).fetchone() if rows else {"member": True, "live": True}
            if sub.revoked or not now["live"]:  # while it read (a send or a wait notices it by itself)
                raise errors.Unauthenticated("the token was revoked", tokenId=caller.token_id)
            if not now["member"]:  # removed from the tenant since the stream opened (Admin.RemoveMembership)
                raise errors.AccessDenied("the caller is not a member of this tenant", tenantId=req.tenant_id)
            if rows:  # the policy as it is now: one tightened since the stream opened holds at once
                authorize.check(policy, caller, req.tenant_id, EVENTS_READ, "Tenant", req.tenant_id, attributes,
                                tenantId=req.tenant_id)
            for row in rows:
                timer = _end_if_stalled(sub, caller, rt.settings.watch_send_seconds)
                try:
                    yield row
                finally:
                    timer.cancel()
                    sub.end = None
            full = len(rows) == BATCH
            # Else every id <= upto is final and none left matches: skip the filtered-out ones too.
            after = rows[-1]["id"] if full else max(after, upto)
            skip = [i for i in skip if i > after]
            if not full:
                await _wait(sub, caller)
    finally:
        hub.unsubscribe(sub)
        release()


async def _from_now(rt: Runtime, req: WatchInput) -> tuple[int, list[int]]:
    """A from-now stream's start (module docstring): after B - 1, but not the matching ids that
    the start snapshot shows from B up. Read committed: each statement reads its own snapshot, the
    second one taken after the first statement's read of the open writers."""
    filters = {"tenant_id": req.tenant_id, "subject": req.subject, "types": req.types}
    async with db.read_only(rt.pool) as conn:
        below = (await (await conn.execute(_FROM_NOW_BELOW)).fetchone())["below"]
        rows = await (await conn.execute(_FROM_NOW_SEEN, {**filters, "below": below})).fetchall()
    return below - 1, [row["id"] for row in rows]


def _end_if_stalled(sub: _Subscription, caller: Caller, send_seconds: float) -> asyncio.TimerHandle:
    """While the stream is suspended in a send (a consumer that does not read): its RPC ends when
    the send takes longer than `send_seconds`, or the token expires or is revoked meanwhile. The
    wait that checks the token is never reached while the send is stuck, and the slot would be
    held for as long as the connection lives, and a revoked token that reads slowly would keep
    getting events. Only the handler ends: grpc has no server-side cancel, so the call itself
    (one unsent message) lingers until the client reads, cancels, disconnects or its deadline."""
    task = asyncio.current_task()
    assert task is not None
    left_s = send_seconds
    if caller.token_expires_ms:
        left_s = min(left_s, max(caller.token_expires_ms / 1000 - time.time(), 0))
    sub.end = task.cancel
    return asyncio.get_running_loop().call_later(left_s, task.cancel)


async def _wait(sub: _Subscription, caller: Caller) -> None:
    """Until the hub wakes the watcher; UNAUTHENTICATED once its token is revoked or expires."""
    if sub.revoked:
        raise errors.Unauthenticated("the token was revoked", tokenId=caller.token_id)
    left_s = (caller.token_expires_ms / 1000 - time.time()) if caller.token_expires_ms else None
    try:
        async with asyncio.timeout(None if left_s is None else max(left_s, 0)):
            await sub.woken.wait()
    except TimeoutError:
        raise errors.Unauthenticated("the token has expired", tokenId=caller.token_id) from None
    if sub.revoked:
        raise errors.Unauthenticated("the token was revoked", tokenId=caller.token_id)
