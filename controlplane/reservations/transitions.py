"""State changes of a locked reservation row, checked against the state table in SQL, and the
transitions that own a second table's row with them (a confirmation expiring with its request)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import confirmations, errors, events
from controlplane.reservations import queries, states


def condition(type_: str, reason: str, message: str, now_ms: int, status: str = "True") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now_ms}


def _transition(row: dict[str, Any], target: str, operation_state: str,
                conditions: list[dict[str, Any]] | None, window: tuple[int, int] | None,
                lease_deadline: int | None, end_reason: str | None, attempt: bool) -> dict[str, Any]:
    """TRANSITION's parameters."""
    return {
        "id": row["id"],
        "state": target,
        "operation_state": operation_state,
        "conditions": Jsonb(conditions if conditions is not None else row["conditions"]),
        "start": window[0] if window else None,
        "end": window[1] if window else None,
        "lease_deadline": lease_deadline,
        "end_reason": end_reason,
        "attempt": 1 if attempt else 0,
        "from_states": states.sources_of(target),
    }


def _refused(row: dict[str, Any], target: str) -> errors.InvalidState:
    return errors.InvalidState(f"a {row['state']} reservation cannot become {target}", state=row["state"])


def _emitting(params: dict[str, Any], row: dict[str, Any], event_type: str, moments: Iterable[int],
              extra: dict[str, Any]) -> dict[str, Any]:
    """TRANSITION's parameters with the wake-ups and the event (queries._WAKE_EMIT; the event as
    events.emit_reservation writes it)."""
    data = {"state": params["state"], "poolId": row["pool_id"], **extra}
    return {**params, "moments": list(moments), "tenant_id": row["tenant_id"], "event_type": event_type,
            "subject": f"reservation/{row['id']}", "data": Jsonb(data)}


async def _moved(conn: AsyncConnection, sql: str, params: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """Run a transition statement; no row back: the state table forbids the move."""
    found = await (await conn.execute(sql, params)).fetchone()  # the row, not rowcount: also right in pipeline mode
    if found is None:
        raise _refused(row, params["state"])
    row["state"] = params["state"]
    return found


async def move(
    conn: AsyncConnection,
    row: dict[str, Any],
    target: str,
    *,
    operation_state: str,
    conditions: list[dict[str, Any]] | None = None,
    window: tuple[int, int] | None = None,
    lease_deadline: int | None = None,
    end_reason: str | None = None,
    attempt: bool = False,
) -> None:
    """Move `row` (locked by the caller) to `target`; refuses a move the state table forbids."""
    await _moved(conn, queries.TRANSITION, _transition(
        row, target, operation_state, conditions, window, lease_deadline, end_reason, attempt), row)


async def move_emit(
    conn: AsyncConnection,
    row: dict[str, Any],
    target: str,
    *,
    operation_state: str,
    event_type: str,
    wake: tuple[int, ...] = (),
    **extra: Any,
) -> None:
    """`move`, then events.emit_reservation(event_type, **extra) and schedule.at(*wake), in one
    statement (TRANSITION_EMIT): the reconciler's moves, one round trip each."""
    params = _transition(row, target, operation_state, None, None, None, None, False)
    await _moved(conn, queries.TRANSITION_EMIT, _emitting(params, row, event_type, wake, extra), row)


async def move_wake_emit(
    conn: AsyncConnection,
    row: dict[str, Any],
    target: str,
    *,
    operation_state: str,
    conditions: list[dict[str, Any]],
    window: tuple[int, int],
    lease_deadline: int | None,
    moments: list[int],
    event_type: str,
    **extra: Any,
) -> dict[str, Any]:
    """`move` with attempt=True, then schedule.at(moments) and events.emit_reservation(event_type,
    **extra), in one statement: what a placement does while it holds the pool lock. Returns the
    reservation as moved, with its allocations (as reads.load_view reads it)."""
    params = _transition(row, target, operation_state, conditions, window, lease_deadline, None, True)
    return await _moved(conn, queries.TRANSITION_WAKE_EMIT, _emitting(params, row, event_type, moments, extra), row)


async def set_conditions(conn: AsyncConnection, row: dict[str, Any], conditions: list[dict[str, Any]]) -> None:
    """Replace the conditions of `row` (locked by the caller) without a state change."""
    await conn.execute(queries.SET_CONDITIONS, {"id": row["id"], "conditions": Jsonb(conditions)})
    row["conditions"] = conditions


async def expire_confirmation(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """A request awaiting confirmation whose deadline passed: the confirmation expires and the
    reservation with it. Called by the reconciler at the deadline and by admission when a late
    retry finds it past; a no-op when nothing is due or it was decided meanwhile. The reservation's
    row is locked before its confirmation, as a release (which locks the row, then expires or
    withdraws the confirmation) and admission lock them: the other way round the two deadlocked."""
    locked = await (await conn.execute(queries.BY_ID_FOR_UPDATE, {"id": row["id"]})).fetchone()
    if locked is None or locked["state"] != states.AWAITING_CONFIRMATION:
        return
    due = await confirmations.lock_due(conn, row["id"])
    if due is None:
        return
    await confirmations.expire(conn, due)
    await move(conn, locked, states.EXPIRED, operation_state="failed", end_reason="confirmation-expired")
    await events.emit_reservation(conn, locked, "reservation.expired", reason="confirmation-expired")
