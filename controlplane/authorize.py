"""Asking IAM about an existing resource: read the tenant's policy, decide, refuse.

The decision itself (controlplane.iam) is pure; this reads the policy in the caller's
transaction (a read-only one: IAM is never asked while the caller holds a write lock).
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import errors, iam
from controlplane.auth import Caller

_POLICY = "SELECT cedar FROM policies WHERE tenant_id = %(tenant_id)s"


async def read_policy(conn: AsyncConnection, tenant_id: str) -> str | None:
    row = await (await conn.execute(_POLICY, {"tenant_id": tenant_id})).fetchone()
    return row["cedar"] if row else None


async def require(
    conn: AsyncConnection, caller: Caller, tenant_id: str, action: str, resource_type: str, resource_id: str,
    attributes: dict[str, Any], *, message: str = "IAM refused this call", **details: Any,
) -> None:
    """ACCESS_DENIED (with `details`) unless the tenant's policy allows `action` on the resource."""
    decision = iam.decide(await read_policy(conn, tenant_id), caller, action, resource_type, resource_id,
                          attributes, tenant_id=tenant_id)
    if not decision.allowed:
        raise errors.AccessDenied(message, **details)
