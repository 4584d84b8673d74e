"""The first credentials: the root tenant, its root identity and a root token.

Everything else (tenants, pools, nodes, quotas, policies) is created through the admin API with
the root token; only this step writes rows directly.
"""

from __future__ import annotations

import psycopg

from controlplane import tokens
from controlplane.config import Settings

ROOT_TENANT = "root"
ROOT_IDENTITY = "root"


def ensure_root(conninfo: str, ttl_seconds: int | None = None) -> str:
    """Create the root tenant and identity if absent and return a new root token secret (it
    expires after `ttl_seconds`, by default the configured token lifetime)."""
    ttl = Settings().token_ttl_seconds if ttl_seconds is None else ttl_seconds
    with psycopg.connect(conninfo) as conn:
        conn.execute(
            "INSERT INTO tenants (id, name) VALUES (%s, 'Platform root') ON CONFLICT DO NOTHING",
            (ROOT_TENANT,),
        )
        conn.execute(
            "INSERT INTO identities (id, kind, name) VALUES (%s, 'user', 'Platform root')"
            " ON CONFLICT DO NOTHING",
            (ROOT_IDENTITY,),
        )
        conn.execute(
            "INSERT INTO memberships (tenant_id, identity_id) VALUES (%s, %s)"
            " ON CONFLICT DO NOTHING",
            (ROOT_TENANT, ROOT_IDENTITY),
        )
        return tokens.mint_sync(conn, ROOT_IDENTITY, ttl * 1000)
