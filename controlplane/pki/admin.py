"""The NodeAdmin domain: join tokens, revocation, certificate listing, the CA certificate.

Callers must be members of the root tenant (checked by the servicer)."""

from __future__ import annotations

import re
import secrets
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db, db_errors, errors
from controlplane.common.names import NODE_ID, NODE_NAME, POOL_ID, match
from controlplane.ids import token_hash
from controlplane.nodes import registry, sessions
from controlplane.pki import NODE, NODE_ROLES, certs, store
from controlplane.pki.config import PkiSettings

DEFAULT_TTL_SECONDS = 3600
MAX_TTL_SECONDS = 7 * 24 * 3600
SERIAL = re.compile(r"^[0-9a-f]{1,40}$")


async def create_join_token(pool: AsyncConnectionPool, pool_id: str, node_name: str, role: str,
                            ttl_seconds: int) -> dict[str, Any]:
    match("poolId", pool_id, POOL_ID)
    match("nodeName", node_name, NODE_NAME)
    role = role or NODE
    if role not in NODE_ROLES:
        raise errors.InvalidInput("role", f"must be one of {sorted(NODE_ROLES)}")
    ttl = ttl_seconds or DEFAULT_TTL_SECONDS
    if not 1 <= ttl <= MAX_TTL_SECONDS:
        raise errors.InvalidInput("ttlSeconds", f"must be between 1 and {MAX_TTL_SECONDS}")
    secret = "bcj_" + secrets.token_urlsafe(32)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        row = await store.insert_join_token(conn, token_hash(secret), pool_id, node_name, role, ttl)
        return {"secret": secret, **row}

    with db_errors.mapped(poolId=pool_id):  # join_tokens_pool_id_fkey
        return await db.run_in_transaction(pool, work)


async def _require_node(conn: AsyncConnection, node_id: str) -> None:
    if not await registry.exists(conn, node_id):
        raise errors.NotFound("no such node", nodeId=node_id)


async def revoke_certificates(pool: AsyncConnectionPool, node_id: str, serial: str, reason: str) -> list[str]:
    """Revoke one certificate or all of a node's; already revoked ones are left as they are. By
    node id the node itself is revoked too: it enrols again only after `readmit_node`, with a join
    token issued after the revocation (its name's unspent ones are void). A node's signing
    certificate revoked by serial makes the node's sessions hint it to renew."""
    if bool(node_id) == bool(serial):
        raise errors.InvalidInput("target", "name exactly one of nodeId or serial")
    if node_id:
        match("nodeId", node_id, NODE_ID)
    else:
        serial = match("serial", serial.lower(), SERIAL)
    if len(reason) > 256:
        raise errors.InvalidInput("reason", "at most 256 characters")

    async def work(conn: AsyncConnection) -> list[str]:
        cert = None
        if node_id:
            await _require_node(conn, node_id)
            # The tokens first, as an enrolment locks them (its token, then the node's row).
            node = await registry.node(conn, node_id)
            await store.void_join_tokens(conn, node["pool_id"], node["name"])
            await registry.mark_revoked(conn, node_id, reason)
        elif (cert := await store.certificate_by_serial(conn, serial)) is None:
            raise errors.NotFound("no such certificate", serial=serial)
        revoked = await store.revoke(conn, node_id=node_id, serial=serial, reason=reason)
        if revoked and cert is not None and cert["usage"] == certs.SIGNING:
            # Its TLS certificate still serves, and the node would sign with the revoked key (every
            # report rejected) until its next renewal: it renews now, with new keys.
            await sessions.hint_renewal(conn, cert["node_id"])
        return revoked

    return await db.run_in_transaction(pool, work)


async def readmit_node(pool: AsyncConnectionPool, node_id: str) -> bool:
    """Let a revoked node enrol again (with a join token); False when it was not revoked."""
    match("nodeId", node_id, NODE_ID)

    async def work(conn: AsyncConnection) -> bool:
        await _require_node(conn, node_id)
        return await registry.readmit(conn, node_id)

    return await db.run_in_transaction(pool, work)


async def list_node_certificates(pool: AsyncConnectionPool, node_id: str) -> list[dict[str, Any]]:
    match("nodeId", node_id, NODE_ID)
    async with db.read_only(pool) as conn:
        await _require_node(conn, node_id)
        return await store.node_certificates(conn, node_id)


async def export_ca(pool: AsyncConnectionPool, settings: PkiSettings) -> store.Ca:
    """The CA (created now if no process has needed it yet)."""
    return await db.run_in_transaction(pool, lambda conn: store.load_ca(conn, settings.ca_passphrase,
                                                                        settings.ca_years))
