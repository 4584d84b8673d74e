"""reservations.extend, admitted like a create against the existing reservation.

Transaction 1 takes the reservation's extend slot (capacity_extend_holds: one extend at a time,
a hold older than 60 s of compute_now() is taken over) with a server-minted nonce and writes the
pending change into the authorization row, durationHours set to the total after the change. IAM
decides outside any transaction. Transaction 2 takes the pool lock first, applies the change only
while its hold still owns the slot, and moves every allocation's end or none: the EXCLUDE
constraint decides, and a booking in the way answers extended: false with availableUntil. A
refusal or an abandoned extend clears the pending change, but only when the hold is its own.
A delegated agent's extend its person holds for confirmation is refused with CONFIRMATION_REQUIRED
and retried once approved, as a create (extend_confirm).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import authorize, db, db_errors, errors, events, iam
from controlplane.auth import Caller
from controlplane.common.locks import pool_lock
from controlplane.common.names import IDEMPOTENCY_KEY, match
from controlplane.ids import new_id
from controlplane.nodes import desired
from controlplane.reservations import extend_confirm, preemption, queries, schedule, states
from controlplane.reservations.lifecycle import WINDOW_ENDED, ended_reason
from controlplane.reservations.reads import authorize_on, find_visible, resource_attributes, with_allocations
from controlplane.reservations.validate import DAY_MS, TimeLimits, duration_ms
from controlplane.runtime import Runtime

HOLD_TTL_S = 60
EXTENDABLE = frozenset({states.PLACED, states.BINDING, states.ACTIVE})


@dataclass(frozen=True)
class Change:
    until: int | None
    by_ms: int | None
    key: str


@dataclass
class Staged:
    row: dict[str, Any]
    hold: str = ""
    new_end: int = 0
    attributes: dict[str, Any] | None = None
    policy: str | None = None
    no_op: bool = False
    refusal: errors.DomainError | None = None  # what the row says against the change, before any write
    asked: extend_confirm.Asked | None = None  # a delegated agent's: its confirmation of this change


def parse(raw: dict[str, Any], limits: TimeLimits | None = None) -> Change:
    limits = limits or TimeLimits()
    key = match("idempotencyKey", raw.get("idempotency_key", ""), IDEMPOTENCY_KEY)
    until, by = raw.get("until"), raw.get("by")
    if (until is None) == (by is None):
        raise errors.InvalidInput("until", "give exactly one of until or by")
    if until is not None:
        if until <= 0:
            raise errors.InvalidInput("until", "must be epoch milliseconds")
        return Change(until, None, key)
    return Change(None, duration_ms("by", by, None, limits.max_length_ms), key)


async def extend(rt: Runtime, caller: Caller, tenant_id: str, rid: str, raw: dict[str, Any]) -> dict[str, Any]:
    limits = TimeLimits.of(rt.settings)
    change = parse(raw, limits)
    staged = await db.run_in_transaction(rt.pool, lambda c: _stage(c, caller, tenant_id, rid, change, limits))
    if staged.no_op or staged.refusal is not None:
        # No extend decision (spec: an until already reached answers without one, so that the
        # owner's retry is safe), but what the answer tells of another member's reservation (the
        # reservation, its state, its start) only to a caller who may read it, as get answers:
        # a member the policy refuses learns nothing through extend.
        if staged.row["owner_identity_id"] != caller.identity_id:
            await authorize_on(rt, caller, iam.READ, staged.row)
        if staged.refusal is not None:
            raise staged.refusal
        return {"reservation": staged.row, "extended": False}
    asked = staged.asked
    decision = (extend_confirm.decision_before_iam(asked) if asked is not None else None) or authorize.decide(
        staged.policy, caller, iam.EXTEND, "Reservation", rid, staged.attributes or {}, tenant_id=tenant_id,
        approved=asked is not None and asked.approved)
    try:
        result = await db.run_in_transaction(rt.pool, lambda c: _apply(c, caller, rid, staged, decision))
    except (errors.DomainError, psycopg.Error, asyncio.CancelledError):
        # The abandoned hook: a transaction of its own clears our pending change, and only ours.
        # Shielded: when the client went away (its deadline, a disconnect) it still runs, or the
        # slot would refuse every extend of the reservation until taken over.
        await asyncio.shield(db.run_in_transaction(rt.pool, lambda c: _abandon(c, rid, staged.hold)))
        raise
    if "error" in result:
        raise result["error"]  # the refusal committed (pending change cleared) before it is raised
    return result


async def _stage(
    conn: AsyncConnection, caller: Caller, tenant_id: str, rid: str, change: Change, limits: TimeLimits
) -> Staged:
    row = await find_visible(conn, caller, tenant_id, rid)
    try:  # everything up to the hold reads only: a refusal here is answered after a read decision
        new_end = await _checked_end(conn, row, tenant_id, change, limits)
        if new_end <= row["during_end"]:
            return Staged(await with_allocations(conn, row), no_op=True)  # already reached: no decision
        hold = new_id("hold")
        taken = await (await conn.execute(queries.TAKE_EXTEND_HOLD, {"id": rid, "hold": hold, "ttl": HOLD_TTL_S})).fetchone()
        if taken is None:
            raise errors.Conflict("another extend of this reservation is in flight", reason="extend-in-flight",
                                  retryAfterSeconds=HOLD_TTL_S, reservationId=rid)
    except errors.DomainError as refusal:
        return Staged(row, refusal=refusal)
    # The draft's attributes, with what changes after it (its owner, its state) read from the row
    # as get, renew, cancel and release decide on it.
    stored = (await (await conn.execute(queries.AUTHZ_ATTRIBUTES, {"id": rid})).fetchone())["attributes"]
    attributes = {**stored, **resource_attributes(row)}
    total_ms = new_end - row["during_start"]
    attributes.update(durationHours=math.ceil(total_ms / 3_600_000), durationMs=total_ms)
    await conn.execute(queries.SET_PENDING_EXTEND, {"id": rid, "pending": Jsonb(
        {"hold": hold, "until": new_end, "durationHours": attributes["durationHours"], "key": change.key})})
    asked = None
    if caller.delegated:  # an agent's change may be held for, or approved by, its person
        digest = extend_confirm.digest(change.key, change.until, change.by_ms, new_end)
        asked = await extend_confirm.asked(conn, caller, rid, digest)
    return Staged(row, hold, new_end, attributes, await authorize.read_policy(conn, tenant_id), asked=asked)


async def _checked_end(conn: AsyncConnection, row: dict[str, Any], tenant_id: str, change: Change,
                       limits: TimeLimits) -> int:
    """The end the change asks for, refused (raised) when the row's state, its window, its nodes
    or its pool forbid it; an end already reached is returned for the caller to answer."""
    rid = row["id"]
    if row["state"] not in EXTENDABLE:
        raise errors.InvalidState(f"a {row['state']} reservation cannot be extended", state=row["state"],
                                  reservationId=rid)
    await _require_alive(conn, row)
    new_end = change.until if change.until is not None else row["during_end"] + (change.by_ms or 0)
    latest = row["during_start"] + limits.max_length_ms
    if new_end > latest:
        raise errors.InvalidInput("until" if change.until is not None else "by",
                                  f"a reservation lasts at most {limits.max_length_ms / DAY_MS:g} days from its start",
                                  maxUntil=latest, reservationId=rid)
    if new_end <= row["during_end"]:
        return new_end
    await _require_in_service(conn, row)  # (an until already reached answers extended: false above)
    offered = {"pool_id": row["pool_id"], "tenant_id": tenant_id}
    if await (await conn.execute(queries.POOL_OFFERED, offered)).fetchone() is None:
        raise errors.InvalidState("the pool is no longer offered to this tenant: the reservation cannot be extended",
                                  reason="pool-withdrawn", poolId=row["pool_id"], reservationId=rid)
    return new_end


async def _apply(
    conn: AsyncConnection, caller: Caller, rid: str, staged: Staged, decision: iam.Decision
) -> dict[str, Any]:
    await pool_lock(conn, staged.row["pool_id"])
    row = await (await conn.execute(queries.BY_ID_FOR_UPDATE, {"id": rid})).fetchone()
    ours = await (await conn.execute(queries.OWNS_EXTEND_HOLD, {"id": rid, "hold": staged.hold})).fetchone()
    if ours is None:
        raise errors.Conflict("another extend took over this one's slot", reason="extend-in-flight",
                              retryAfterSeconds=HOLD_TTL_S, reservationId=rid)
    if not decision.allowed:
        await _release_slot(conn, rid, staged.hold)
        if staged.asked is not None:  # a delegated agent: held for its person, or refused
            return {"error": await extend_confirm.held(conn, caller, row, staged.asked, decision, staged.new_end)}
        return {"error": errors.AccessDenied("IAM refused this extension", reservationId=rid)}
    if row["state"] not in EXTENDABLE or row["during_end"] != staged.row["during_end"]:
        raise errors.Conflict("the reservation changed while the extension was decided",
                              reason="reservation-changed", reservationId=rid)
    await _require_alive(conn, row)  # its end may have passed while IAM decided
    await _require_in_service(conn, row)  # and its node may have been revoked or cordoned
    if staged.asked is not None and staged.asked.approved:
        lapsed = await extend_confirm.take_approval(conn, rid, staged.asked)
        if lapsed is not None:
            await _release_slot(conn, rid, staged.hold)
            return {"error": lapsed}
    params = {"id": rid, "from": row["during_end"], "to": staged.new_end}
    try:
        async with conn.transaction():  # savepoint: all allocations move, or none
            await conn.execute(queries.MOVE_BOOKING_ENDS, params)
    except psycopg.errors.ExclusionViolation as exc:
        if not (db_errors.violates(exc, db_errors.BOOKINGS_NO_OVERLAP)
                or db_errors.violates(exc, db_errors.HOST_BOOKINGS_WITHIN_ALLOCATABLE)):
            raise
        available = (await (await conn.execute(queries.AVAILABLE_UNTIL, params)).fetchone())["until"]
        await _release_slot(conn, rid, staged.hold)
        return {"reservation": await with_allocations(conn, row), "extended": False, "available_until": available}
    await conn.execute(queries.SET_WINDOW_END, params)
    await preemption.withdraw_notice(conn, row)  # past its notice's end: no longer preempted
    await desired.bump_live_of(conn, rid)
    await _release_slot(conn, rid, staged.hold)
    if staged.asked is not None:
        await extend_confirm.used(conn, staged.asked)  # it authorises this change and no other
    await schedule.at(conn, rid, staged.new_end)
    fresh = await (await conn.execute(queries.BY_ID, {"id": rid})).fetchone()
    await events.emit_reservation(conn, fresh, "reservation.extended", **{"from": row["during_end"], "to": staged.new_end})
    return {"reservation": await with_allocations(conn, fresh), "extended": True}


async def _require_alive(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """INVALID_STATE once its window ended or its lease lapsed, though the reconciler has not
    released it yet: an extend does not bring it back."""
    reason = await ended_reason(conn, row)
    if reason is not None:
        raise errors.InvalidState("this reservation has ended" if reason == WINDOW_ENDED else "its lease lapsed",
                                  state=row["state"], reservationId=row["id"], reason=reason)


_OUT_OF_SERVICE = {
    "node-revoked": "its node {node} was revoked",
    "node-cordoned": "its node {node} is cordoned",
    "device-unhealthy": "its GPU {device} on node {node} is quarantined",
}


async def _require_in_service(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """INVALID_STATE while a started allocation sits on a node revoked or cordoned, or on a GPU
    quarantined: more time is new capacity there, and the operator took that hardware out of
    service. Its current window runs its course (spec P6); an unreachable node is no refusal (it
    may come back), nor is a placed reservation's node (BookingRepair moves its whole window, the
    extension included, before the start)."""
    bad = await (await conn.execute(queries.OUT_OF_SERVICE, {"id": row["id"]})).fetchone()
    if bad is None:
        return
    why = _OUT_OF_SERVICE[bad["reason"]].format(node=bad["node_id"], device=bad["device_uuid"])
    details = {"reason": bad["reason"], "nodeId": bad["node_id"], "state": row["state"], "reservationId": row["id"]}
    if bad["reason"] == "device-unhealthy":
        details["deviceUuid"] = bad["device_uuid"]
    raise errors.InvalidState(f"{why}: the reservation cannot be extended there; release it and reserve again",
                              **details)


async def _release_slot(conn: AsyncConnection, rid: str, hold: str) -> None:
    """Clear the pending change and free the slot, only when the hold is still ours."""
    gone = await conn.execute(queries.DROP_EXTEND_HOLD, {"id": rid, "hold": hold})
    if gone.rowcount:
        await conn.execute(queries.CLEAR_PENDING_EXTEND, {"id": rid})


async def _abandon(conn: AsyncConnection, rid: str, hold: str) -> None:
    await conn.execute(queries.OWNS_EXTEND_HOLD, {"id": rid, "hold": hold})
    await _release_slot(conn, rid, hold)
