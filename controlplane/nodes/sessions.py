"""A node's newest session: the gateway that holds it registers it (which tells the node's older
sessions, on any gateway, to re-check and end), unregisters it when it ends, and releases all of
its own on shutdown. `bc_node_session` also carries certificate revocations (controlplane.pki)."""

from __future__ import annotations

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db
from controlplane.nodes import queries
from controlplane.nodes.tenancy import RENEW_CHANNEL

# Sessions of a node re-check that they are still its newest, with a certificate not revoked.
SESSION_CHANNEL = "bc_node_session"


async def recheck(conn: AsyncConnection, node_id: str) -> None:
    """Wake the node's sessions, wherever they are, to re-check themselves (at commit)."""
    await conn.execute(queries.NOTIFY_SESSIONS, {"channel": SESSION_CHANNEL, "node_id": node_id})


async def hint_renewal(conn: AsyncConnection, node_id: str) -> None:
    """Tell the node's sessions, wherever they are, to send it a RenewHint (at commit)."""
    await conn.execute(queries.NOTIFY_SESSIONS, {"channel": RENEW_CHANNEL, "node_id": node_id})


async def open(pool: AsyncConnectionPool, node_id: str, session_id: str, gateway_id: str) -> None:
    """Register the node's newest session."""

    async def work(conn: AsyncConnection) -> None:
        await conn.execute(queries.OPEN_SESSION, {"session_id": session_id, "gateway": gateway_id, "node_id": node_id})
        await recheck(conn, node_id)

    await db.run_in_transaction(pool, work)


async def close(pool: AsyncConnectionPool, node_id: str, session_id: str) -> None:
    """Unregister the session, unless a newer one has taken its place."""
    await db.run_in_transaction(pool, lambda conn: conn.execute(
        queries.CLOSE_SESSION, {"node_id": node_id, "session_id": session_id}))


async def close_gateway(pool: AsyncConnectionPool, gateway_id: str) -> None:
    """Every session of one gateway, in one statement (its shutdown)."""
    await db.run_in_transaction(pool, lambda conn: conn.execute(
        queries.CLOSE_GATEWAY_SESSIONS, {"gateway": gateway_id}))


async def current(conn: AsyncConnection, node_id: str) -> str | None:
    """The node's newest session id (None without a node or a session)."""
    row = await (await conn.execute(queries.CURRENT_SESSION, {"node_id": node_id})).fetchone()
    return row["session_id"] if row else None
