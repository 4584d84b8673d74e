"""Provider accounts (root only), binding their reservations to pools, and projects."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import db, db_errors, errors
from controlplane.auth import Caller
from controlplane.common.names import POOL_ID, match
from controlplane.ids import new_id
from controlplane.runtime import Runtime
from controlplane.vps import access, names
from controlplane.vps import queries as q


async def create(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    access.require_root_tenant(caller, raw.get("tenant_id", ""))
    name = match("name", raw.get("name", ""), names.NAME)
    provider = raw.get("provider") or "sim"
    if provider not in names.PROVIDERS:
        raise errors.InvalidInput("provider", f"must be one of {list(names.PROVIDERS)}")
    endpoint = match("endpoint", raw.get("endpoint", ""), names.ENDPOINT)
    external = match("externalAccount", raw.get("external_account", ""), names.EXTERNAL_ACCOUNT)
    account_id = new_id("pacct")
    await access.on_account(rt, caller, account_id, provider=provider)

    at_provider = {"provider": provider, "endpoint": endpoint, "external_account": external}

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute(q.EXTERNAL_ACCOUNT_LOCK, at_provider)
        same = await (await conn.execute(q.ACCOUNT_AT_PROVIDER, at_provider)).fetchone()
        if same is not None:  # its reservations would be granted once per row
            raise errors.Conflict("this account at the provider is registered already", accountId=same["id"],
                                  reason="account-registered")
        await conn.execute(q.INSERT_ACCOUNT, {"id": account_id, "name": name, **at_provider})
        return await (await conn.execute(q.ACCOUNT, {"id": account_id})).fetchone()

    with db_errors.mapped(name=name):
        return await db.run_in_transaction(rt.pool, work)


async def load(conn: AsyncConnection, account_id: str, *, lock: bool = False) -> dict[str, Any]:
    row = await (await conn.execute(q.ACCOUNT_FOR_UPDATE if lock else q.ACCOUNT, {"id": account_id})).fetchone()
    if row is None:
        raise errors.NotFound("no such provider account", accountId=account_id)
    return row


async def _checked(rt: Runtime, caller: Caller, tenant_id: str, account_id: str) -> None:
    access.require_root_tenant(caller, tenant_id)
    match("accountId", account_id, names.ACCOUNT_ID)
    await access.on_account(rt, caller, account_id)


async def get(rt: Runtime, caller: Caller, tenant_id: str, account_id: str) -> dict[str, Any]:
    await _checked(rt, caller, tenant_id, account_id)
    async with db.read_only(rt.pool) as conn:
        return await load(conn, account_id)


async def list_(rt: Runtime, caller: Caller, tenant_id: str) -> list[dict[str, Any]]:
    access.require_root_tenant(caller, tenant_id)
    await access.on_account(rt, caller, "*")
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(q.ACCOUNTS)).fetchall()


async def delete(rt: Runtime, caller: Caller, tenant_id: str, account_id: str) -> dict[str, Any]:
    """Refused (INVALID_STATE, grantIds) while a grant on the account is scheduled or active, or an
    ended one is not metered to its end, and (INVALID_STATE, instanceId) while an instance on it is
    not deleted (its machine would run at the provider unbilled); otherwise its reservations and
    grants go with it."""
    await _checked(rt, caller, tenant_id, account_id)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        row = await load(conn, account_id, lock=True)
        await conn.execute(q.RESERVATIONS_OF_ACCOUNT_FOR_UPDATE, {"account_id": account_id})
        blocking = [r["id"] for r in await (await conn.execute(
            q.ACCOUNT_BLOCKING_GRANTS, {"account_id": account_id})).fetchall()]
        if blocking:
            raise errors.InvalidState("the account has grants that are live or not yet metered to their end",
                                      accountId=account_id, grantIds=blocking)
        live = await (await conn.execute(q.ACCOUNT_LIVE_INSTANCES, {"account_id": account_id})).fetchone()
        if live is not None:
            raise errors.InvalidState("the account has instances that are not deleted", accountId=account_id,
                                      instanceId=live["id"], instances=live["live"])
        await conn.execute(q.DELETE_ACCOUNT, {"id": account_id})
        return row

    return await db.run_in_transaction(rt.pool, work)


async def reservations(rt: Runtime, caller: Caller, tenant_id: str, account_id: str) -> list[dict[str, Any]]:
    await _checked(rt, caller, tenant_id, account_id)
    async with db.read_only(rt.pool) as conn:
        await load(conn, account_id)
        return await (await conn.execute(q.RESERVATIONS_OF_ACCOUNT, {"account_id": account_id})).fetchall()


async def _reservation(conn: AsyncConnection, account_id: str, reservation_id: str) -> dict[str, Any]:
    row = await (await conn.execute(q.RESERVATION_FOR_UPDATE, {"account_id": account_id,
                                                                "reservation_id": reservation_id})).fetchone()
    if row is None:
        raise errors.NotFound("no such reservation on the account", accountId=account_id,
                              reservationId=reservation_id)
    return row


async def bind(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    account_id = raw.get("account_id", "")
    await _checked(rt, caller, raw.get("tenant_id", ""), account_id)
    reservation_id = match("reservationId", raw.get("reservation_id", ""), names.PROVIDER_RESERVATION_ID)
    pool_id = match("poolId", raw.get("pool_id", ""), POOL_ID)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await load(conn, account_id)
        row = await _reservation(conn, account_id, reservation_id)
        if await (await conn.execute(q.POOL_EXISTS, {"pool_id": pool_id})).fetchone() is None:
            raise errors.NotFound("no such pool", poolId=pool_id)
        if row["pool_id"] not in (None, pool_id):
            await _refuse_if_live(conn, account_id, reservation_id, "rebind")
        await conn.execute(q.BIND, {"account_id": account_id, "reservation_id": reservation_id, "pool_id": pool_id})
        return await _reservation(conn, account_id, reservation_id)

    return await db.run_in_transaction(rt.pool, work)


async def unbind(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    account_id = raw.get("account_id", "")
    await _checked(rt, caller, raw.get("tenant_id", ""), account_id)
    reservation_id = match("reservationId", raw.get("reservation_id", ""), names.PROVIDER_RESERVATION_ID)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await load(conn, account_id)
        await _reservation(conn, account_id, reservation_id)
        await _refuse_if_live(conn, account_id, reservation_id, "unbind")
        await conn.execute(q.BIND, {"account_id": account_id, "reservation_id": reservation_id, "pool_id": None})
        return await _reservation(conn, account_id, reservation_id)

    return await db.run_in_transaction(rt.pool, work)


async def _refuse_if_live(conn: AsyncConnection, account_id: str, reservation_id: str, what: str) -> None:
    live = [r["id"] for r in await (await conn.execute(
        q.LIVE_GRANTS_ON, {"account_id": account_id, "reservation_id": reservation_id})).fetchall()]
    if live:
        raise errors.InvalidState(f"cannot {what} a reservation with scheduled or active grants",
                                  reservationId=reservation_id, grantIds=live)


# --- projects -----------------------------------------------------------------------------------

async def create_project(rt: Runtime, caller: Caller, tenant_id: str, name: str) -> dict[str, Any]:
    match("name", name, names.NAME)
    await access.on_tenant(rt, caller, tenant_id, access.PROJECTS_MANAGE)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        keys = {"tenant_id": tenant_id, "name": name}
        await conn.execute(q.TENANT_PROJECTS_LOCK, keys)
        found = await (await conn.execute(q.PROJECT_BY_NAME, keys)).fetchone()
        if found is not None:
            return found
        cap = rt.settings.projects_per_tenant
        if (await (await conn.execute(q.PROJECT_COUNT, keys)).fetchone())["n"] >= cap:
            raise errors.QuotaExceeded(f"at most {cap} projects per tenant", reason="project-limit", limit=cap)
        await conn.execute(q.INSERT_PROJECT, {"id": new_id("prj"), **keys})
        return await (await conn.execute(q.PROJECT_BY_NAME, keys)).fetchone()

    return await db.run_in_transaction(rt.pool, work)


async def list_projects(rt: Runtime, caller: Caller, tenant_id: str) -> list[dict[str, Any]]:
    await access.on_tenant(rt, caller, tenant_id, access.PROJECTS_MANAGE)
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(q.PROJECTS, {"tenant_id": tenant_id,
                                                      "limit": rt.settings.projects_per_tenant})).fetchall()


