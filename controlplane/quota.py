"""Quota: per tenant and resource; a missing row grants 0; charges are rows per reservation.

This module owns the quotas and quota_charges tables and their SQL. Used is always the sum of live (unrefunded) charges, never a counter that can drift. A charge
locks the tenant's quota rows (in resource order) so concurrent charges are decided one at a time.
"""

from __future__ import annotations

from psycopg import AsyncConnection

from controlplane import errors

_SET_LIMIT = """
INSERT INTO quotas (tenant_id, resource, "limit") VALUES (%(tenant_id)s, %(resource)s, %(limit)s)
ON CONFLICT (tenant_id, resource) DO UPDATE SET "limit" = EXCLUDED."limit"
"""
# Lock the limit row, sum the live charges, charge if it fits: one call (migration 0016).
_CHARGE = """
SELECT quota_limit, used, charged
FROM charge_quota(%(tenant_id)s, %(resource)s, %(reservation_id)s, %(amount)s)
"""
_REFUND = """
UPDATE quota_charges SET refunded_at = compute_now()
WHERE reservation_id = %(reservation_id)s AND refunded_at IS NULL
"""
_USAGE = """
SELECT r.resource, coalesce(q."limit", 0) AS "limit", coalesce(sum(c.amount), 0)::bigint AS used
FROM (SELECT resource FROM quotas WHERE tenant_id = %(t)s
      UNION SELECT resource FROM quota_charges WHERE tenant_id = %(t)s AND refunded_at IS NULL) r
LEFT JOIN quotas q ON q.tenant_id = %(t)s AND q.resource = r.resource
LEFT JOIN quota_charges c ON c.tenant_id = %(t)s AND c.resource = r.resource AND c.refunded_at IS NULL
GROUP BY r.resource, q."limit" ORDER BY r.resource
"""


async def charge(
    conn: AsyncConnection, tenant_id: str, reservation_id: str, amounts: dict[str, int]
) -> None:
    """Charge every amount or none (QUOTA_EXCEEDED names the first resource that cannot take it)."""
    for resource in sorted(amounts):
        amount = amounts[resource]
        if amount <= 0:
            continue
        row = await (await conn.execute(_CHARGE, {
            "tenant_id": tenant_id, "resource": resource, "reservation_id": reservation_id, "amount": amount,
        })).fetchone()
        if not row["charged"]:
            limit, used = int(row["quota_limit"]), int(row["used"])
            raise errors.QuotaExceeded(
                f"quota for {resource} is {limit}, {used} in use, {amount} requested",
                resource=resource,
                limit=limit,
                used=used,
                requested=amount,
            )


async def refund(conn: AsyncConnection, reservation_id: str) -> None:
    await conn.execute(_REFUND, {"reservation_id": reservation_id})


async def set_limit(conn: AsyncConnection, tenant_id: str, resource: str, limit: int) -> None:
    """The tenant's limit for `resource` (an unknown tenant violates quotas_tenant_id_fkey)."""
    await conn.execute(_SET_LIMIT, {"tenant_id": tenant_id, "resource": resource, "limit": limit})


async def usage(conn: AsyncConnection, tenant_id: str) -> list[dict]:
    return await (await conn.execute(_USAGE, {"t": tenant_id})).fetchall()
