"""Release, cancel, renew and extend of an existing reservation."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import confirmations, db, errors, events, iam, quota
from controlplane.auth import Caller
from controlplane.common.locks import pool_lock
from controlplane.metal import is_node_lease
from controlplane.metal import queries as metal_queries
from controlplane.nodes import desired
from controlplane.reservations import preemption, queries, schedule, states
from controlplane.reservations.reads import authorize_on, find_visible, with_allocations
from controlplane.reservations.transitions import expire_confirmation, move
from controlplane.runtime import Runtime

CANCELLABLE = frozenset({states.PENDING, states.QUEUED, states.PLACED})


async def _authorized_row(rt: Runtime, caller: Caller, tenant_id: str, rid: str, action: str) -> None:
    """Read (transaction closed), then decide with no transaction open. The write transaction
    that follows re-reads the row under its lock and checks the state again."""
    async with db.read_only(rt.pool) as conn:
        row = await find_visible(conn, caller, tenant_id, rid)
    await authorize_on(rt, caller, action, row)


async def _locked(conn: AsyncConnection, rid: str) -> dict[str, Any]:
    row = await (await conn.execute(queries.BY_ID_FOR_UPDATE, {"id": rid})).fetchone()
    assert row is not None  # reservations are never deleted while their tenant exists
    return row


async def end_bookings(conn: AsyncConnection, rid: str, *, allocation_state: str = "released",
                       at_ms: int | None = None) -> None:
    """End the live allocations now (or at `at_ms`, a moment that passed): future bookings
    deleted, running ones truncated, and the nodes' desired state drops them."""
    params = {"id": rid, "at": at_ms}
    await conn.execute(queries.DELETE_FUTURE_BOOKINGS, params)
    await conn.execute(queries.TRUNCATE_RUNNING_BOOKINGS, params)
    await desired.bump_live_of(conn, rid)
    await conn.execute(queries.END_ALLOCATIONS, {**params, "state": allocation_state})


LEASE_LAPSED, WINDOW_ENDED = "lease-lapsed", "window-ended"


def over_at(row: dict[str, Any], now_ms: int) -> str | None:
    """Why a booked reservation is over at `now_ms` (its lease lapsed, or its window ended), or
    None while it lives: what the reconciler ends it for, and what extend and renew refuse. When
    both moments passed, the one that came first (a clock jump or a backlog reaches both at once)."""
    lease, end = row["lease_deadline_ms"], row["during_end"]
    if lease is not None and now_ms >= lease and (end is None or lease <= end):
        return LEASE_LAPSED
    if end is not None and now_ms >= end:
        return WINDOW_ENDED
    return None


async def ended_reason(conn: AsyncConnection, row: dict[str, Any]) -> str | None:
    """`over_at` the clock once the row's lock is held (`db.fresh_now_ms`): over though the
    reconciler has not released it yet. Nothing brings it back. Not compute_now(), the
    transaction's start: a call that queued for the row while its moment passed would judge it by
    the clock from before the wait (a lapsed lease renewed, an ended window extended), and the
    reconciler's own pass, queued behind it, would then find nothing due."""
    return over_at(row, await db.fresh_now_ms(conn))


async def free_capacity(conn: AsyncConnection, row: dict[str, Any], *, allocation_state: str = "released",
                        at_ms: int | None = None) -> None:
    """End the bookings and the window now (or at `at_ms`), refund the quota, and wake the pool's pending
    reservations (and metal's worker for a node lease's deploy under way: it ends now, and a
    machine that never ran it comes back now, not at the deploy's deadline).

    The refund comes first: it takes the tenant's usage rows, which a create charges before it
    books, so ending the bookings first could hold the row locks such a create waits on while
    waiting for its usage rows (a deadlock)."""
    await quota.refund(conn, row["id"])
    await end_bookings(conn, row["id"], allocation_state=allocation_state, at_ms=at_ms)
    await preemption.give_back(conn, row)  # its victims keep what it no longer needs
    if is_node_lease(row["request"]):
        await conn.execute(metal_queries.WAKE_LIVE_OF, {"id": row["id"]})
    await conn.execute(queries.TRUNCATE_WINDOW, {"id": row["id"], "at": at_ms})
    await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": row["pool_id"]})


async def end_over(conn: AsyncConnection, row: dict[str, Any], over: str) -> None:
    """Release a reservation whose moment passed (`over_at`), as that moment: its lease lapsed
    (ending at the deadline however late this runs: billing runs until the release, and the lapse
    is the release), or its window ended (expired, or preempted at a notice's end). The
    reconciler's end, and a release that finds the moment passed before the reconciler did.
    Bookings end, quota refunds, the nodes' desired state drops the assignment."""
    reason = over if over == LEASE_LAPSED else "preempted" if preemption.notice_of(row) else "expired"
    await free_capacity(conn, row, at_ms=row["lease_deadline_ms"] if over == LEASE_LAPSED else None)
    await move(conn, row, states.RELEASED, operation_state=row["operation_state"], end_reason=reason)
    await events.emit_reservation(conn, row, "reservation.released", reason=reason)
    notice = preemption.notice_of(row) if reason == "preempted" else None
    if notice is not None:
        await events.emit_reservation(conn, row, "reservation.preempted", by=notice.get("by"),
                                      noticeUntil=notice.get("noticeUntil"))


async def end_pending_victim(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """A pending victim (BookingRepair found it no room during its notice), read without a lock,
    whose notice's end came (`preemption.notice_over`): nothing of its window is left, so it ends
    as a booked victim does at the cut, released with reason `preempted` and its quota refunded.
    The pool lock first (its end takes its notices), then the row; the reconciler at the cut and
    the pending retry end it."""
    await pool_lock(conn, row["pool_id"])
    locked = await _locked(conn, row["id"])
    if locked["state"] == states.PENDING and preemption.notice_over(locked, await db.fresh_now_ms(conn)):
        await end_over(conn, locked, WINDOW_ENDED)


async def _cancel_locked(conn: AsyncConnection, row: dict[str, Any], reason: str) -> None:
    # An open confirmation dies with the request, so nobody approves a withdrawn reservation.
    await confirmations.withdraw(conn, row["id"])
    await free_capacity(conn, row)
    await move(conn, row, states.CANCELLED, operation_state="failed" if row["operation_state"] == "running"
               else row["operation_state"], end_reason=reason)
    await events.emit_reservation(conn, row, "reservation.cancelled", reason=reason)


async def release(rt: Runtime, caller: Caller, tenant_id: str, rid: str) -> dict[str, Any]:
    """End at compute_now(). Releasing a pending one cancels it; a terminal one is unchanged."""
    await _authorized_row(rt, caller, tenant_id, rid, iam.RELEASE)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await preemption.lock_pool_if_noticed(conn, rid)  # lock order: pool first
        row = await _locked(conn, rid)
        over = await ended_reason(conn, row) if row["state"] in states.BOOKED else None
        if over is not None:  # its end or lapse came first: released as that moment
            await end_over(conn, row, over)
        elif row["state"] in states.BOOKED:
            await free_capacity(conn, row)
            await move(conn, row, states.RELEASED, operation_state=row["operation_state"], end_reason="release")
            await events.emit_reservation(conn, row, "reservation.released", reason="release")
        elif row["state"] in (states.PENDING, states.QUEUED, states.AWAITING_CONFIRMATION):
            if row["state"] == states.AWAITING_CONFIRMATION:  # its deadline passed: expired, as the reconciler does
                await expire_confirmation(conn, row)
                row = await _locked(conn, rid)
            if row["state"] != states.EXPIRED:
                await _cancel_locked(conn, row, "release")
        return await with_allocations(conn, await _locked(conn, rid))

    return await db.run_in_transaction(rt.pool, work)


async def cancel(rt: Runtime, caller: Caller, tenant_id: str, rid: str) -> dict[str, Any]:
    """Withdraw a reservation that has not started: pending or placed. Else INVALID_STATE, and
    so is a placed one whose start has passed by compute_now() though the reconciler has not
    moved it to binding yet (it has started: release ends it)."""
    await _authorized_row(rt, caller, tenant_id, rid, iam.RELEASE)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await preemption.lock_pool_if_noticed(conn, rid)  # lock order: pool first
        row = await _locked(conn, rid)
        if row["state"] not in CANCELLABLE:
            raise errors.InvalidState(
                f"only a pending or placed reservation can be cancelled; this one is {row['state']}",
                state=row["state"], reservationId=rid,
            )
        if row["state"] == states.PLACED:  # placed in the row, but its start (or lapse) came by time
            now_ms = await db.fresh_now_ms(conn)  # the clock once the row is ours (ended_reason)
            why = over_at(row, now_ms) or ("started" if now_ms >= row["during_start"] else None)
            if why is not None:
                raise errors.InvalidState(f"this reservation cannot be cancelled any more ({why}); release it",
                                          state=row["state"], reservationId=rid, reason=why,
                                          start=row["during_start"])
        await _cancel_locked(conn, row, "cancel")
        return await with_allocations(conn, await _locked(conn, rid))

    return await db.run_in_transaction(rt.pool, work)


async def renew(rt: Runtime, caller: Caller, tenant_id: str, rid: str) -> dict[str, Any]:
    """Move the lease deadline to now plus leaseSeconds, without touching the window."""
    await _authorized_row(rt, caller, tenant_id, rid, iam.EXTEND)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        row = await _locked(conn, rid)
        if row["request"].get("leaseSeconds") is None:
            raise errors.InvalidState("this reservation was created without leaseSeconds",
                                      reservationId=rid, state=row["state"])
        if row["state"] not in states.BOOKED:
            raise errors.InvalidState(f"a {row['state']} reservation cannot be renewed",
                                      reservationId=rid, state=row["state"])
        ended = await ended_reason(conn, row)  # a late renew does not revive it
        if ended == LEASE_LAPSED:
            raise errors.InvalidState("the lease lapsed; the reservation is being released",
                                      reservationId=rid, state=row["state"], reason="lease-lapsed",
                                      leaseDeadline=row["lease_deadline_ms"])
        if ended == WINDOW_ENDED:
            raise errors.InvalidState("this reservation has ended; it is being released",
                                      reservationId=rid, state=row["state"], reason=WINDOW_ENDED,
                                      end=row["during_end"])
        await conn.execute(queries.RENEW, {"id": rid})
        renewed = await _locked(conn, rid)
        await schedule.at(conn, rid, renewed["lease_deadline_ms"])  # the reconciler checks the new deadline
        return await with_allocations(conn, renewed)

    return await db.run_in_transaction(rt.pool, work)
