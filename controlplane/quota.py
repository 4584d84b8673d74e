"""Quota: per tenant and resource; a missing row grants 0; charges are rows per reservation.

Used is always the sum of live (unrefunded) charges, never a counter that can drift. A charge
locks the tenant's quota rows (in resource order) so concurrent charges are decided one at a time.
"""

from __future__ import annotations

from psycopg import AsyncConnection

from controlplane import errors

_LOCK_LIMIT = 'SELECT "limit" FROM quotas WHERE tenant_id = %s AND resource = %s FOR UPDATE'
_USED = """
SELECT coalesce(sum(amount), 0) AS used FROM quota_charges
WHERE tenant_id = %s AND resource = %s AND refunded_at IS NULL
"""
_CHARGE = """
INSERT INTO quota_charges (reservation_id, tenant_id, resource, amount) VALUES (%s, %s, %s, %s)
ON CONFLICT (reservation_id, resource) DO UPDATE
    SET amount = EXCLUDED.amount, charged_at = now(), refunded_at = NULL
"""
_REFUND = """
UPDATE quota_charges SET refunded_at = compute_now()
WHERE reservation_id = %s AND refunded_at IS NULL
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
        row = await (await conn.execute(_LOCK_LIMIT, (tenant_id, resource))).fetchone()
        limit = int(row["limit"]) if row else 0
        used = int((await (await conn.execute(_USED, (tenant_id, resource))).fetchone())["used"])
        if used + amount > limit:
            raise errors.QuotaExceeded(
                f"quota for {resource} is {limit}, {used} in use, {amount} requested",
                resource=resource,
                limit=limit,
                used=used,
                requested=amount,
            )
        await conn.execute(_CHARGE, (reservation_id, tenant_id, resource, amount))


async def refund(conn: AsyncConnection, reservation_id: str) -> None:
    await conn.execute(_REFUND, (reservation_id,))


async def usage(conn: AsyncConnection, tenant_id: str) -> list[dict]:
    return await (await conn.execute(_USAGE, {"t": tenant_id})).fetchall()
