"""The first credentials: the root tenant, its root identity and a root token.

Everything else (tenants, pools, nodes, quotas, policies) is created through the admin API with
the root token; this step uses the operator's own statements (admin_queries) directly.
"""

from __future__ import annotations

import psycopg

from controlplane import admin_queries as q
from controlplane import tokens
from controlplane.config import Settings

ROOT_TENANT = "root"
ROOT_IDENTITY = "root"


def ensure_root(conninfo: str, ttl_seconds: int | None = None) -> str:
    """Create the root tenant and identity if absent and return a new root token secret (it
    expires after `ttl_seconds`, by default the configured token lifetime)."""
    ttl = Settings().token_ttl_seconds if ttl_seconds is None else ttl_seconds
    with psycopg.connect(conninfo) as conn:
        conn.execute(q.INSERT_TENANT, {"id": ROOT_TENANT, "name": "Platform root"})
        conn.execute(q.INSERT_IDENTITY, {"id": ROOT_IDENTITY, "kind": "user", "name": "Platform root",
                                         "delegator_id": None, "confirm_actions": []})
        conn.execute(q.INSERT_MEMBERSHIP, {"tenant_id": ROOT_TENANT, "identity_id": ROOT_IDENTITY})
        return tokens.mint_sync(conn, ROOT_IDENTITY, ttl * 1000)
