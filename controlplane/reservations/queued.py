"""Queued reservations: the pool-lease placer's side of the reservation lifecycle (DESIGN.md
sections 8 and 9).

Admission of a lease-policy pool's create charges quota and queues it (queued, operation
running, `reservation.queued`, the lease holder woken: one statement, admit_queued) instead of
placing. The holder's lease
worker (controlplane.placement.lease) calls `drain` for the pools it holds: one transaction per
batch of at most BC_PLACER_BATCH reservations, in arrival order:

1. the pool lock, the fencing check, the clock read under the lock (migration 0045) and the
   batch's rows, locked (SKIP LOCKED): one statement;
2. the plans, in memory, and every allocation and booking in one statement
   (controlplane.placement.batch; a lost race costs that member a re-plan);
3. for the members nothing fits: the SQL shortlist and the reason (placer.explain);
4. every member moved to placed or pending, with wake-ups, events and notifications: one
   statement, fenced again, which answers each member's view as `fetch_view` reads it.

After the commit, the creates of this process waiting for those members are handed their views
(`Waiters.handing`) and answer without a read; waiters elsewhere are woken by `bc_placed` and read.

Gangs and repairs never come here: they place inline (BookingRepair, the binding failure path).
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane.common.locks import pool_lock_key
from controlplane.placement import batch as batches
from controlplane.placement import placer
from controlplane.placement.lease import Waiters
from controlplane.reservations import placing, preemption, queued_queries, schedule, states
from controlplane.reservations.transitions import condition
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

LEASE = "lease"


class Fenced(Exception):
    """The holder's lease was taken over during the batch: nothing of it may commit."""


def uses_lease(pool: dict[str, Any], request: dict[str, Any]) -> bool:
    """Whether a create in this pool is queued for the pool's lease holder: a lease-policy pool,
    and not a gang or a whole-machine lease (those always place inline)."""
    return ((pool.get("policy") or {}).get("placer") == LEASE and not request.get("gang")
            and request.get("binding") != "node")


async def drain(rt: Runtime, pool_id: str, holder: str, epoch: int) -> int:
    """Place one batch of the pool's queued reservations; how many it took (0: none queued, or the
    lease is no longer this holder's)."""
    started = time.perf_counter()
    batch = batches.Batch(pool_id, [])
    waiters = rt.leases.waiters if rt.leases is not None else Waiters()
    with waiters.handing() as hand_off:
        async with rt.pool.connection() as raw:
            conn = batches.Counted(raw)
            try:
                async with raw.transaction():
                    taken, placed, views = await _batch(conn, rt, batch, holder, epoch)
                    hand_off.claim(views)  # before the commit, which tells every process (bc_placed)
            except Fenced as exc:
                log.warning("placer batch fenced off; rolled back", pool_id=pool_id, epoch=epoch, error=str(exc))
                await _forget(rt, raw, batch)
                return 0
            except Exception:
                await _forget(rt, raw, batch)
                raise
            else:
                hand_off.hand()  # committed: this process's waiters answer with these, without a read
    if taken:
        statements = conn.statements + 2  # BEGIN and COMMIT
        rt.metrics.placer_batch(statements, placed, taken - placed)
        for outcome in [True] * placed + [False] * (taken - placed):
            rt.metrics.placement(started, outcome)
        log.info("placer batch", pool_id=pool_id, epoch=epoch, reservations=taken, placed=placed,
                 pending=taken - placed, lost_races=batch.lost_races, statements=statements,
                 statements_per_reservation=round(statements / taken, 2),
                 ms=round((time.perf_counter() - started) * 1000, 1))
    return taken


async def _forget(rt: Runtime, conn: AsyncConnection, batch: batches.Batch) -> None:
    """After a rollback, the index forgets what the batch marked (best effort: failing that, the
    next change to those nodes re-reads them)."""
    try:
        await batches.forget(rt.capacity, conn, batch)
    except Exception:  # noqa: BLE001
        log.warning("capacity index not refreshed after a failed batch", pool_id=batch.pool_id)


async def _batch(conn: Any, rt: Runtime, batch: batches.Batch, holder: str,
                 epoch: int) -> tuple[int, int, dict[str, dict[str, Any]]]:
    """How many it took, how many it placed, and every member's view as moved (by id)."""
    pool_id = batch.pool_id
    fence = {"pool_id": pool_id, "holder": holder, "epoch": epoch}
    rows = await (await conn.execute(queued_queries.QUEUED_BATCH, {
        **fence, "lock_key": pool_lock_key(pool_id), "limit": rt.settings.placer_batch,
    })).fetchall()
    if not rows:
        return 0, 0, {}
    now_ms = rows[0]["now_ms"]
    batch.members = [batches.Member(r["id"], placing.ask_for(r, now_ms)) for r in rows]
    await batches.place(conn, batch, rt.settings, rt.capacity)

    moves: dict[str, list[Any]] = {k: [] for k in (
        "ids", "states", "conditions", "starts", "ends", "leases", "types", "data", "wake_ids", "wake_at")}
    placed = 0
    pending: list[dict[str, Any]] = []
    for row, member in zip(rows, batch.members):
        ask, placement = member.ask, member.placement
        moves["ids"].append(row["id"])
        if placement is not None:
            placed += 1
            lease_deadline = placing.lease_deadline_of(row, now_ms)
            data = placing.placed_data(pool_id, [placement.node_id], ask)
            _append(moves, states.PLACED, [], ask.start_ms, ask.end_ms, lease_deadline, "reservation.placed", data)
            # The lease deadline's wake-up is MOVE_BATCH's, which counts the lease from its clock.
            for moment in schedule.booked_moment_list(ask.start_ms, ask.end_ms, None, now_ms):
                moves["wake_ids"].append(row["id"])
                moves["wake_at"].append(moment)
        else:
            pending.append(row)
            reason = await placer.explain(conn, ask)
            data = {"state": states.PENDING, "poolId": pool_id, "reason": reason}
            _append(moves, states.PENDING, [condition("Unschedulable", "NoFit", reason, now_ms)],
                    None, None, None, "reservation.pending", data)
    await preemption.fall_back_inline(conn, pool_id, pending)
    moved = await (await conn.execute(queued_queries.MOVE_BATCH, {
        **fence, **{k: v for k, v in moves.items()},
    })).fetchall()
    if len(moved) != len(rows):
        raise Fenced(f"the lease of pool {pool_id} at epoch {epoch} is no longer {holder}'s")
    return len(rows), placed, {view["id"]: _view(view) for view in moved}


def _view(row: dict[str, Any]) -> dict[str, Any]:
    """A row of MOVE_BATCH without the statement's counts: what fetch_view reads."""
    for count in queued_queries.MOVE_BATCH_COUNTS:
        del row[count]
    return row


def _append(moves: dict[str, list[Any]], state: str, conditions: list[dict[str, Any]], start: int | None,
            end: int | None, lease_deadline: int | None, event_type: str, data: dict[str, Any]) -> None:
    moves["states"].append(state)
    moves["conditions"].append(Jsonb(conditions))
    moves["starts"].append(start)
    moves["ends"].append(end)
    moves["leases"].append(lease_deadline)
    moves["types"].append(event_type)
    moves["data"].append(Jsonb(data))
