"""What transaction 1 of a create reads before it decides anything (DESIGN.md section 8, step 2),
in one statement: the caller's token, the clock, the pool as the tenant sees it, the identity's
live drafts, the tenant's policy and the stored row of the key; with the draft's insert when it
was checked ahead (draft_ahead)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane.auth import Caller, Unverified, verify
from controlplane.reservations import draft_ahead, queries
from controlplane.reservations.validate import CreateInput
from controlplane.runtime import Runtime


def pool_index(rt: Runtime, pool_id: str) -> Any:
    """The capacity index's view of the pool (None while the index is not built, or off)."""
    return rt.capacity.pool(pool_id) if rt.capacity is not None else None


def with_single_model(pool: dict[str, Any], index: Any) -> dict[str, Any]:
    """The pool with its single GPU model from the index (None when it has several or none)."""
    return {**pool, "single_model": index.single_model()}


@dataclass
class Facts:
    """What transaction 1 reads before it decides anything: the stored row, and the rest in one
    statement (queries.DRAFT_FACTS)."""

    caller: Caller
    row: dict[str, Any] | None  # the stored reservation of this key, if any
    now_ms: int
    pool: dict[str, Any] | None  # the pool as the tenant sees it (None: not visible)
    drafts: dict[str, Any]  # the identity's live drafts (LIVE_DRAFTS)
    policy: str | None  # the tenant's Cedar policy
    inserted: bool = False  # `row` is the draft the statement inserted (draft_ahead)


async def read(conn: AsyncConnection, rt: Runtime, who: Caller | Unverified, inp: CreateInput,
         rid: str, ahead: draft_ahead.Ahead | None = None) -> Facts:
    """The stored row, the clock, the pool, the identity's drafts and the policy: one statement (a
    retry of a stored row reads a little it may not need; a new request needs all of it), which
    inserts `ahead`'s draft when its guard holds (draft_ahead). An Unverified caller's token is
    verified in it, and its membership checked, before any of it is used: UNAUTHENTICATED or
    ACCESS_DENIED as the interceptor and `create` would have answered."""
    index = pool_index(rt, inp.request["poolId"])
    verifying = isinstance(who, Unverified)
    if ahead is not None:
        sql = draft_ahead.SQL_VERIFYING if verifying else draft_ahead.SQL
    elif verifying:
        sql = queries.DRAFT_FACTS_VERIFYING if index is not None else queries.DRAFT_FACTS_READING_MODELS_VERIFYING
    else:
        sql = queries.DRAFT_FACTS if index is not None else queries.DRAFT_FACTS_READING_MODELS
    read = await (await conn.execute(sql, {
        **(_insert_params(ahead.params) if ahead is not None else {}),
        "id": rid, "pool_id": inp.request["poolId"], "tenant_id": inp.tenant_id, "identity_id": who.identity_id,
        "cap": rt.settings.max_drafts_per_identity, "retention_s": rt.settings.draft_retention_hours * 3600,
        **({"hash": who.token_hash} if verifying else {}),
    })).fetchone()
    assert read is not None
    inserted = bool(read.pop("facts_inserted", False))
    if isinstance(who, Unverified):
        caller = verify(who, read.pop("caller"))
        caller.require_member(inp.tenant_id)
    else:
        caller = who
    facts = {key: read.pop(key) for key in queries.DRAFT_FACT_COLUMNS}
    stored = read if read["id"] is not None else None  # the rest is BY_ID's row (or the draft inserted), or NULLs
    pool = facts["facts_pool"]
    if pool is not None and index is not None:
        rt.seen_pools.remember(inp.tenant_id, pool)
        pool = with_single_model(pool, index)
    return Facts(caller, stored, facts["facts_now_ms"], pool,
                 {"n": facts["facts_drafts"], "expires_in_s": facts["facts_drafts_expire_in_s"]}, facts["facts_policy"],
                 inserted)


def _insert_params(params: dict[str, Any]) -> dict[str, Any]:
    """The draft's columns as the insert takes them (JSON values wrapped)."""
    return {**params, **{k: Jsonb(params[k]) for k in ("request", "host_share", "attributes")}}
