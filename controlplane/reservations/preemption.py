"""Spot and preemption, the lifecycle side (spec "Spot and preemption", DESIGN.md section 9).

`place` is the inline placer's last resort for a regular reservation that fits nowhere: the victim
search and the commit are controlplane.placement.preempt's; here the victims get their notice in
the same transaction: a `Preempting` condition (reason `Preempted`, with `by` and `noticeUntil`),
their window ending at the notice's end (their bookings already do, so their nodes' holds show the
new `until`), `reservation.preempting` with the preemptor's id and the notice's end, and a wake-up
then. At the end of the notice the reconciler releases them as for any end, with reason
`preempted` and `reservation.preempted` (`end_reason`), refunding their quota. A preemptor
released or cancelled before the notice's end gives its victims their time back (`give_back`):
each notice is a row of preemption_notices (migration 0040) with the end the victim had, gone
when either of them ends. A victim that BookingRepair leaves pending keeps its notice (its retry
places it only to the cut) and ends preempted when the cut comes first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import db_errors, events
from controlplane.common.locks import pool_lock
from controlplane.metal import is_node_lease
from controlplane.nodes import desired
from controlplane.placement import gang, placer, preempt
from controlplane.reservations import queries, schedule, states
from controlplane.reservations.transitions import condition, move, set_conditions
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

PREEMPTING = "Preempting"

POOL_POLICY = "SELECT policy FROM pools WHERE id = %(pool_id)s"
NOW_UNDER_LOCK = f"SELECT epoch_ms({queries.CLOCK_NOW}) AS now_ms"
# The pending worker places inline, where preemption is: woken when the pool has spot work to take.
WAKE_IF_SPOT = """
SELECT pg_notify('bc_pool_freed', %(pool_id)s)
WHERE EXISTS (SELECT 1 FROM reservations WHERE pool_id = %(pool_id)s AND state IN ('placed', 'binding', 'active')
              AND request @> '{"spot": true}')
"""
LOCK_VICTIMS = """
SELECT id, tenant_id, pool_id, state, operation_state, request, conditions,
       epoch_ms(lower(during)) AS during_start, epoch_ms(upper(during)) AS during_end FROM reservations
WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE
"""
RECORD_NOTICE = """
INSERT INTO preemption_notices (victim_id, preemptor_id, cut, until)
VALUES (%(victim)s, %(preemptor)s, from_epoch_ms(%(cut)s), from_epoch_ms(%(until)s))
ON CONFLICT (preemptor_id, victim_id) DO NOTHING
"""
# The pool of a reservation that gave or is under notices (its end takes the pool lock first).
POOL_IF_NOTICED = """
SELECT r.pool_id FROM reservations r
WHERE r.id = %(id)s AND EXISTS (SELECT 1 FROM preemption_notices n WHERE n.preemptor_id = r.id OR n.victim_id = r.id)
"""
# The notices of `id`, gone with it: those it gave (what its victims may get back) and those it
# was under (nothing to give back to a reservation that ended).
TAKE_NOTICES = """
DELETE FROM preemption_notices WHERE preemptor_id = %(id)s OR victim_id = %(id)s
RETURNING preemptor_id, victim_id, epoch_ms(cut) AS cut, epoch_ms(until) AS until
"""
LOCK_VICTIM = """
SELECT id, tenant_id, pool_id, state, conditions, epoch_ms(upper(during)) AS during_end FROM reservations
WHERE id = %(id)s FOR UPDATE
"""
# The notice the victim is under once its end is `cut` again (the one that cut it there), if any.
NOTICE_AT = """
SELECT n.preemptor_id, r.tenant_id FROM preemption_notices n JOIN reservations r ON r.id = n.preemptor_id
WHERE n.victim_id = %(id)s AND n.cut = from_epoch_ms(%(cut)s)
"""
# A notice inside another (it cut later, another cut earlier since): the one that cut the victim
# back from `cut` now gives back what this one took as well.
MERGE_NOTICE = """
UPDATE preemption_notices SET until = from_epoch_ms(%(until)s)
WHERE victim_id = %(id)s AND until = from_epoch_ms(%(cut)s)
"""
NOTICE = """
UPDATE reservations
SET during = tstzrange(lower(during), from_epoch_ms(%(cut)s), '[)'), conditions = %(conditions)s,
    version = version + 1, updated_at = clock_timestamp()
WHERE id = %(id)s AND upper(during) > from_epoch_ms(%(cut)s)
"""


@dataclass(frozen=True)
class Preempted:
    ask: placer.Ask  # the preemptor's window: from the end of the notice
    node_ids: list[str]
    victims: list[str]
    now_ms: int  # the clock under the pool lock: the placement's time (its lease counts from it)


async def pool_notice_ms(conn: AsyncConnection, pool_id: str) -> int:
    """The pool's preemption notice (policy spot.noticeSeconds), read in this transaction."""
    policy = (await (await conn.execute(POOL_POLICY, {"pool_id": pool_id})).fetchone())["policy"]
    return preempt.notice_ms(policy)


def is_spot(request: dict[str, Any]) -> bool:
    return bool(request.get("spot"))


async def place(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], ask: placer.Ask, now_ms: int) -> Preempted | None:
    """Place `row` (locked, under the pool lock) by preempting spot reservations, or None. Spot
    never preempts, nor does a node lease (whole machines are metal's)."""
    request = row["request"]
    if is_spot(request) or is_node_lease(request):
        return None
    notice = await pool_notice_ms(conn, row["pool_id"])
    # The notice counts from now, under the pool lock: `now_ms` (and compute_now(), the
    # transaction's start) may be from before a wait for that lock, which would eat into it.
    now_ms = max(now_ms, (await (await conn.execute(NOW_UNDER_LOCK)).fetchone())["now_ms"])
    members = gang.Gang.of(request)
    choice = await preempt.plan(conn, ask, members, rt.settings, now_ms=now_ms, notice=notice)
    if choice is None:
        return None
    victims = [v for v in await (await conn.execute(LOCK_VICTIMS, {"ids": choice.victims})).fetchall()
               if v["state"] in states.BOOKED]
    node_ids = await preempt.commit(conn, choice, row["id"], members, rt.settings, index=rt.capacity,
                                    metrics=rt.metrics)
    if not node_ids:
        return None
    for victim in victims:
        by = row["id"] if victim["tenant_id"] == row["tenant_id"] else ""
        if victim["during_start"] >= choice.cut_ms:  # not begun by the cut: nothing of it is left
            await take_whole(conn, victim, by, now_ms)
        else:
            await notify(conn, victim, by, choice.cut_ms, now_ms, preemptor=row["id"])
    return Preempted(choice.ask, node_ids, [v["id"] for v in victims], now_ms)


async def take_whole(conn: AsyncConnection, victim: dict[str, Any], by: str, now_ms: int) -> None:
    """A victim that would begin at or after the cut (its bookings are gone): back to pending,
    retried like any pending reservation (so placed again, at its start if still ahead, once
    capacity frees: when the preemptor is withdrawn, at once), its quota still charged. It never
    ran, and hears of it at least a notice before its start (at or after the cut, now plus the
    notice at the earliest)."""
    from controlplane.reservations import lifecycle  # it imports this module

    await lifecycle.end_bookings(conn, victim["id"])
    await events.emit_reservation(conn, victim, "reservation.preempting", by=by, noticeUntil=now_ms)
    message = f"preempted by {by or 'another tenant'} before it began; placed again when capacity frees"
    await move(conn, victim, states.PENDING, operation_state="succeeded",
               conditions=[condition("Unschedulable", "Preempted", message, now_ms)])
    await events.emit_reservation(conn, victim, "reservation.pending", reason="Preempted")


def held_condition(by: str, cut_ms: int, now_ms: int) -> dict[str, Any]:
    held = condition(PREEMPTING, "Preempted", f"preempted by {by or 'another tenant'}: its devices are taken back"
                     " at the notice's end", now_ms)
    held.update(by=by, noticeUntil=cut_ms)
    return held


async def notify(conn: AsyncConnection, victim: dict[str, Any], by: str, cut_ms: int, now_ms: int, *,
                 preemptor: str) -> None:
    """The victim's notice: condition, window, the node's hold until, event, wake-up at the end,
    and the notice's row (what the victim gets back should the preemptor go away before the cut).
    `by`: the preemptor, or "" when it is another tenant's (whose id the victim must not learn)."""
    conditions = [c for c in victim["conditions"] if c.get("type") != PREEMPTING] + [held_condition(by, cut_ms, now_ms)]
    if victim["during_end"] is not None and victim["during_end"] > cut_ms:
        await conn.execute(RECORD_NOTICE, {"victim": victim["id"], "preemptor": preemptor, "cut": cut_ms,
                                           "until": victim["during_end"]})
    await conn.execute(NOTICE, {"id": victim["id"], "cut": cut_ms, "conditions": Jsonb(conditions)})
    await desired.bump_live_of(conn, victim["id"])
    await schedule.at(conn, victim["id"], cut_ms)
    await events.emit_reservation(conn, victim, "reservation.preempting", by=by, noticeUntil=cut_ms)


async def fall_back_inline(conn: AsyncConnection, pool_id: str, pending: list[dict[str, Any]]) -> None:
    """The lease batch left these rows pending: when one is regular and the pool has spot work, the
    pending worker retries them inline at once (after this commit), which may preempt."""
    if any(not is_spot(r["request"]) for r in pending):
        await conn.execute(WAKE_IF_SPOT, {"pool_id": pool_id})


def notice_of(row: dict[str, Any]) -> dict[str, Any] | None:
    """The Preempting condition of a row that got a notice, or None."""
    return next((c for c in row.get("conditions") or [] if c.get("type") == PREEMPTING), None)


def cut_of(row: dict[str, Any]) -> int | None:
    """Where the notice `row` is under ends its window (the preemptor's from there on), or None."""
    notice = notice_of(row)
    return None if notice is None else notice.get("noticeUntil")


def notice_over(row: dict[str, Any], now_ms: int) -> bool:
    """A pending victim (BookingRepair found it no room during its notice) with nothing left to
    place: the notice's end came, or its start is not before it. It ends as at the cut, preempted."""
    cut = cut_of(row)
    if row["state"] != states.PENDING or cut is None:
        return False
    start = row["request"].get("start")
    return max(now_ms, start if start is not None else now_ms) >= cut


async def withdraw_notice(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """`row` (locked) now ends past its notice (an extend got the devices back after its preemptor
    left them): it is no longer under notice, so its end is not a preemption."""
    if notice_of(row) is not None:
        await set_conditions(conn, row, [c for c in row["conditions"] if c.get("type") != PREEMPTING])


async def noticed(conn: AsyncConnection, rid: str) -> bool:
    """Whether `rid` gave notices or is under one (its end then needs the pool lock first)."""
    return await (await conn.execute(POOL_IF_NOTICED, {"id": rid})).fetchone() is not None


async def lock_pool_if_noticed(conn: AsyncConnection, rid: str) -> bool:
    """Before an end locks `rid`: the pool lock, when `rid` gave notices or is under one (its end
    takes them, and giving victims their time back books; a transaction that books, or writes a
    notice, takes the pool lock first). Whether it was taken."""
    found = await (await conn.execute(POOL_IF_NOTICED, {"id": rid})).fetchone()
    if found is not None:
        await pool_lock(conn, found["pool_id"])
    return found is not None


async def give_back(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """`row` (locked, the pool lock held when it has notices: `lock_pool_if_noticed`) ends: its
    notices go with it, in one statement. Those it was under are done with (read by no later give
    back, preemption or merge). Each victim of those it gave that has not reached the cut yet keeps
    its devices to the end it had before (its bookings and window move back, the notice is
    withdrawn, `reservation.extended`), unless another booking took them meanwhile (it needs them:
    the notice stands); a pending victim (BookingRepair found it no room) gets its window back, to
    be placed for it. A victim another preemptor cut earlier since stays under that one's notice,
    which now gives back this one's part too when it goes. Spot is preemptible so that a regular
    reservation can have the devices, not to be ended for nothing."""
    taken = await (await conn.execute(TAKE_NOTICES, {"id": row["id"]})).fetchall()
    notices = [n for n in taken if n["preemptor_id"] == row["id"]]
    if not notices:
        return
    now_ms = (await (await conn.execute(NOW_UNDER_LOCK)).fetchone())["now_ms"]
    notices = sorted((n for n in notices if n["cut"] > now_ms), key=lambda n: n["victim_id"])
    if not notices:  # every cut passed: the victims ended or end now
        return
    await pool_lock(conn, row["pool_id"])  # already held (lock_pool_if_noticed, the reconciler's pass)
    for notice in notices:
        victim = await (await conn.execute(LOCK_VICTIM, {"id": notice["victim_id"]})).fetchone()
        now_ms = (await (await conn.execute(NOW_UNDER_LOCK)).fetchone())["now_ms"]  # after any wait for the row
        if victim is None or victim["state"] not in GIVEN_BACK or notice["cut"] <= now_ms:
            continue
        params = {"id": victim["id"], "cut": notice["cut"], "until": notice["until"]}
        if victim["during_end"] != notice["cut"]:  # cut earlier since by another: that one gives this back
            await conn.execute(MERGE_NOTICE, params)
            continue
        await _restore(conn, victim, notice["cut"], notice["until"], now_ms)


# A victim gets its time back while booked, or pending after BookingRepair found it no room.
GIVEN_BACK = states.BOOKED | {states.PENDING}


async def _restore(conn: AsyncConnection, victim: dict[str, Any], cut_ms: int, until_ms: int, now_ms: int) -> None:
    moves = {"id": victim["id"], "from": cut_ms, "to": until_ms}
    booked = victim["state"] in states.BOOKED
    if booked:
        try:
            async with conn.transaction():  # savepoint: every booking moves back, or none
                await conn.execute(queries.MOVE_BOOKING_ENDS, moves)
        except psycopg.errors.ExclusionViolation as exc:
            if not (db_errors.violates(exc, db_errors.BOOKINGS_NO_OVERLAP)
                    or db_errors.violates(exc, db_errors.HOST_BOOKINGS_WITHIN_ALLOCATABLE)):
                raise
            log.info("preemption not given back: booked meanwhile", reservation_id=victim["id"])
            return
    await conn.execute(queries.SET_WINDOW_END, moves)
    outer = await (await conn.execute(NOTICE_AT, {"id": victim["id"], "cut": until_ms})).fetchone()
    kept = [c for c in victim["conditions"] if c.get("type") != PREEMPTING]
    if outer is not None:  # back under the notice that cut it there first
        by = outer["preemptor_id"] if outer["tenant_id"] == victim["tenant_id"] else ""
        kept.append(held_condition(by, until_ms, now_ms))
    await set_conditions(conn, victim, kept)
    if booked:
        await desired.bump_live_of(conn, victim["id"])
        await schedule.at(conn, victim["id"], until_ms)
    await events.emit_reservation(conn, victim, "reservation.extended", **{"from": cut_ms, "to": until_ms})
