"""Quota: per tenant and resource; a missing row grants 0; charges are rows per reservation.

This module owns the quotas and quota_charges tables and their SQL. Used is always the sum of live (unrefunded) charges, never a counter that can drift. A charge
locks the tenant's quota rows (in resource order) so concurrent charges are decided one at a time.

Amounts are exact fractions: a MIG instance charges 1/7 of a `gpu`, a slot 1/replicas (stored as
amount/per, migration 0020). A per-model resource (`gpu:<model>`) limits only when the tenant has a
row for it; its charge is recorded either way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction

from psycopg import AsyncConnection

from controlplane import errors

MODEL_PREFIX = "gpu:"

_SET_LIMIT = """
INSERT INTO quotas (tenant_id, resource, "limit") VALUES (%(tenant_id)s, %(resource)s, %(limit)s)
ON CONFLICT (tenant_id, resource) DO UPDATE SET "limit" = EXCLUDED."limit"
"""
# Lock the limit row, sum the live charges, charge if it fits: one call per resource
# (migration 0020), all of them in one statement, in the given (sorted) order.
_CHARGE = """
SELECT r.resource, c.quota_limit, c.used, c.charged
FROM unnest(%(resources)s::text[], %(amounts)s::bigint[], %(pers)s::bigint[], %(lenient)s::boolean[])
     WITH ORDINALITY AS r(resource, amount, per, lenient, n)
CROSS JOIN LATERAL charge_quota(%(tenant_id)s, r.resource, %(reservation_id)s, r.amount, r.per, r.lenient) c
ORDER BY r.n
"""
# The first of these resources the tenant has a limit row for.
_FIRST_LIMITED = """
SELECT resource, "limit" FROM quotas WHERE tenant_id = %(tenant_id)s AND resource = ANY(%(resources)s)
ORDER BY resource LIMIT 1
"""
_REFUND = """
UPDATE quota_charges SET refunded_at = compute_now()
WHERE reservation_id = %(reservation_id)s AND refunded_at IS NULL
"""
# Per resource and denominator (summed exactly in Python). Per-model resources without a limit
# row are not listed: they limit nothing.
_USAGE = """
SELECT r.resource, coalesce(q."limit", 0) AS "limit", c.per, coalesce(sum(c.amount), 0) AS amount
FROM (SELECT resource FROM quotas WHERE tenant_id = %(t)s
      UNION SELECT resource FROM quota_charges
      WHERE tenant_id = %(t)s AND refunded_at IS NULL AND resource NOT LIKE 'gpu:%%') r
LEFT JOIN quotas q ON q.tenant_id = %(t)s AND q.resource = r.resource
LEFT JOIN quota_charges c ON c.tenant_id = %(t)s AND c.resource = r.resource AND c.refunded_at IS NULL
GROUP BY r.resource, q."limit", c.per ORDER BY r.resource
"""


def shown(value: Fraction | int) -> str:
    """A figure as a person reads it: whole numbers as such, fractions to four decimals."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.4f}".rstrip("0")


async def charge(
    conn: AsyncConnection, tenant_id: str, reservation_id: str, amounts: Mapping[str, int | Fraction],
    *, unnamed_models: Iterable[str] = (),
) -> None:
    """Charge every amount or none (QUOTA_EXCEEDED names the first resource that cannot take it).

    `unnamed_models`: the per-model resources a request without a model could land on (a pool of
    several models). Any of them the tenant limits refuses it: the charge could not name a model.
    """
    await _require_no_model_limit(conn, tenant_id, sorted(unnamed_models))
    wanted = sorted((r, Fraction(a)) for r, a in amounts.items() if a > 0)
    if not wanted:
        return
    rows = await (await conn.execute(_CHARGE, {
        "tenant_id": tenant_id, "reservation_id": reservation_id,
        "resources": [r for r, _ in wanted], "amounts": [a.numerator for _, a in wanted],
        "pers": [a.denominator for _, a in wanted], "lenient": [r.startswith(MODEL_PREFIX) for r, _ in wanted],
    })).fetchall()
    for (resource, amount), row in zip(wanted, rows, strict=True):
        if not row["charged"]:
            limit, used = int(row["quota_limit"]), Fraction(row["used"])
            raise errors.QuotaExceeded(
                f"quota for {resource} is {limit}, {shown(used)} in use, {shown(amount)} requested",
                resource=resource,
                limit=limit,
                used=shown(used),
                requested=shown(amount),
            )


async def _require_no_model_limit(conn: AsyncConnection, tenant_id: str, resources: list[str]) -> None:
    if not resources:
        return
    row = await (await conn.execute(_FIRST_LIMITED, {"tenant_id": tenant_id, "resources": resources})).fetchone()
    if row is not None:
        raise errors.QuotaExceeded(
            f"quota limits {row['resource']} and this pool has GPUs of several models: name the model",
            resource=row["resource"], limit=int(row["limit"]), reason="model-required", field="devices[0].model",
        )


async def refund(conn: AsyncConnection, reservation_id: str) -> None:
    await conn.execute(_REFUND, {"reservation_id": reservation_id})


async def set_limit(conn: AsyncConnection, tenant_id: str, resource: str, limit: int) -> None:
    """The tenant's limit for `resource` (an unknown tenant violates quotas_tenant_id_fkey)."""
    await conn.execute(_SET_LIMIT, {"tenant_id": tenant_id, "resource": resource, "limit": limit})


async def usage(conn: AsyncConnection, tenant_id: str) -> list[dict]:
    """Per resource: its limit, `used` rounded up to whole units and `used_exact` (a float)."""
    lines: dict[str, dict] = {}
    for row in await (await conn.execute(_USAGE, {"t": tenant_id})).fetchall():
        line = lines.setdefault(row["resource"], {"resource": row["resource"], "limit": row["limit"],
                                                  "exact": Fraction(0)})
        if row["per"] is not None:
            line["exact"] += Fraction(int(row["amount"]), int(row["per"]))
    return [{"resource": line["resource"], "limit": int(line["limit"]), "used": math.ceil(line["exact"]),
             "used_exact": float(line["exact"])} for line in lines.values()]
