"""State changes of a locked reservation row, checked against the state table in SQL."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import errors
from controlplane.reservations import queries, states


def condition(type_: str, reason: str, message: str, now_ms: int, status: str = "True") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now_ms}


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
    cur = await conn.execute(
        queries.TRANSITION,
        {
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
        },
    )
    if cur.rowcount != 1:
        raise errors.InvalidState(
            f"a {row['state']} reservation cannot become {target}", state=row["state"]
        )
    row["state"] = target


async def set_conditions(conn: AsyncConnection, row: dict[str, Any], conditions: list[dict[str, Any]]) -> None:
    """Replace the conditions of `row` (locked by the caller) without a state change."""
    await conn.execute(
        "UPDATE reservations SET conditions = %s, version = version + 1, updated_at = clock_timestamp()"
        " WHERE id = %s", (Jsonb(conditions), row["id"]))
    row["conditions"] = conditions
