"""The first credentials: the root tenant, its root identity and a root token.

Everything else (tenants, pools, nodes, quotas, policies) is created through the admin API with
the root token; only this step writes rows directly.
"""

from __future__ import annotations

import secrets

import psycopg

from controlplane.ids import token_hash

ROOT_TENANT = "root"
ROOT_IDENTITY = "root"


def ensure_root(conninfo: str) -> str:
    """Create the root tenant and identity if absent and return a new root token secret."""
    secret = "bct_" + secrets.token_urlsafe(32)
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
        conn.execute(
            "INSERT INTO api_tokens (token_hash, identity_id) VALUES (%s, %s)",
            (token_hash(secret), ROOT_IDENTITY),
        )
    return secret
