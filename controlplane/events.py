"""The event outbox: events are rows written in the same transaction as the change.

Ids come from a sequence (next_event_id(), migration 0050), and Watch and webhooks give a
subject's events in id order. That is the order they happened only because every writer of a
subject's events holds the subject's row lock (the reservation, the grant, the provider
reservation FOR UPDATE, or the UPDATE that changes it) from before it takes the event's id until
it commits: a writer that took its id first and waited for the lock after would commit an event
of a later state under a smaller id. Lock the subject, then emit (tests/test_event_order.py)."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

# The row and its notification in one statement (delivered at commit, as ever).
_INSERT_NOTIFY = """
WITH e AS (
    INSERT INTO events (tenant_id, type, subject, data)
    VALUES (%(tenant_id)s, %(type)s, %(subject)s, %(data)s)
    RETURNING tenant_id
)
SELECT pg_notify('bc_events', e.tenant_id) FROM e
"""


async def emit(conn: AsyncConnection, tenant_id: str, type_: str, subject: str, data: dict[str, Any]) -> None:
    await conn.execute(
        _INSERT_NOTIFY, {"tenant_id": tenant_id, "type": type_, "subject": subject, "data": Jsonb(data)}
    )


async def emit_reservation(
    conn: AsyncConnection, row: dict[str, Any], type_: str, **extra: Any
) -> None:
    """A reservation lifecycle event: subject reservation/<id>, state and poolId in data."""
    data = {"state": row["state"], "poolId": row["pool_id"], **extra}
    await emit(conn, row["tenant_id"], type_, f"reservation/{row['id']}", data)
