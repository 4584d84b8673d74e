"""From placed to active: binding at the start, the bind deadline, node conditions while active.

Failure handling (spec "Bindings"): no report within 5 minutes, or an AllocationFailed report:
the bookings are released and the reservation is placed again, at most twice; the third failure
fails it. A spot reservation under a preemption notice is placed again only to its cut, keeping its
notice, or ends at once as preempted when nothing fits (docs/decisions.md, "Spot and preemption").
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import events
from controlplane.nodes import desired
from controlplane.placement import gang
from controlplane.reservations import binding_queries, placing, preemption, reports, schedule, states
from controlplane.reservations.lifecycle import WINDOW_ENDED, end_bookings, end_over, free_capacity
from controlplane.reservations.transitions import condition, move, move_emit, set_conditions
from controlplane.runtime import Runtime

MAX_BIND_FAILURES = 3


class NeedsPoolLock(Exception):
    """This pass must place again; run it with the pool lock taken first."""


async def start(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], now_ms: int, *, may_place: bool) -> None:
    """At the start: allocations move to binding and the nodes' desired state gains them."""
    deadline = row["during_start"] + schedule.BIND_TIMEOUT_MS
    if deadline <= now_ms:  # the worker itself ran late: the node still gets its full five minutes
        deadline = now_ms + schedule.BIND_TIMEOUT_MS
    await conn.execute(binding_queries.START_BINDING, {"id": row["id"], "deadline": deadline})
    await desired.bump_live_of(conn, row["id"])  # one statement for all its nodes
    await move_emit(conn, row, states.BINDING, operation_state="succeeded", event_type="reservation.binding",
                    wake=(deadline,))
    # A report that arrived while placed is judged now; with none, every allocation is binding
    # until a deadline still ahead: nothing more to do.
    await progress(conn, rt, row, now_ms, may_place=may_place, unchanged_unless_judged=True)


async def progress(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], now_ms: int, *, may_place: bool,
                   unchanged_unless_judged: bool = False) -> None:
    """Judge the nodes' reports; active once every allocation is bound; a verified
    AllocationFailed or the bind deadline passing is a binding failure."""
    judged = await reports.judge(conn, rt, row, now_ms)
    if judged.failures:
        if not may_place:
            raise NeedsPoolLock
        failed = judged.failures
        await bind_failed(conn, rt, row, now_ms, failed[0][1], [node for node, _ in failed])
        return
    if unchanged_unless_judged and not judged.count:
        return
    allocations = await (await conn.execute(binding_queries.LIVE_ALLOCATIONS, {"id": row["id"]})).fetchall()
    if allocations and all(a["state"] == "bound" for a in allocations):
        await move_emit(conn, row, states.ACTIVE, operation_state="succeeded", event_type="reservation.active",
                        wake=(now_ms + schedule.ACTIVE_RECHECK_MS,))
        await node_conditions(conn, row, now_ms)  # a change while binding woke it before it was active
        return
    late = [a for a in allocations if a["state"] == "binding" and a["bind_deadline_ms"] <= now_ms]
    if late:
        if not may_place:
            raise NeedsPoolLock
        await bind_failed(conn, rt, row, now_ms, "bind-timeout", [a["node_id"] for a in late])


async def bind_failed(
    conn: AsyncConnection, rt: Runtime, row: dict[str, Any], now_ms: int, reason: str, nodes: list[str]
) -> None:
    """Release the bookings and place again (same end, from now), at most twice; then fail."""
    failures = (await (await conn.execute(binding_queries.COUNT_BIND_FAILURE, {"id": row["id"]})).fetchone())["bind_failures"]
    if failures >= MAX_BIND_FAILURES:
        await free_capacity(conn, row)
        await move(conn, row, states.FAILED, operation_state="failed", end_reason=reason)
        await events.emit_reservation(conn, row, "reservation.failed", reason=reason, failures=failures)
        return
    window = (now_ms, row["during_end"])
    if gang.Gang.of(row["request"]) is not None:
        # A gang moves as a whole: every member ends, and only the members that failed count as
        # failed (their nodes are avoided from now on; the others may take the gang again). Their
        # bookings end at compute_now(), which now_ms may round down: the new window starts on the
        # next millisecond, so a member's node can take the gang again without overlapping itself.
        live = await (await conn.execute(binding_queries.LIVE_ALLOCATIONS, {"id": row["id"]})).fetchall()
        await end_bookings(conn, row["id"], allocation_state="released")
        await conn.execute(binding_queries.MARK_FAILED, {"ids": [a["id"] for a in live if a["node_id"] in nodes]})
        window = (now_ms + 1, row["during_end"])
    else:
        await end_bookings(conn, row["id"], allocation_state="failed")
    failed_before = await (await conn.execute(binding_queries.FAILED_NODES, {"id": row["id"]})).fetchall()
    avoid = frozenset(nodes) | {r["node_id"] for r in failed_before}  # never back to a node that failed
    replaced = await placing.place_again_any(conn, rt, row, window, avoid, now_ms)
    # A spot reservation under notice is placed again for what is left of it, to the cut, and
    # keeps its notice (ending preempted); with no room for that it ends now, preempted: pending,
    # it would be placed again later for its whole length, which its preemptor took.
    notice = preemption.notice_of(row)
    if not replaced.node_ids:
        if notice is not None:
            await end_over(conn, row, WINDOW_ENDED)
            return
        message = f"binding failed on {', '.join(nodes)} ({reason}); " + replaced.reason
        await placing.go_pending(conn, row, "BindingFailed", message, now_ms)
        return
    await move(conn, row, states.PLACED, operation_state="succeeded", conditions=[notice] if notice else [],
               window=window)
    await events.emit_reservation(conn, row, "reservation.placed", nodeIds=replaced.node_ids,
                                  start=window[0], end=window[1], reason=reason)
    await schedule.at(conn, row["id"], now_ms)  # binds again at once


async def recheck_active(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], now_ms: int) -> None:
    """Judge reports (a lost binding is a condition) and set or clear the conditions of its nodes
    (NodeUnreachable) and atoms (DeviceUnhealthy); never release: a failure reported for an
    active reservation is only recorded. Rechecked every 15 minutes: one pending recheck is
    enough, so a wake-up adds none when another is already due within that time."""
    await reports.judge(conn, rt, row, now_ms)
    await node_conditions(conn, row, now_ms)
    pending = {"id": row["id"], "within": schedule.ACTIVE_RECHECK_MS}
    if not await (await conn.execute(binding_queries.RECHECK_PENDING, pending)).fetchone():
        await schedule.at(conn, row["id"], now_ms + schedule.ACTIVE_RECHECK_MS)


async def node_conditions(conn: AsyncConnection, row: dict[str, Any], now_ms: int) -> None:
    """Set or clear NodeUnreachable and DeviceUnhealthy from the reservation's nodes and atoms (a
    booked atom quarantined, or gone from its node's inventory)."""
    facts = await (await conn.execute(binding_queries.NODE_CONDITION_FACTS, {"id": row["id"]})).fetchone()
    unreachable = facts["unreachable"]
    sick = sorted(facts["sick"], key=lambda s: (s["name"], s["device_uuid"]))
    kept = [c for c in row["conditions"] if c.get("type") not in ("NodeUnreachable", "DeviceUnhealthy")]
    if unreachable:
        kept.append(_same_or_new(row, "NodeUnreachable", f"unreachable: {', '.join(unreachable)}", now_ms))
    if sick:
        message = "unhealthy: " + ", ".join(f"{s['device_uuid']} on {s['name']}" + (" (gone)" if s["gone"] else "")
                                            for s in sick)
        kept.append(_same_or_new(row, "DeviceUnhealthy", message, now_ms))
    if kept != row["conditions"]:
        await set_conditions(conn, row, kept)


def _same_or_new(row: dict[str, Any], type_: str, message: str, now_ms: int) -> dict[str, Any]:
    """The condition as it stands when its message is unchanged (keeping its transition time)."""
    old = next((c for c in row["conditions"] if c.get("type") == type_), None)
    return old if old and old.get("message") == message else condition(type_, type_, message, now_ms)
