"""Spot and preemption, the lifecycle side (spec "Spot and preemption", DESIGN.md section 9).

`place` is the inline placer's last resort for a regular reservation that fits nowhere: the victim
search and the commit are controlplane.placement.preempt's; here the victims get their notice in
the same transaction: a `Preempting` condition (reason `Preempted`, with `by` and `noticeUntil`),
their window ending at the notice's end (their bookings already do, so their nodes' holds show the
new `until`), `reservation.preempting` with the preemptor's id and the notice's end, and a wake-up
then. At the end of the notice the reconciler releases them as for any end, with reason
`preempted` and `reservation.preempted` (`end_reason`), refunding their quota.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import events
from controlplane.metal import is_node_lease
from controlplane.nodes import desired
from controlplane.placement import gang, placer, preempt
from controlplane.reservations import schedule, states
from controlplane.reservations.transitions import condition, set_conditions
from controlplane.runtime import Runtime

PREEMPTING = "Preempting"

POOL_POLICY = "SELECT policy FROM pools WHERE id = %(pool_id)s"
# compute_now() at this statement rather than at the transaction's start.
NOW_UNDER_LOCK = "SELECT epoch_ms(clock_timestamp() + offset_ms * interval '1 millisecond') AS now_ms FROM clock"
# The pending worker places inline, where preemption is: woken when the pool has spot work to take.
WAKE_IF_SPOT = """
SELECT pg_notify('bc_pool_freed', %(pool_id)s)
WHERE EXISTS (SELECT 1 FROM reservations WHERE pool_id = %(pool_id)s AND state IN ('placed', 'binding', 'active')
              AND request @> '{"spot": true}')
"""
LOCK_VICTIMS = """
SELECT id, tenant_id, pool_id, state, conditions FROM reservations
WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE
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


def is_spot(request: dict[str, Any]) -> bool:
    return bool(request.get("spot"))


async def place(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], ask: placer.Ask, now_ms: int) -> Preempted | None:
    """Place `row` (locked, under the pool lock) by preempting spot reservations, or None. Spot
    never preempts, nor does a node lease (whole machines are metal's)."""
    request = row["request"]
    if is_spot(request) or is_node_lease(request):
        return None
    policy = (await (await conn.execute(POOL_POLICY, {"pool_id": row["pool_id"]})).fetchone())["policy"]
    # The notice counts from now, under the pool lock: `now_ms` (and compute_now(), the
    # transaction's start) may be from before a wait for that lock, which would eat into it.
    now_ms = max(now_ms, (await (await conn.execute(NOW_UNDER_LOCK)).fetchone())["now_ms"])
    members = gang.Gang.of(request)
    choice = await preempt.plan(conn, ask, members, rt.settings, now_ms=now_ms, notice=preempt.notice_ms(policy))
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
        await notify(conn, victim, by, choice.cut_ms, now_ms)
    return Preempted(choice.ask, node_ids, [v["id"] for v in victims])


async def notify(conn: AsyncConnection, victim: dict[str, Any], by: str, cut_ms: int, now_ms: int) -> None:
    """The victim's notice: condition, window, the node's hold until, event, wake-up at the end.
    `by`: the preemptor, or "" when it is another tenant's (whose id the victim must not learn)."""
    held = condition(PREEMPTING, "Preempted", f"preempted by {by or 'another tenant'}: its devices are taken back"
                     " at the notice's end", now_ms)
    held.update(by=by, noticeUntil=cut_ms)
    conditions = [c for c in victim["conditions"] if c.get("type") != PREEMPTING] + [held]
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
    return next((c for c in row["conditions"] if c.get("type") == PREEMPTING), None)


async def withdraw_notice(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """`row` (locked) now ends past its notice (an extend got the devices back after its preemptor
    left them): it is no longer under notice, so its end is not a preemption."""
    if notice_of(row) is not None:
        await set_conditions(conn, row, [c for c in row["conditions"] if c.get("type") != PREEMPTING])
