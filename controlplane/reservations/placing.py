"""Placing a reservation whose quota is charged: used by admission (transaction 2), the pending
retry, BookingRepair and a binding failure. The call chain runs one way: callers here, this module
to controlplane.placement.placer, never back.

Admission and the pending retry call `prepare` (plan from a read-only snapshot, then take the pool
lock), lock the row and re-check it, then call `place_locked`. BookingRepair and a binding failure
already hold the pool lock and call `place_again`."""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import db, events
from controlplane.common.locks import pool_lock
from controlplane.ids import new_id
from controlplane.nodes.inventory import CAP_PREFIX, SYSTEM
from controlplane.metal import is_node_lease
from controlplane.metal import placement as whole_machines
from controlplane.placement import gang, placer
from controlplane.reservations import kubernetes, preemption, queries, schedule, states
from controlplane.reservations.transitions import condition, move, move_wake_emit, set_conditions
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

LIMITS_LABEL = CAP_PREFIX + "devices.limits"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` planned, before any lock; `place_locked` commits it (re-planning lost races)."""

    ask: placer.Ask
    planned: placer.Planned | gang.GangPlanned  # a gang's plan has every member


async def prepare(
    conn: AsyncConnection, rt: Runtime, row: dict[str, Any], now_ms: int, *, lock: bool = True
) -> Prepared:
    """Plan the row's window (reads only), then take the pool lock: the caller locks the row next,
    in capacity's lock order. With lock=False the caller takes the pool lock itself, before the row
    (admission does both in one statement)."""
    ask = ask_for(row, now_ms)
    planned = await plan_for(conn, rt, row, ask)
    if lock:
        await pool_lock(conn, row["pool_id"])
    return Prepared(ask, planned)


async def plan_for(
    conn: AsyncConnection, rt: Runtime, row: dict[str, Any], ask: placer.Ask
) -> placer.Planned | gang.GangPlanned:
    """The plan of `row` for the ask's window, reads only: what create commits and what
    capacity.preview answers (one code path, so a preview that fits is a create that fits)."""
    members = gang.Gang.of(row["request"])
    if is_node_lease(row["request"]):  # whole machines are planned under the pool lock, at commit
        return placer.Planned(None)
    if members is not None:  # every node of the pool, on the index; never the SQL shortlist
        return await gang.plan(conn, ask, members, rt.settings, index=rt.capacity)
    return await placer.plan(conn, ask, rt.settings, index=rt.capacity)


async def place_again(
    conn: AsyncConnection, rt: Runtime, row: dict[str, Any], window: tuple[int, int], avoid: frozenset[str],
    now_ms: int,
) -> tuple[placer.Ask, placer.Placement | None]:
    """Place a reservation whose old allocations were released, for `window`, avoiding `avoid`
    (BookingRepair, a binding failure). The pool lock must be held.

    What the old allocations leave free may fit the pool's pending reservations, so they are
    woken at commit whatever happens to this one (DESIGN.md section 9), as after a release."""
    await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": row["pool_id"]})
    ask = dataclasses.replace(ask_for(row, now_ms), start_ms=window[0], end_ms=window[1])
    if is_node_lease(row["request"]):
        machines = await whole_machines.commit(conn, ask, None, row["id"], rt.settings, exclude=avoid)
        return ask, (machines.placements or [None])[0]
    planned = await placer.plan(conn, ask, rt.settings, exclude=avoid, index=rt.capacity)
    return ask, await placer.commit(conn, ask, row["id"], planned, rt.settings, exclude=avoid, metrics=rt.metrics,
                                    index=rt.capacity)


@dataclasses.dataclass(frozen=True)
class Replaced:
    """What `place_again_any` placed: the nodes (none when nothing fits) and why none fit."""

    node_ids: list[str]
    reason: str = ""


async def place_again_any(
    conn: AsyncConnection, rt: Runtime, row: dict[str, Any], window: tuple[int, int], avoid: frozenset[str],
    now_ms: int,
) -> Replaced:
    """`place_again` for any reservation: a gang is placed again as a whole, on any label value."""
    members = gang.Gang.of(row["request"])
    if members is None:
        ask, placement = await place_again(conn, rt, row, window, avoid, now_ms)
        if placement is None:
            return Replaced([], await explain(conn, row, ask))
        return Replaced([placement.node_id])
    await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": row["pool_id"]})
    ask = dataclasses.replace(ask_for(row, now_ms), start_ms=window[0], end_ms=window[1])
    committed = await commit_gang(conn, rt, row, ask, members, exclude=avoid)
    return Replaced(committed.node_ids, committed.reason)


async def commit_gang(
    conn: AsyncConnection, rt: Runtime, row: dict[str, Any], ask: placer.Ask, members: gang.Gang, *,
    exclude: frozenset[str] = frozenset(), within: str | None = None,
) -> gang.Committed:
    """Plan and commit `members` of `row`'s gang for the ask's window (the pool lock held): whole
    machines for a node lease, the per-node devices otherwise; `within` keeps to one label value."""
    if is_node_lease(row["request"]):
        return await whole_machines.commit(conn, ask, members, row["id"], rt.settings, exclude=exclude, within=within)
    planned = await gang.plan(conn, ask, members, rt.settings, index=rt.capacity, exclude=exclude, within=within)
    return await gang.commit(conn, ask, members, row["id"], planned, rt.settings, index=rt.capacity,
                             exclude=exclude, within=within, metrics=rt.metrics)


async def go_pending(conn: AsyncConnection, row: dict[str, Any], reason: str, message: str, now_ms: int) -> None:
    """Nothing fits after a re-placement: pending with Unschedulable, retried like any pending one.
    A victim keeps its notice: a retry places it only to the cut (`ask_for`), and a preemptor that
    goes away gives it its window back (preemption.give_back)."""
    await move(conn, row, states.PENDING, operation_state="succeeded",
               conditions=[condition("Unschedulable", reason, message, now_ms), *_notice(row)])
    await events.emit_reservation(conn, row, "reservation.pending", reason=reason)


async def explain(conn: AsyncConnection, row: dict[str, Any], ask: placer.Ask) -> str:
    """Why nothing fits: whole machines for a node lease, devices otherwise."""
    if is_node_lease(row["request"]):
        return await whole_machines.explain(conn, ask)
    return await placer.explain(conn, ask)


def at_clock(prepared: Prepared, row: dict[str, Any], now_ms: int) -> Prepared:
    """`prepared` with the window the clock read under the pool lock gives (ask_for at `now_ms`):
    a start that passed since the plan begins now, with the full duration. The plan is kept; a
    booking it no longer fits is a lost race, which the commit plans again."""
    ask = ask_for(row, now_ms)
    if (ask.start_ms, ask.end_ms) == (prepared.ask.start_ms, prepared.ask.end_ms):
        return prepared
    return dataclasses.replace(prepared, ask=dataclasses.replace(prepared.ask, start_ms=ask.start_ms,
                                                                 end_ms=ask.end_ms))


def _notice(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The Preempting condition of a victim, kept through a re-placement ([] when none)."""
    notice = preemption.notice_of(row)
    return [notice] if notice is not None else []


def ask_for(row: dict[str, Any], now_ms: int) -> placer.Ask:
    """The window: a start still ahead is kept; otherwise the window begins now, full length. A
    victim under notice (pending after BookingRepair found it no room) ends at the cut at the
    latest: from there on its devices are the preemptor's (preemption.notice_over: none left)."""
    request = row["request"]
    device = request["devices"][0]
    start = request.get("start")
    begin = start if start is not None and start > now_ms else now_ms
    end = begin + request["durationMs"]
    cut = preemption.cut_of(row)
    if cut is not None and begin < cut:
        end = min(end, cut)
    return placer.Ask(
        pool_id=row["pool_id"],
        count=device["count"],
        topology=device["topology"],
        model=device.get("model") or "",
        selector=request.get("nodeSelector") or {},
        required=required_labels(request),
        start_ms=begin,
        end_ms=end,
        device_class=device.get("class") or "gpu",
        profile=device.get("profile") or "",
        host=dict(request.get("resources") or {}),
    )


def required_labels(request: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The system labels of the capabilities the request needs of a node's bcd (its binding's,
    and devices.limits when it books host resources), as JSON containment: where it places, and
    what BookingRepair checks its nodes still carry."""
    return {**kubernetes.required_labels(request), **limits_label(request)}


def limits_label(request: dict[str, Any]) -> dict[str, dict[str, str]]:
    """A request that books any host resource places only where bcd enforces limits: the system
    label of the devices.limits capability (an operator label of that name does not count)."""
    if not any((request.get("resources") or {}).values()):
        return {}
    return {LIMITS_LABEL: {"value": "true", "source": SYSTEM}}


def lease_deadline_of(row: dict[str, Any], now_ms: int) -> int | None:
    """The lease deadline a placement at `now_ms` sets: `leaseSeconds` from then (None: no lease).
    The statement that moves the row to placed (place_inline, TRANSITION_WAKE_EMIT, the lease
    batch's MOVE_BATCH) counts it from its own clock under the pool lock, this at least."""
    lease = row["request"].get("leaseSeconds")
    return now_ms + lease * 1000 if lease else None


def placed_data(pool_id: str, node_ids: list[str], ask: placer.Ask) -> dict[str, Any]:
    """The data of a `reservation.placed` event."""
    return {"state": states.PLACED, "poolId": pool_id, "nodeIds": node_ids, "start": ask.start_ms, "end": ask.end_ms}


RACE_LOST = "BCP01"  # place_inline (migration 0032): a booking it planned was taken meanwhile
# PLACE_INLINE's array parameters, passed as array literals (db.array_literal)
_PLACE_INLINE_ARRAYS = ("resources", "amounts", "pers", "lenient", "unnamed", "atom_ids", "device_ids", "moments",
                        "from_states")


def at_once(row: dict[str, Any], prepared: Prepared) -> bool:
    """Whether `place_at_once` can place it: a plan on one node, its devices and host resources
    (a gang, a whole-machine lease, or nothing planned take the general path)."""
    return (isinstance(prepared.planned, placer.Planned) and prepared.planned.plan is not None
            and not is_node_lease(row["request"]) and gang.Gang.of(row["request"]) is None)


async def place_at_once(
    conn: AsyncConnection, rt: Runtime, row: dict[str, Any], prepared: Prepared, now_ms: int, admitted: dict[str, Any]
) -> dict[str, Any] | None:
    """The whole locked part of an inline create in one statement, in autocommit (place_inline:
    the pool lock shared and the node's lock, the row, `admitted`'s decision, the allocation, its
    bookings and host resources, the move to placed with its wake-ups and event, the charge last;
    controlplane.common.locks): nothing goes back and forth while the locks are held. Its row: `outcome` ('placed': the rest is the reservation as moved with its
    allocations; 'decided', 'missing'). None when the race was lost (nothing of it committed; the
    index has read that node again: the caller takes the general path, which plans again). A
    quota refusal raises as charge_all raised it."""
    assert isinstance(prepared.planned, placer.Planned) and prepared.planned.plan is not None
    ask, planned, chosen = prepared.ask, prepared.planned, prepared.planned.plan
    lease_deadline = lease_deadline_of(row, now_ms)
    params = ask.params(
        **admitted, id=row["id"], version=row["version"],
        allocation_id=new_id("alloc"), node_id=chosen.node_id, atom_ids=chosen.atom_ids,
        device_ids=[planned.uuids[a] for a in chosen.atom_ids], lease_deadline=lease_deadline,
        # The deadline's wake-up is place_inline's: it counts the lease from under the lock.
        moments=schedule.booked_moment_list(ask.start_ms, ask.end_ms, None, now_ms),
        from_states=states.sources_of(states.PLACED),
        data=Jsonb(placed_data(row["pool_id"], [chosen.node_id], ask)),
        limits=Jsonb(placer.limits_of(host)) if (host := ask.host_amounts()) else None,
    )
    for key in _PLACE_INLINE_ARRAYS:  # PLACE_INLINE casts each
        params[key] = db.array_literal(params[key])
    try:
        found = await (await conn.execute(queries.PLACE_INLINE, params)).fetchone()
    except psycopg.Error as exc:
        if exc.sqlstate != RACE_LOST:
            raise
        log.info("placement race lost", node_id=chosen.node_id, attempt=1, detail=exc.diag.message_detail)
        if rt.capacity is not None:  # what the index missed about that node (committed: the insert waited)
            await rt.capacity.refresh(conn, {chosen.node_id: ask.pool_id})
        return None
    assert found is not None
    if found["outcome"] == "placed":
        rt.metrics.placement(planned.started, True)
    return found


async def place_locked(
    conn: AsyncConnection,
    rt: Runtime,
    row: dict[str, Any],
    prepared: Prepared,
    now_ms: int,
) -> dict[str, Any] | None:
    """Commit the plan (re-planning lost races) and move the row to placed, or to pending with an
    Unschedulable condition. Emits the event in the same transaction. When placed, the reservation
    as placed, with its allocations (as reads.load_view reads it); None when pending."""
    ask = prepared.ask
    if is_node_lease(row["request"]):  # one machine, or a gang of them
        machines = await whole_machines.commit(conn, ask, gang.Gang.of(row["request"]), row["id"], rt.settings)
        node_ids, why = machines.node_ids, machines.reason
    elif isinstance(prepared.planned, gang.GangPlanned):
        members = gang.Gang.of(row["request"])
        assert members is not None
        committed = await gang.commit(conn, ask, members, row["id"], prepared.planned, rt.settings,
                                      index=rt.capacity, metrics=rt.metrics)
        node_ids, why = committed.node_ids, committed.reason
    else:
        planned = prepared.planned
        if planned.plan is None:  # planned before the pool lock: capacity freed since then counts
            planned = await placer.plan_from_sql(conn, ask, rt.settings, frozenset(), planned.started)
        placement = await placer.commit(conn, ask, row["id"], planned, rt.settings, metrics=rt.metrics,
                                        index=rt.capacity)
        node_ids, why = ([placement.node_id] if placement else []), ""
    lease_from = now_ms
    if not node_ids:  # a regular reservation may take spot bookings, from the end of a notice
        taken = await preemption.place(conn, rt, row, ask, now_ms)
        if taken is not None:  # its lease counts from its placement, under the pool lock
            ask, node_ids, lease_from = taken.ask, taken.node_ids, taken.now_ms
    if not node_ids:
        reason = why or await explain(conn, row, ask)
        if row["state"] == states.PENDING:
            # A retry that still finds nothing keeps the reason it went pending for (NoFit, or
            # BookingRepairFailed after a repair) and only refreshes the message; a preempted
            # one keeps its message too, which names what preempted it.
            held = next((c for c in row["conditions"] if c.get("type") == "Unschedulable"), None)
            if held is None or (held.get("message") != reason and held.get("reason") != "Preempted"):
                why = held.get("reason", "NoFit") if held else "NoFit"
                await set_conditions(conn, row, [condition("Unschedulable", why, reason, now_ms), *_notice(row)])
            return None
        await move(conn, row, states.PENDING, operation_state="succeeded",
                   conditions=[condition("Unschedulable", "NoFit", reason, now_ms)], attempt=True)
        await events.emit_reservation(conn, row, "reservation.pending", reason=reason)
        return None
    lease_deadline = lease_deadline_of(row, lease_from)
    return await move_wake_emit(
        conn, row, states.PLACED, operation_state="succeeded", conditions=_notice(row),  # a victim keeps its notice
        window=(ask.start_ms, ask.end_ms), lease_deadline=lease_deadline,  # counted again under the lock
        moments=schedule.booked_moment_list(ask.start_ms, ask.end_ms, None, now_ms),  # the deadline's wake-up: its own
        event_type="reservation.placed", nodeIds=node_ids, start=ask.start_ms, end=ask.end_ms,
    )

