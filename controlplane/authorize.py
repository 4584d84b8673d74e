"""Asking IAM about an existing resource: the one place that does.

IAM is never called inside a database transaction (DESIGN section 8): the policy is read in a
transaction of its own (or staged by the caller's transaction, which has ended), and the decision
is taken with no transaction open in this task. `decide` checks that, so a caller that forgets
fails loudly instead of holding a transaction open across the decision.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db, errors, iam
from controlplane.auth import Caller

_POLICY = "SELECT cedar FROM policies WHERE tenant_id = %(tenant_id)s"

# Told, with the tenant's id, when what its members may read can have narrowed under an open
# Watch stream (its policy replaced, a member removed): the event hub has its watchers decide
# again before their next event (controlplane.watch).
ACCESS_CHANNEL = "bc_access_changed"


async def access_changed(conn: AsyncConnection, tenant_id: str) -> None:
    """Tell the event hubs, once the caller's transaction commits (NOTIFY is transactional)."""
    await conn.execute("SELECT pg_notify(%s, %s)", (ACCESS_CHANNEL, tenant_id))


async def read_policy(conn: AsyncConnection, tenant_id: str) -> str | None:
    """The tenant's policy, read in the caller's transaction (to stage a later decision)."""
    row = await (await conn.execute(_POLICY, {"tenant_id": tenant_id})).fetchone()
    return row["cedar"] if row else None


async def fetch_policy(pool: AsyncConnectionPool, tenant_id: str) -> str | None:
    """The tenant's policy, read in a read-only transaction that is closed on return."""
    async with db.read_only(pool) as conn:
        return await read_policy(conn, tenant_id)


def decide(policy: str | None, caller: Caller, action: str, resource_type: str, resource_id: str,
           attributes: dict[str, Any], *, tenant_id: str, approved: bool = False) -> iam.Decision:
    """IAM's decision, taken with no transaction open in this task."""
    db.require_no_transaction("IAM decision")
    return iam.decide(policy, caller, action, resource_type, resource_id, attributes, tenant_id=tenant_id,
                      approved=approved)


def allowed_each(policy: str | None, caller: Caller, action: str, resource_type: str,
                 resources: list[tuple[str, dict[str, Any]]], *, tenant_id: str) -> list[bool]:
    """Whether IAM allows `action` on each of `resources` ((id, attributes) pairs): one batch, taken
    with no transaction open in this task."""
    db.require_no_transaction("IAM decision")
    return iam.allowed_each(policy, caller, action, resource_type, resources, tenant_id=tenant_id)


def check(policy: str | None, caller: Caller, tenant_id: str, action: str, resource_type: str,
          resource_id: str, attributes: dict[str, Any], *, message: str = "IAM refused this call",
          **details: Any) -> None:
    """ACCESS_DENIED (with `details`) unless `policy` allows `action` on the resource. These calls
    open no confirmation (docs/decisions.md "Delegated confirmation"): an agent's call its person
    holds for confirmation is refused saying so (reason `confirmation-unsupported`, the action)."""
    decision = decide(policy, caller, action, resource_type, resource_id, attributes, tenant_id=tenant_id)
    if decision.outcome == iam.CONFIRM:
        raise errors.AccessDenied(f"{message}: {action} is held for the person's confirmation, which this call "
                                  "cannot ask for", **details, reason="confirmation-unsupported", action=action)
    if not decision.allowed:
        raise errors.AccessDenied(message, **details)


async def require(
    pool: AsyncConnectionPool, caller: Caller, tenant_id: str, action: str, resource_type: str,
    resource_id: str, attributes: dict[str, Any], *, message: str = "IAM refused this call", **details: Any,
) -> None:
    """Read the tenant's policy (its own short transaction), then decide outside any transaction."""
    policy = await fetch_policy(pool, tenant_id)
    check(policy, caller, tenant_id, action, resource_type, resource_id, attributes, message=message, **details)
