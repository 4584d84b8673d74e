"""Quota: per tenant and resource; a missing row grants 0; charges are rows per reservation.

This module owns the quotas and quota_charges tables and their SQL. Used is the sum of live
(unrefunded) charges; a charge reads it from quota_usage, which triggers keep in the same
transaction as the charges (migration 0029), so it cannot drift from that sum. A charge locks the
tenant's limit rows (in resource order) so concurrent charges are decided one at a time; it runs
in admission's locking statement (charge_all), and `charge_params` / `refusal` are its two ends.

Amounts are exact fractions: a MIG instance charges 1/7 of a `gpu`, a slot 1/replicas (stored as
amount/per, migration 0020). A per-model resource (`gpu:<model>`) limits only when the tenant has a
row for it; its charge is recorded either way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from decimal import Decimal
from fractions import Fraction
from typing import Any

import psycopg
from psycopg import AsyncConnection

from controlplane import errors

MODEL_PREFIX = "gpu:"

_SET_LIMIT = """
INSERT INTO quotas (tenant_id, resource, "limit") VALUES (%(tenant_id)s, %(resource)s, %(limit)s)
ON CONFLICT (tenant_id, resource) DO UPDATE SET "limit" = EXCLUDED."limit"
"""
# A charge is made in SQL, inside admission's locking statement (charge_all, migration 0028: it
# locks each limit row, reads the running usage and charges when it fits, every resource or none)
# and raises these for the first that does not fit:
EXCEEDED = "BCQ01"  # SQLSTATE: a resource cannot take its charge; DETAIL {resource, limit, used}
MODEL_REQUIRED = "BCQ02"  # SQLSTATE: a limited per-model resource the request does not name; DETAIL {resource, limit}
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


def charge_params(tenant_id: str, reservation_id: str, amounts: Mapping[str, int | Fraction],
                  unnamed_models: Iterable[str] = ()) -> dict[str, Any]:
    """charge_all's arguments: the positive amounts in resource order, as exact fractions."""
    wanted = sorted((r, Fraction(a)) for r, a in amounts.items() if a > 0)
    return {
        "tenant_id": tenant_id, "reservation_id": reservation_id,
        "resources": [r for r, _ in wanted], "amounts": [a.numerator for _, a in wanted],
        "pers": [a.denominator for _, a in wanted], "lenient": [r.startswith(MODEL_PREFIX) for r, _ in wanted],
        "unnamed": sorted(unnamed_models),
    }


def refusal(exc: psycopg.Error, amounts: Mapping[str, int | Fraction]) -> Exception:
    """QUOTA_EXCEEDED for charge_all's refusals (BCQ01, BCQ02); any other error as it is."""
    if exc.sqlstate not in (EXCEEDED, MODEL_REQUIRED) or exc.diag.message_detail is None:
        return exc
    detail = json.loads(exc.diag.message_detail)
    resource, limit = detail["resource"], int(detail["limit"])
    if exc.sqlstate == MODEL_REQUIRED:
        return errors.QuotaExceeded(
            f"quota limits {resource} and this pool has GPUs of several models: name the model",
            resource=resource, limit=limit, reason="model-required", field="devices[0].model",
        )
    used, amount = Fraction(Decimal(detail["used"])), Fraction(amounts[resource])
    return errors.QuotaExceeded(
        f"quota for {resource} is {limit}, {shown(used)} in use, {shown(amount)} requested",
        resource=resource, limit=limit, used=shown(used), requested=shown(amount),
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
