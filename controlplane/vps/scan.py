"""The vps.reservations scan: read each provider account's reservations (new, ready, total
changes, gone) every provider_scan_seconds and on demand (ProviderAccounts.ScanReservations).

The provider is asked outside any transaction; what it answered is applied in one transaction per
account, under the account's reservation rows' locks. A provider that fails or stalls past its
deadline leaves the recorded reservations as they are (a failed call is not "gone").
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane import db, errors
from controlplane.auth import Caller
from controlplane.runtime import Runtime
from controlplane.vps import accounts, drift, events, lifecycle, names, sim_adapter
from controlplane.vps import queries as q
from controlplane.vps.provider import ProviderFailure, ProviderReservation

log = structlog.get_logger(__name__)


def provider_of(rt: Runtime, account: dict[str, Any]) -> sim_adapter.SimProvider:
    return sim_adapter.connect(account["provider"], account["endpoint"], rt.settings.provider_call_seconds)


async def scan_account(rt: Runtime, account: dict[str, Any]) -> list[dict[str, Any]]:
    """The account's reservations as the provider reports them, then its instances brought in
    line with their rows (drift.py)."""
    provider = provider_of(rt, account)
    reported = await provider.list_reservations(account["external_account"])

    async def work(conn: AsyncConnection) -> list[dict[str, Any]]:
        return await apply(conn, account["id"], reported)

    recorded = await db.run_in_transaction(rt.pool, work)
    await drift.sync_instances(rt, provider, account)
    return recorded


async def apply(conn: AsyncConnection, account_id: str, reported: list[ProviderReservation]) -> list[dict[str, Any]]:
    """Record what the provider reported for the account; returns the account's reservations."""
    if await (await conn.execute(q.ACCOUNT_FOR_UPDATE, {"id": account_id})).fetchone() is None:
        return []  # deleted meanwhile
    known = {r["reservation_id"]: r for r in await (await conn.execute(
        q.RESERVATIONS_OF_ACCOUNT_FOR_UPDATE, {"account_id": account_id})).fetchall()}
    now = await lifecycle.now_ms(conn)
    seen = set()
    for r in reported:
        if not names.PROVIDER_RESERVATION_ID.fullmatch(r.name) or not names.FLAVOR.fullmatch(r.flavor):
            log.warning("provider reservation skipped: its name or flavor is not one we take",
                        account_id=account_id, name=r.name[:64])
            continue
        seen.add(r.name)
        before = known.get(r.name)
        await conn.execute(q.UPSERT_RESERVATION, {"account_id": account_id, "reservation_id": r.name,
                                                  "flavor": r.flavor, "region": r.region, "total": max(0, r.total),
                                                  "state": "ready" if r.state == "ready" else "creating"})
        if before is None:
            log.info("provider reservation new", account_id=account_id, reservation_id=r.name, total=r.total)
        elif before["total"] != r.total or before["state"] == "gone":
            log.info("provider reservation total", account_id=account_id, reservation_id=r.name,
                     total=r.total, was=before["total"])
            await check_short(conn, account_id, r.name, max(0, r.total))
    for name, row in known.items():
        if name not in seen and row["state"] != "gone":
            await conn.execute(q.MARK_GONE, {"account_id": account_id, "reservation_id": name})
            log.warning("provider reservation gone", account_id=account_id, reservation_id=name)
            await lifecycle.reservation_gone(conn, row, now)
    return await (await conn.execute(q.RESERVATIONS_OF_ACCOUNT, {"account_id": account_id})).fetchall()


async def check_short(conn: AsyncConnection, account_id: str, reservation_id: str, total: int) -> None:
    """reservation-grant.capacity-short in the platform's tenant when `total` fell below the peak
    overlap of the live grants, once per change of total."""
    keys = {"account_id": account_id, "reservation_id": reservation_id}
    peak = await (await conn.execute(q.PEAK_LIVE_SLOTS, keys)).fetchone()
    row = await (await conn.execute(q.RESERVATION, keys)).fetchone()
    if total < peak["peak"]:
        if row["short_total"] != total:
            await events.capacity_short(conn, account_id, reservation_id, total, peak["peak"], peak["grant_ids"])
            await conn.execute(q.SET_SHORT_TOTAL, {**keys, "short_total": total})
    elif row["short_total"] is not None:
        await conn.execute(q.SET_SHORT_TOTAL, {**keys, "short_total": None})


async def scan_now(rt: Runtime, caller: Caller, tenant_id: str, account_id: str) -> list[dict[str, Any]]:
    """ProviderAccounts.ScanReservations: the scan of one account, now."""
    await accounts.get(rt, caller, tenant_id, account_id)
    async with db.read_only(rt.pool) as conn:
        account = await accounts.load(conn, account_id)
    try:
        return await scan_account(rt, account)
    except ProviderFailure as exc:
        raise errors.CapacityUnavailable("the provider did not answer; the recorded reservations stand",
                                         accountId=account_id, reason="provider-unavailable",
                                         retryAfterSeconds=int(rt.settings.provider_scan_seconds)) from exc


async def scan_all(rt: Runtime) -> None:
    async with db.read_only(rt.pool) as conn:
        found = await (await conn.execute(q.ACCOUNTS)).fetchall()
    for account in found:
        try:
            await scan_account(rt, account)
        except ProviderFailure as exc:
            log.warning("provider scan failed", account_id=account["id"], kind=exc.kind, error=str(exc))


async def run(rt: Runtime, stop: asyncio.Event) -> None:
    """Scan every account every provider_scan_seconds until `stop` is set."""
    while not stop.is_set():
        try:
            await scan_all(rt)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("provider scan failed; continuing")
        try:
            await asyncio.wait_for(stop.wait(), timeout=rt.settings.provider_scan_seconds)
        except TimeoutError:
            pass
