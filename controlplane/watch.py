"""Events.Watch: a tenant's stored events in id order, then new ones as they commit.

One `EventHub` per process holds the only LISTEN bc_events connection and wakes the watchers of
the tenants it hears about; watchers never poll.

Event ids come from a sequence, so a transaction that commits later can hold a smaller id than
one already visible: streaming every visible id would skip it for good, and a resumed stream
would never see it. The hub therefore streams only up to a *safe frontier*: an id such that
every event at or below it has either committed or will never exist.

Every event writer holds a shared advisory lock from before it takes an id until it ends
(`next_event_id()`, migration 0005), and releases it only after its commit is visible. One
statement reads M = max(id) of the visible events and, after its snapshot was taken, W = the
transactions holding that lock (pg_locks). A transaction holding an id below M took the lock
before M's writer took its id, so it has either ended (its event is visible from now on, or
rolled back) or is in W. Once none of W holds the lock any more, every id <= M is final. So
each wake-up records the candidate (M, W) and the frontier moves to M as soon as a later read
shows W all gone; a candidate with an empty W is safe at once. The cost: the stream trails an
event writer still open when a later event committed, by that writer's remaining length;
other transactions, however long, do not hold it back.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import structlog

from controlplane import authorize, db, errors
from controlplane.auth import Caller
from controlplane.common.names import TENANT_ID, match
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
# The safety net for a lost notification (e.g. across a listener reconnect).
POLL_SECONDS = 10.0
# Candidates kept while a long transaction holds the frontier back; beyond this the newest two
# are merged (their writer sets united: stricter, so still safe).
MAX_CANDIDATES = 64

_ALL = "*"  # wake every watcher

# The lock of next_event_id(): (7311005, 1) in pg_advisory_xact_lock_shared's two-key form.
_SNAPSHOT = """
SELECT coalesce(max(id), 0) AS hi,
       array(SELECT l.virtualtransaction FROM pg_locks l
             WHERE l.locktype = 'advisory' AND l.classid = 7311005 AND l.objid = 1 AND l.objsubid = 2
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       ) AS writers
FROM events
"""

_EVENTS = """
SELECT id, type, subject, tenant_id, epoch_ms(time) AS time_ms, data
FROM events
WHERE tenant_id = %(tenant_id)s AND id > %(after)s AND id <= %(upto)s
  AND (%(subject)s = '' OR subject = %(subject)s)
  AND event_type_matches(%(types)s::text[], type)
ORDER BY id
LIMIT %(limit)s
"""



def parse_types(field_name: str, types: list[str]) -> list[str]:
    """Validate a type filter (see TYPE_FILTER); INVALID_INPUT names the field."""
    if len(types) > MAX_TYPE_FILTERS:
        raise errors.InvalidInput(field_name, f"at most {MAX_TYPE_FILTERS} entries")
    for t in types:
        if len(t) > 128 or not TYPE_FILTER.match(t):
            raise errors.InvalidInput(field_name, f"{t!r} is not an event type or a prefix ending in '.'")
    return sorted(set(types))


async def authorize_tenant(rt: Runtime, caller: Caller, tenant_id: str, action: str,
                           attributes: dict[str, Any]) -> None:
    """Membership, then IAM on the tenant (read in a read-only transaction, decided outside)."""
    match("tenantId", tenant_id, TENANT_ID)
    caller.require_member(tenant_id)
    async with db.read_only(rt.pool) as conn:
        await authorize.require(conn, caller, tenant_id, action, "Tenant", tenant_id, attributes, tenantId=tenant_id)


@dataclass
class _Candidate:
    hi: int
    writers: frozenset[str]  # virtual transaction ids of the event writers open at the time
    tenants: set[str]


@dataclass(eq=False)  # hashed by identity: one per watcher
class _Subscription:
    tenant_id: str
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class EventHub:
    """The process's one listener: keeps the safe frontier and wakes watchers by tenant."""

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self.safe_id = 0
        self._ready = asyncio.Event()
        self._candidates: list[_Candidate] = []
        self._subs: dict[str, set[_Subscription]] = {}

    def subscribe(self, tenant_id: str) -> _Subscription:
        sub = _Subscription(tenant_id)
        self._subs.setdefault(tenant_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: _Subscription) -> None:
        subs = self._subs.get(sub.tenant_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.tenant_id]

    async def ready(self) -> int:
        """The safe frontier, once the hub has computed one."""
        await self._ready.wait()
        return self.safe_id

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True) as conn:
                    await conn.execute("LISTEN bc_events")
                    # Anything may have committed while no one listened.
                    await self._tick(conn, {_ALL})
                    await self._listen(conn, stop)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event hub failed; reconnecting")
                await asyncio.sleep(1)

    async def _listen(self, conn: psycopg.AsyncConnection, stop: asyncio.Event) -> None:
        recheck = RECHECK_SECONDS[0]
        while not stop.is_set():
            pending = bool(self._candidates)
            tenants: set[str] = set()
            async for note in conn.notifies(timeout=recheck if pending else POLL_SECONDS, stop_after=1):
                tenants.add(note.payload)
            # Notifications that arrive during the tick are kept by psycopg for the next round.
            if not tenants and not pending:
                tenants = {_ALL}  # the slow safety net: wake everyone in case a NOTIFY was lost
            await self._tick(conn, tenants)
            recheck = RECHECK_SECONDS[0] if tenants else min(recheck * 2, RECHECK_SECONDS[1])

    async def _tick(self, conn: psycopg.AsyncConnection, tenants: set[str]) -> None:
        """Take a snapshot, record it as a candidate frontier, advance to the resolved ones.

        `tenants` were notified before this snapshot, so their new events are at or below its
        `hi`: they are woken when a candidate at or above it resolves (or now, if already safe).
        """
        row = await (await conn.execute(_SNAPSHOT)).fetchone()
        assert row is not None
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
        self._ready.set()

    def _wake(self, tenants: set[str]) -> None:
        targets = self._subs.keys() if _ALL in tenants else tenants & self._subs.keys()
        for tenant_id in list(targets):
            for sub in self._subs[tenant_id]:
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


async def watch(rt: Runtime, hub: EventHub, caller: Caller, raw: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """Yield the tenant's matching events after `after_id` (or from now) until cancelled."""
    req = parse_watch(raw)
    await authorize_tenant(rt, caller, req.tenant_id, EVENTS_READ,
                           {"types": req.types, "subject": req.subject})
    sub = hub.subscribe(req.tenant_id)
    try:
        after = await hub.ready() if req.from_now else req.after_id
        while True:
            sub.woken.clear()  # before reading: a wake-up during the read is kept
            upto = hub.safe_id
            async with db.read_only(rt.pool) as conn:
                rows = await (await conn.execute(_EVENTS, {
                    "tenant_id": req.tenant_id, "after": after, "upto": upto, "subject": req.subject,
                    "types": req.types, "limit": BATCH,
                })).fetchall()
            for row in rows:
                yield row
            if len(rows) == BATCH:
                after = rows[-1]["id"]
                continue
            # Every id <= upto is final and none left matches: skip the filtered-out ones too.
            after = max(after, upto)
            await sub.woken.wait()
    finally:
        hub.unsubscribe(sub)
