"""Events.Watch: a tenant's stored events in id order, then new ones as they commit.

The process's EventHub (controlplane.event_hub) holds the only LISTEN bc_events connection, wakes
the watchers of the tenants it hears about, and keeps the safe frontier a stream reads up to.

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
from dataclasses import dataclass
from typing import Any

from controlplane import authorize, db, errors
from controlplane.auth import Caller
from controlplane.common.names import TENANT_ID, match
from controlplane.event_hub import EventHub, Subscription
from controlplane.reservations import reads
from controlplane.reservations.queries import EVENT_RESERVATION_COLUMNS, event_reservation_join
from controlplane.runtime import Runtime

EVENTS_READ = "compute:events:read"

# A type filter entry: an exact type ("reservation.placed") or a prefix ending in "."
# ("reservation.", "reservation-grant.").
TYPE_FILTER = re.compile(r"^[a-z][a-z0-9-]*(\.[a-z0-9-]+)*\.?$")
MAX_TYPE_FILTERS = 32
SUBJECT = re.compile(r"^[A-Za-z0-9._:/-]{1,256}$")

BATCH = 500
# Whether the watcher can still act in the tenant (migration 0052), read with each batch's
# policy, and whether its token is unrevoked (expiry has its own timer): an offboarding revokes
# the tokens and ends the membership's effect in one commit, and the stream ends UNAUTHENTICATED
# for it, as when only the hub's revocation notice ended it (which may come after this read).
_CALLER_NOW = """
SELECT can_act_in(%(identity_id)s, %(tenant_id)s) AS member,
       (%(token_id)s = '' OR EXISTS (SELECT 1 FROM api_tokens t WHERE t.id = %(token_id)s
                                      AND t.revoked_at IS NULL)) AS live
"""

_FILTER = """e.tenant_id = %(tenant_id)s
  AND (%(subject)s = '' OR e.subject = %(subject)s)
  AND event_type_matches(%(types)s::text[], e.type)"""
# With the reservation each is about, for the decision on reading it (reads.readable_events).
_EVENTS = f"""
SELECT e.id, e.type, e.subject, e.tenant_id, epoch_ms(e.time) AS time_ms, e.data, {EVENT_RESERVATION_COLUMNS}
FROM events e{event_reservation_join("e.subject", "e.tenant_id")}
WHERE {_FILTER} AND e.id > %(after)s AND e.id <= %(upto)s AND e.id <> ALL(%(skip)s::bigint[])
ORDER BY e.id
LIMIT %(limit)s
"""
# "From now" (module docstring): every id below `below` is final, as pg_locks is read after the
# snapshot of max(id); then, in a later snapshot (the start), the matching ids from there up.
_FROM_NOW_BELOW = "SELECT least(events_final_below(), (SELECT coalesce(max(id), 0) FROM events) + 1) AS below"
_FROM_NOW_SEEN = f"SELECT e.id FROM events e WHERE {_FILTER} AND e.id >= %(below)s ORDER BY e.id"



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
    next event (a batch read before the change is not streamed on: the change's notice has the
    stream read and decide again first). An event about a reservation is streamed only when the
    caller may read that reservation as get decides (reads.readable_events), so a stream tells no
    more than reading its reservations would. A revoked or expired token ends the stream
    UNAUTHENTICATED before its next event."""
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
            sub.access_changed = False  # and a change of access during the read is decided on again
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
            shown: set[int] = set()
            if rows:  # the policy as it is now: one tightened since the stream opened holds at once
                authorize.check(policy, caller, req.tenant_id, EVENTS_READ, "Tenant", req.tenant_id, attributes,
                                tenantId=req.tenant_id)
                readable = reads.readable_events(policy, caller, req.tenant_id, rows)
                shown = {e["id"] for e, ok in zip(rows, readable) if ok}
            passed = 0  # rows streamed or withheld, in order
            for row in rows:
                _require_token(sub, caller)
                if sub.access_changed:  # decide again, on a fresh read, before streaming more
                    break
                passed += 1
                if row["id"] not in shown:
                    continue
                timer = _end_if_stalled(caller, rt.settings.watch_send_seconds)
                try:
                    yield row
                finally:
                    timer.cancel()
            if passed < len(rows):  # broken off: read again after the last row passed
                after = rows[passed - 1]["id"] if passed else after
                skip = [i for i in skip if i > after]
                continue
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


def _end_if_stalled(caller: Caller, send_seconds: float) -> asyncio.TimerHandle:
    """While the stream is suspended in a send (a consumer that does not read): its RPC ends when
    the send takes longer than `send_seconds`, or the token expires meanwhile. The wait that
    checks the token is never reached while the send is stuck, and the slot would be held for as
    long as the connection lives. Only the handler ends: grpc has no server-side cancel, so the
    call itself (one unsent message) lingers until the client reads, cancels, disconnects or its
    deadline. A revocation does not end it so (a reader would never be told): the send, once the
    client reads it, is the last (`_require_token`), and a client that does not read meets this
    timer."""
    task = asyncio.current_task()
    assert task is not None
    left_s = send_seconds
    if caller.token_expires_ms:
        left_s = min(left_s, max(caller.token_expires_ms / 1000 - time.time(), 0))
    return asyncio.get_running_loop().call_later(left_s, task.cancel)


def _require_token(sub: Subscription, caller: Caller) -> None:
    """UNAUTHENTICATED, before the next event, once the stream's token is revoked or expired."""
    if sub.revoked:
        raise errors.Unauthenticated("the token was revoked", tokenId=caller.token_id)
    if caller.token_expires_ms and time.time() * 1000 >= caller.token_expires_ms:
        raise errors.Unauthenticated("the token has expired", tokenId=caller.token_id)


async def _wait(sub: Subscription, caller: Caller) -> None:
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
