"""A new create's draft written in its facts statement (DESIGN.md section 8, step 2: "insert the
draft if absent; read the row").

Transaction 1 reads its facts (the caller's token, the clock, the pool as the tenant sees it, the
identity's live drafts, the policy, the stored row of its key), checks the request against them
and inserts the draft: two round trips. Everything the checks read from the facts is the pool's
row as the tenant sees it and the clock; the rest (the index's models and host share) the process
holds. So when the process has seen this tenant's view of the pool before, it checks the request
against that view first and sends the insert with the facts read, guarded in SQL by everything
the checks assumed: the pool read now equals the view checked (so every check holds), the token
verifies as `auth.verify` would and its identity is a member of the tenant, the identity has room
for a draft, the key has no stored row, and the start is within the horizon of the clock read.
When any of these does not hold the statement inserts nothing and answers the facts, and the
create goes on as it would have (its second statement, checked against the facts just read):
the guard decides only whether the insert rides along, never what is inserted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane import auth, errors
from controlplane.metal import is_node_lease
from controlplane.reservations import queries
from controlplane.reservations.validate import TimeLimits


@dataclass(frozen=True)
class Ahead:
    """A draft checked against a pool seen before, to insert in the facts statement."""

    pool: dict[str, Any]  # the view it was checked against, with the index's models
    attributes: dict[str, Any]
    params: dict[str, Any]  # the guard's and the insert's parameters (the request as stored among them)


def eligible(request: dict[str, Any]) -> bool:
    """A request whose checks read nothing but the pool's row and the clock: not a node lease
    (its profile version is read) and no earliest start (searched on the index, after a wait)."""
    return not is_node_lease(request) and not request.get("startEarliest")


def now_min(request: dict[str, Any], max_start_ahead_ms: int) -> int:
    """The earliest clock at which the request's start is within the horizon (validate.epoch_ms:
    a start may be at most max_start_ahead after now); any clock when it has none."""
    start = request.get("start")
    return start - max_start_ahead_ms if start is not None else -(2**62)


def sql(verifying: bool) -> str:
    """The facts statement of queries.draft_facts with the guarded insert; `verifying`: the caller
    is an auth.Unverified, whose token the statement verifies (auth.CALLER_COLUMN) and the guard
    checks as auth.verify and Caller.require_member would."""
    caller_ok = ("(f.caller->>'id') = %(identity_id)s AND NOT (f.caller->>'expired')::boolean"
                 " AND (f.caller->'tenant_ids') ? %(tenant_id)s") if verifying else "true"
    columns = queries.fact_columns(queries.VISIBLE_POOL_FACTS, auth.CALLER_COLUMN if verifying else "")
    return f"""
WITH facts AS MATERIALIZED (
    SELECT {columns}
    FROM ({queries.LIVE_DRAFTS.strip()}) d
),
stored AS MATERIALIZED ({queries.BY_ID}),
go AS MATERIALIZED (
    SELECT f.facts_drafts FROM facts f
    WHERE NOT EXISTS (SELECT 1 FROM stored)
      AND f.facts_pool = %(pool_seen)s::jsonb
      AND f.facts_drafts < %(cap)s
      AND f.facts_now_ms >= %(now_min)s
      AND {caller_ok}
),
room AS MATERIALIZED (
    SELECT draft_room(%(identity_id)s::text, %(cap)s::integer, go.facts_drafts::integer) AS ok,
           set_config('synchronous_commit', 'off', true) AS unflushed
    FROM go
),
{queries.DRAFT_INSERT_CTES}
SELECT f.*, EXISTS (SELECT 1 FROM d) AS facts_inserted, x.*
FROM facts f LEFT JOIN LATERAL (SELECT * FROM d UNION ALL SELECT * FROM stored) x ON true
"""


SQL = sql(verifying=False)
SQL_VERIFYING = sql(verifying=True)


async def prepare(rt: Any, who: auth.Caller | auth.Unverified, inp: Any, rid: str, digest: str,
                  check: Any) -> Ahead | None:
    """The draft checked against the pool this tenant saw last (`check(pool, index)`: the request
    resolved and its attributes, as transaction 1 makes them), or None: no view seen, the request is not
    eligible, or a check refused it on that view (the facts read now decide)."""
    request = inp.request
    index = rt.capacity.pool(request["poolId"]) if rt.capacity is not None else None
    if index is None or not eligible(request):
        return None
    seen = rt.seen_pools.get(inp.tenant_id, request["poolId"])
    if seen is None:
        return None
    text, pool = seen
    try:
        pool, stored, share, attributes = await check(pool, index)
    except errors.DomainError:
        return None
    return Ahead(pool, attributes, {
        "pool_seen": text, "now_min": now_min(request, TimeLimits.of(rt.settings).max_start_ahead_ms),
        "tenant_id": inp.tenant_id, "pool_id": request["poolId"], "identity_id": who.identity_id,
        "key": inp.idempotency_key, "request": stored, "request_hash": digest, "host_share": share,
        "attributes": attributes, "id": rid,
    })
