"""reservationGrants create, get, list and end (spec 001's method sections)."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import db, errors
from controlplane.auth import Caller
from controlplane.bootstrap import ROOT_TENANT
from controlplane.common.names import IDEMPOTENCY_KEY, TENANT_ID, match
from controlplane.ids import new_id, request_hash
from controlplane.runtime import Runtime
from controlplane.vps import access, events, lifecycle, names
from controlplane.vps import queries as q

DAY_MS = 86_400_000


def _create_input(raw: dict[str, Any], rt: Runtime) -> dict[str, Any]:
    """The validated request, in the spec table's order; times in epoch ms."""
    spec = {
        "tenant_id": match("tenantId", raw.get("tenant_id", ""), TENANT_ID),
        "account_id": match("accountId", raw.get("account_id", ""), names.ACCOUNT_ID),
        "reservation_id": match("reservationId", raw.get("reservation_id", ""), names.PROVIDER_RESERVATION_ID),
        "grant_tenant_id": match("grantTenantId", raw.get("grant_tenant_id", ""), TENANT_ID),
        "project_id": None,
        "slots": raw.get("slots", 0),
        "starts_ms": raw.get("starts_at", 0),
        "ends_ms": raw.get("ends_at", 0),
    }
    if raw.get("project_id") is not None:
        spec["project_id"] = match("projectId", raw["project_id"], names.PROJECT_ID)
    if not 1 <= spec["slots"] <= 100_000:
        raise errors.InvalidInput("slots", "must be 1 to 100000")
    if spec["starts_ms"] < 0:
        raise errors.InvalidInput("startsAt", "must be at least 0")
    if spec["ends_ms"] < 0:
        raise errors.InvalidInput("endsAt", "must be at least 0")
    if spec["ends_ms"] <= spec["starts_ms"]:
        raise errors.InvalidInput("endsAt", "must be after startsAt")
    if spec["ends_ms"] - spec["starts_ms"] > rt.settings.grant_max_days * DAY_MS:
        raise errors.InvalidInput("endsAt", f"a term is at most {rt.settings.grant_max_days} days")
    match("idempotencyKey", raw.get("idempotency_key", ""), IDEMPOTENCY_KEY)
    return spec


def _check_term(spec: dict[str, Any], now: int, rt: Runtime) -> None:
    if spec["starts_ms"] < now - rt.settings.grant_start_past_seconds * 1000:
        raise errors.InvalidInput("startsAt", f"may be at most {rt.settings.grant_start_past_seconds} seconds "
                                              "in the past", now=now)
    if spec["starts_ms"] > now + rt.settings.grant_start_ahead_days * DAY_MS:
        raise errors.InvalidInput("startsAt", f"may be at most {rt.settings.grant_start_ahead_days} days ahead")


async def create(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    spec = _create_input(raw, rt)
    access.require_root_tenant(caller, spec["tenant_id"])
    key = raw["idempotency_key"]
    digest = request_hash(spec)
    # Decided before the key is looked up: a replay answers the grant (or CONFLICT naming it)
    # only to a caller IAM lets manage the account, and the grant's own account when another.
    await access.on_account(rt, caller, spec["account_id"], reservationId=spec["reservation_id"],
                            grantTenantId=spec["grant_tenant_id"], slots=spec["slots"])
    async with db.read_only(rt.pool) as conn:
        found = await (await conn.execute(q.GRANT_BY_KEY, {"issuer": spec["tenant_id"], "key": key})).fetchone()
    if found is not None:
        if found["account_id"] != spec["account_id"]:
            await access.on_account(rt, caller, found["account_id"], reservationId=found["reservation_id"],
                                    grantTenantId=found["tenant_id"], slots=found["slots"])
        return _replayed(found, digest)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        # The key's lock, then the reservation's row lock: creates under one key, and concurrent
        # grants on one reservation, are decided one at a time.
        await conn.execute(q.GRANT_KEY_LOCK, {"issuer": spec["tenant_id"], "key": key})
        reservation = await lifecycle.lock_reservation(conn, spec["account_id"], spec["reservation_id"])
        again = await (await conn.execute(q.GRANT_BY_KEY, {"issuer": spec["tenant_id"], "key": key})).fetchone()
        if again is not None:
            return _replayed(again, digest)
        if reservation is None or await (await conn.execute(q.ACCOUNT, {"id": spec["account_id"]})).fetchone() is None:
            raise errors.NotFound("no such reservation on the account", accountId=spec["account_id"],
                                  reservationId=spec["reservation_id"])
        if reservation["state"] != "ready" or reservation["pool_id"] is None:
            why = "unbound" if reservation["state"] == "ready" else reservation["state"]
            raise errors.InvalidState(f"the reservation is not ready and bound ({why})",
                                      reservationId=spec["reservation_id"], reason=why)
        grantee = {"tenant_id": spec["grant_tenant_id"], "pool_id": reservation["pool_id"]}
        if await (await conn.execute(q.TENANT_EXISTS, grantee)).fetchone() is None:
            raise errors.NotFound("no such tenant", grantTenantId=spec["grant_tenant_id"])
        await conn.execute(q.LOCK_OFFER, grantee)
        if await (await conn.execute(q.POOL_OFFERED, grantee)).fetchone() is None:
            raise errors.InvalidInput("grantTenantId", "the reservation's pool is not offered to the grantee",
                                      poolId=reservation["pool_id"], reason="pool-not-offered")
        if spec["project_id"] is not None:
            owner = await (await conn.execute(q.PROJECT_TENANT, {"id": spec["project_id"]})).fetchone()
            if owner is None or owner["tenant_id"] != spec["grant_tenant_id"]:
                raise errors.InvalidInput("projectId", "is not a project of the grantee", reason="project-not-grantee")
        _check_term(spec, await lifecycle.now_ms(conn), rt)
        granted = (await (await conn.execute(q.GRANTED_OVERLAPPING, spec)).fetchone())["granted"]
        if granted + spec["slots"] > reservation["total"]:
            raise errors.CapacityUnavailable("the reservation cannot take these slots over the term",
                                             total=reservation["total"], granted=granted)
        account = await (await conn.execute(q.ACCOUNT, {"id": spec["account_id"]})).fetchone()
        grant = await (await conn.execute(q.INSERT_GRANT, {
            **spec, "id": new_id("rgrant"), "tenant_id": spec["grant_tenant_id"], "pool_id": reservation["pool_id"],
            "region": reservation["region"], "flavor": reservation["flavor"], "provider": account["provider"],
            "issuer": spec["tenant_id"], "key": key, "request_hash": digest,
            "created_by": caller.identity_id})).fetchone()
        await events.grant_event(conn, grant, "reservation-grant.created")
        for at in (grant["starts_ms"], grant["ends_ms"]):
            await conn.execute(q.SCHEDULE_GRANT, {"id": grant["id"], "at_ms": at})
        return grant

    return await db.run_in_transaction(rt.pool, work)


def _replayed(grant: dict[str, Any], digest: str) -> dict[str, Any]:
    if grant["request_hash"] != digest:
        raise errors.Conflict("the idempotency key was used with another request", grantId=grant["id"])
    return grant


async def get(rt: Runtime, caller: Caller, tenant_id: str, grant_id: str) -> dict[str, Any]:
    """The tenant's grant; root acting in the root tenant reads any; another tenant's NOT_FOUND."""
    match("grantId", grant_id, names.GRANT_ID)
    await access.on_tenant(rt, caller, tenant_id, access.QUOTAS_READ)
    async with db.read_only(rt.pool) as conn:
        grant = await (await conn.execute(q.GRANT, {"id": grant_id})).fetchone()
    if grant is None or (grant["tenant_id"] != tenant_id and tenant_id != ROOT_TENANT):
        raise errors.NotFound("no such grant", grantId=grant_id)
    return grant


async def list_(rt: Runtime, caller: Caller, tenant_id: str, all_: bool) -> list[dict[str, Any]]:
    """Newest first, at most grants_list_max; `all` is root's (in the root tenant) alone."""
    match("tenantId", tenant_id, TENANT_ID)
    if all_ and tenant_id != ROOT_TENANT:
        raise errors.AccessDenied("all: true is for root acting in the root tenant", tenantId=tenant_id)
    await access.on_tenant(rt, caller, tenant_id, access.QUOTAS_READ, all=all_)
    limit = rt.settings.grants_list_max
    async with db.read_only(rt.pool) as conn:
        if all_:
            return await (await conn.execute(q.ALL_GRANTS, {"limit": limit})).fetchall()
        return await (await conn.execute(q.GRANTS_OF_TENANT, {"tenant_id": tenant_id, "limit": limit})).fetchall()


async def end(rt: Runtime, caller: Caller, tenant_id: str, account_id: str, grant_id: str) -> dict[str, Any]:
    access.require_root_tenant(caller, tenant_id)
    match("accountId", account_id, names.ACCOUNT_ID)
    match("grantId", grant_id, names.GRANT_ID)
    await access.on_account(rt, caller, account_id, grantId=grant_id)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        found = await (await conn.execute(q.GRANT, {"id": grant_id})).fetchone()
        if found is None or found["account_id"] != account_id:
            raise errors.NotFound("no such grant on the account", grantId=grant_id, accountId=account_id)
        await lifecycle.lock_reservation(conn, found["account_id"], found["reservation_id"])
        grant = await (await conn.execute(q.GRANT_FOR_UPDATE, {"id": grant_id})).fetchone()
        return await lifecycle.end_now(conn, grant, await lifecycle.now_ms(conn), "end")

    return await db.run_in_transaction(rt.pool, work)
