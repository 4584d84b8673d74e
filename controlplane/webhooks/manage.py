"""Creating, reading and deleting webhooks, and listing their deliveries.

Every call needs membership of the tenant and IAM's compute:webhooks:manage on it: a webhook's
URL and deliveries are configuration. Its deliveries are events, so Create and ListDeliveries also
need what Events.Watch with the webhook's event types needs, and every delivery is decided again
(`authority`).
Another tenant's webhook is NOT_FOUND. ListDeliveries leaves out the deliveries of reservations
its caller may not read (compute:reservations:read, as get decides it).
A URL must resolve to public addresses only (`targets`; INVALID_INPUT naming `url`), a secret is a
Standard Webhooks one or generated (`signing`; INVALID_INPUT naming `secret`), and a tenant
has at most Settings.webhooks_per_tenant webhooks (QUOTA_EXCEEDED, resource `webhooks`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane import authorize, db, errors
from controlplane.auth import Caller
from controlplane.common import pages
from controlplane.common.names import TENANT_ID, match
from controlplane.ids import new_id
from controlplane.reservations import reads
from controlplane.runtime import Runtime
from controlplane.watch import authorize_tenant, parse_types
from controlplane.webhooks import authority, queries, signing, targets

log = structlog.get_logger(__name__)

WEBHOOKS_MANAGE = "compute:webhooks:manage"

# ListDeliveries examines at most this many deliveries for the ones its caller may read; a page
# cut short by it ends with a cursor to go on from (the last delivery examined).
DELIVERIES_SCAN_CAP = 1000

WEBHOOK_ID = re.compile(r"^whk_[0-9a-hjkmnp-tv-z]{26}$")


async def _url(rt: Runtime, tenant_id: str, url: str) -> str:
    """`url` when it is a webhook URL whose host resolves, now, to allowed addresses only."""
    try:
        parsed = targets.parse(url)
    except ValueError as exc:
        raise errors.InvalidInput("url", str(exc)) from None
    try:
        async with asyncio.timeout(rt.settings.webhook_attempt_seconds):
            await targets.resolve(parsed, rt.settings.webhook_allow, tenant_id)
    except (targets.Refused, TimeoutError) as exc:
        log.info("webhook url refused", host=parsed.host, reason=str(exc) or "resolving timed out")
        raise errors.InvalidInput("url", targets.REFUSED) from None
    return url


def _limit(value: int) -> int:
    limit = value or 50
    if not 1 <= limit <= 200:
        raise errors.InvalidInput("limit", "must be 1 to 200")
    return limit


def _webhook_id(value: str, field: str = "webhookId") -> str:
    if not WEBHOOK_ID.fullmatch(value or ""):
        raise errors.InvalidInput(field, "not a webhook id")
    return value


async def create(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    """Needs compute:webhooks:manage and what a Watch of the same event types needs (`authority`),
    decided on one read of the policy."""
    tenant_id = match("tenantId", raw.get("tenant_id", ""), TENANT_ID)
    caller.require_member(tenant_id)
    policy = await authorize.fetch_policy(rt.pool, tenant_id)
    authorize.check(policy, caller, tenant_id, WEBHOOKS_MANAGE, "Tenant", tenant_id, {"operation": "create"},
                    tenantId=tenant_id)
    event_types = parse_types("eventTypes", list(raw.get("event_types") or []))
    authority.check_create(policy, caller, tenant_id, event_types)
    secret = raw.get("secret", "")
    generated = not secret
    try:
        secret = signing.generate_secret() if generated else signing.check_secret(secret)
    except ValueError as exc:
        raise errors.InvalidInput("secret", str(exc)) from None
    params = {
        "id": new_id("whk"), "tenant_id": tenant_id, "url": await _url(rt, tenant_id, raw.get("url", "")),
        "secret": secret,
        "event_types": event_types, "created_by": caller.identity_id,
    }
    limit = rt.settings.webhooks_per_tenant

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute(queries.TENANT_LOCK, params)
        used = (await (await conn.execute(queries.COUNT, params)).fetchone())["n"]
        if used >= limit:
            raise errors.QuotaExceeded(f"a tenant may have {limit} webhooks; delete one first",
                                       resource="webhooks", limit=limit, used=used, requested=1)
        return await (await conn.execute(queries.CREATE, params)).fetchone()

    row = await db.run_in_transaction(rt.pool, work)
    return {**row, "secret": secret} if generated else row  # shown once: a given one never


async def get(rt: Runtime, caller: Caller, tenant_id: str, webhook_id: str) -> dict[str, Any]:
    await authorize_tenant(rt, caller, tenant_id, WEBHOOKS_MANAGE, {"operation": "get"})
    async with db.read_only(rt.pool) as conn:
        return await _find(conn, tenant_id, _webhook_id(webhook_id))


async def list_(rt: Runtime, caller: Caller, tenant_id: str, limit: int, cursor: str) -> tuple[list[dict[str, Any]], str]:
    await authorize_tenant(rt, caller, tenant_id, WEBHOOKS_MANAGE, {"operation": "list"})
    limit = _limit(limit)
    params = {"tenant_id": tenant_id, "limit": limit, "cursor": _webhook_id(cursor, "cursor") if cursor else None}
    async with db.read_only(rt.pool) as conn:
        rows = await (await conn.execute(queries.LIST, params)).fetchall()
    return rows, rows[-1]["id"] if len(rows) == limit else ""


async def delete(rt: Runtime, caller: Caller, tenant_id: str, webhook_id: str) -> dict[str, Any]:
    await authorize_tenant(rt, caller, tenant_id, WEBHOOKS_MANAGE, {"operation": "delete"})
    params = {"id": _webhook_id(webhook_id), "tenant_id": tenant_id}

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        # Exclusive, as create: no event writer's fan-out (it holds the lock shared, migration
        # 0064) is between reading this webhook and inserting its delivery, which would fail that
        # writer's commit on the foreign key.
        await conn.execute(queries.TENANT_LOCK, params)
        row = await (await conn.execute(queries.DELETE, params)).fetchone()
        if row is None:
            raise errors.NotFound("no such webhook", webhookId=webhook_id)
        return row

    return await db.run_in_transaction(rt.pool, work)


async def deliveries(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    tenant_id = raw.get("tenant_id", "")
    await authorize_tenant(rt, caller, tenant_id, WEBHOOKS_MANAGE, {"operation": "list-deliveries"})
    webhook_id = _webhook_id(raw.get("webhook_id", ""))
    limit = _limit(raw.get("limit") or 0)
    before = raw.get("before_event_id") or 0
    if before < 0:
        raise errors.InvalidInput("beforeEventId", "must be 0 or an event id")
    params = {"webhook_id": webhook_id, "before": before, "limit": limit}
    async with db.read_only(rt.pool) as conn:
        hook = await _find(conn, tenant_id, webhook_id)
        policy = await authorize.read_policy(conn, tenant_id)
        rows = await (await conn.execute(queries.DELIVERIES, params)).fetchall()
    # Its deliveries are events (ids, types, subjects): the caller needs what Events.Watch of the
    # webhook's event types needs, as its creator did (decided with the transaction closed).
    authority.check_create(policy, caller, tenant_id, list(hook["event_types"] or []))
    # And a listing is no wider than get: a delivery of a reservation the caller may not read (a
    # delivery refused its creator, or one its creator could read and the caller cannot) is left
    # out, decided per page in one Cedar batch. Reads on past them, up to DELIVERIES_SCAN_CAP rows.
    return await pages.filtered(rows, lambda before: _deliveries(rt, {**params, "before": before}),
                                lambda rows: reads.readable_events(policy, caller, tenant_id, rows),
                                lambda row: row["event_id"], limit=limit, cap=DELIVERIES_SCAN_CAP, end=0)


async def _deliveries(rt: Runtime, params: dict[str, Any]) -> list[dict[str, Any]]:
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(queries.DELIVERIES, params)).fetchall()


async def _find(conn: AsyncConnection, tenant_id: str, webhook_id: str) -> dict[str, Any]:
    row = await (await conn.execute(queries.GET, {"id": webhook_id, "tenant_id": tenant_id})).fetchone()
    if row is None:
        raise errors.NotFound("no such webhook", webhookId=webhook_id)
    return row
