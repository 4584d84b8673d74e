"""capacity.timeline: booked and free whole GPUs of a pool per time bucket."""

from __future__ import annotations

from typing import Any

from controlplane import authorize, db, errors
from controlplane.auth import Caller
from controlplane.common.names import POOL_ID, TENANT_ID, match
from controlplane.reservations import queries
from controlplane.reservations.validate import TimeLimits, epoch_ms
from controlplane.runtime import Runtime

HOUR_MS = 3_600_000
MAX_SPAN_MS = 7 * 24 * HOUR_MS
MAX_BUCKETS = 336

# The pool's current rollup: whole GPUs that are healthy and bookable on ready, reachable nodes,
# and those of machines leased whole (their bookings count as booked, so they count here too).
_ALLOCATABLE = """
SELECT count(*) AS n FROM atoms a JOIN nodes n ON n.id = a.node_id
WHERE n.pool_id = %(pool_id)s AND a.kind = 'gpu' AND a.health = 'healthy' AND a.bookable
  AND n.state IN ('ready', 'leased') AND n.connectivity <> 'unreachable'
"""
# Per bucket index k (bucket k is [from + k*step, from + (k+1)*step), the last cut at `to`): the
# distinct gpu atoms of the pool with a booking overlapping it. The bookings overlapping [from, to)
# are read once (one probe per atom), each spread over the buckets it touches: its bounds in whole
# ms, rounded outwards so a booking overlapping a bucket by less than a millisecond still counts.
_BUCKETS = """
WITH hit AS (
    SELECT b.atom_id,
           greatest(floor(extract(epoch FROM lower(b.during)) * 1000)::bigint, %(from)s::bigint) AS lo,
           least(ceil(extract(epoch FROM upper(b.during)) * 1000)::bigint, %(to)s::bigint) AS hi
    FROM bookings b
    JOIN atoms a ON a.id = b.atom_id JOIN nodes n ON n.id = a.node_id
    WHERE n.pool_id = %(pool_id)s AND a.kind = 'gpu'
      AND b.during && tstzrange(from_epoch_ms(%(from)s), from_epoch_ms(%(to)s), '[)')
)
SELECT k, count(DISTINCT atom_id) AS booked
FROM hit, generate_series((lo - %(from)s::bigint) / %(step)s::bigint,
                          (coalesce(hi, %(to)s::bigint) - 1 - %(from)s::bigint) / %(step)s::bigint) AS k
GROUP BY k
"""


async def timeline(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    tenant_id = match("tenantId", raw.get("tenant_id", ""), TENANT_ID)
    pool_id = match("poolId", raw.get("pool_id", ""), POOL_ID)
    caller.require_member(tenant_id)
    step_minutes = raw.get("step_minutes") if raw.get("step_minutes") is not None else 60
    if not 5 <= step_minutes <= 1440:
        raise errors.InvalidInput("stepMinutes", "must be 5 to 1440")
    step = step_minutes * 60_000
    async with db.read_only(rt.pool) as conn:
        now_ms = await db.now_ms(conn)
        start = raw["from"] if raw.get("from") is not None else now_ms - now_ms % HOUR_MS
        end = raw["to"] if raw.get("to") is not None else start + 24 * HOUR_MS
        limits = TimeLimits.of(rt.settings)  # as far ahead as the last booking can end
        epoch_ms("from", start, now_ms, TimeLimits(limits.max_start_ahead_ms + limits.max_length_ms))
        if end < 0:
            raise errors.InvalidInput("to", "must be epoch milliseconds, at least 0")
        if end <= start:
            raise errors.InvalidInput("to", "must be after from")
        if end - start > MAX_SPAN_MS:
            raise errors.InvalidInput("to", "a timeline spans at most 7 days")
        if -(-(end - start) // step) > MAX_BUCKETS:
            raise errors.InvalidInput("stepMinutes", "a timeline has at most 336 buckets")
        pool = await (await conn.execute(queries.VISIBLE_POOL, {"pool_id": pool_id, "tenant_id": tenant_id})).fetchone()
        if pool is None:
            raise errors.NotFound("no such pool", poolId=pool_id)
    # Decided with the read transaction closed; the buckets are read after the decision.
    await _require_read(rt, caller, tenant_id, pool)
    async with db.read_only(rt.pool) as conn:
        allocatable = (await (await conn.execute(_ALLOCATABLE, {"pool_id": pool_id})).fetchone())["n"]
        booked = {r["k"]: r["booked"] for r in await (await conn.execute(
            _BUCKETS, {"pool_id": pool_id, "from": start, "to": end, "step": step})).fetchall()}
    buckets = [{"start": s, "end": min(s + step, end), "booked": booked.get(k, 0),
                "free": max(0, allocatable - booked.get(k, 0))}
               for k, s in enumerate(range(start, end, step))]
    return {"pool_id": pool_id, "allocatable": allocatable, "buckets": buckets}


async def _require_read(rt: Runtime, caller: Caller, tenant_id: str, pool: dict[str, Any]) -> None:
    """IAM's `compute:capacity:read` on the pool, decided with no transaction open."""
    await authorize.require(rt.pool, caller, tenant_id, "compute:capacity:read", "Pool", pool["id"],
                            {"region": pool["region"], "ownerTenantId": pool["owner_tenant_id"]},
                            message="IAM refused this read", poolId=pool["id"])


# capacity.rollup -------------------------------------------------------------------------------

# Per whole GPU of the pool: its model, whether it is allocatable (as _ALLOCATABLE), and per tenant
# whether a booking holds it now or only later (a window that has not begun: `reserved`).
_ROLLUP = """
WITH gpus AS (
    SELECT a.id, a.model,
           (a.health = 'healthy' AND a.bookable AND n.state IN ('ready', 'leased')
            AND n.connectivity <> 'unreachable') AS allocatable
    FROM atoms a JOIN nodes n ON n.id = a.node_id
    WHERE n.pool_id = %(pool_id)s AND a.kind = 'gpu'
),
held AS (
    SELECT b.atom_id, r.tenant_id, bool_or(lower(b.during) <= compute_now()) AS now_held,
           bool_or(lower(b.during) > compute_now()) AS later
    FROM bookings b
    JOIN gpus g ON g.id = b.atom_id
    JOIN allocations al ON al.id = b.allocation_id
    JOIN reservations r ON r.id = al.reservation_id
    WHERE upper(b.during) > compute_now()
    GROUP BY b.atom_id, r.tenant_id
)
SELECT g.model, h.tenant_id, GROUPING(h.tenant_id) = 1 AS whole_model,
       count(DISTINCT g.id) FILTER (WHERE g.allocatable) AS allocatable,
       count(DISTINCT g.id) FILTER (WHERE h.now_held) AS in_use,
       count(DISTINCT g.id) FILTER (WHERE h.later) AS reserved,
       count(DISTINCT g.id) FILTER (WHERE g.allocatable AND h.now_held) AS allocatable_in_use
FROM gpus g LEFT JOIN held h ON h.atom_id = g.id
GROUP BY GROUPING SETS ((g.model), (g.model, h.tenant_id))
ORDER BY g.model, GROUPING(h.tenant_id) DESC, h.tenant_id
"""


def _counts(allocatable: int, in_use: int, reserved: int, allocatable_in_use: int) -> dict[str, int]:
    return {"allocatable": allocatable, "in_use": in_use, "reserved": reserved,
            "free": max(0, allocatable - allocatable_in_use)}


async def rollup(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    """The pool's whole GPUs now: allocatable, in use, reserved (booked for a window not yet begun)
    and free, for the pool and per model; the caller's tenant's use, and the others' in aggregate
    (per tenant for the pool's owner only)."""
    tenant_id = match("tenantId", raw.get("tenant_id", ""), TENANT_ID)
    pool_id = match("poolId", raw.get("pool_id", ""), POOL_ID)
    caller.require_member(tenant_id)
    async with db.read_only(rt.pool) as conn:
        pool = await (await conn.execute(queries.VISIBLE_POOL, {"pool_id": pool_id, "tenant_id": tenant_id})).fetchone()
    if pool is None:
        raise errors.NotFound("no such pool", poolId=pool_id)
    await _require_read(rt, caller, tenant_id, pool)
    async with db.read_only(rt.pool) as conn:
        rows = await (await conn.execute(_ROLLUP, {"pool_id": pool_id})).fetchall()
    models: list[dict[str, Any]] = []
    tenants: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["whole_model"]:
            models.append({"model": r["model"], "counts": _counts(
                r["allocatable"], r["in_use"], r["reserved"], r["allocatable_in_use"])})
            continue
        if r["tenant_id"] is None:  # the model's GPUs nobody holds
            continue
        use = tenants.setdefault(r["tenant_id"], {"in_use": 0, "reserved": 0})
        use["in_use"] += r["in_use"]
        use["reserved"] += r["reserved"]
    total = {k: sum(m["counts"][k] for m in models) for k in ("allocatable", "in_use", "reserved", "free")}
    own = tenants.get(tenant_id, {"in_use": 0, "reserved": 0})
    others = [u for t, u in tenants.items() if t != tenant_id]
    owner = pool["owner_tenant_id"] == tenant_id
    return {
        "pool_id": pool_id, "total": total, "models": models,
        "own_in_use": own["in_use"], "own_reserved": own["reserved"],
        "others_in_use": sum(u["in_use"] for u in others), "others_reserved": sum(u["reserved"] for u in others),
        "tenants": [{"tenant_id": t, **u} for t, u in sorted(tenants.items())] if owner else [],
    }
