"""The metering ledger's reconcilers and its tenant read.

usage_records holds one row per (tenant, meter, subject, hour), written once the hour has ended
(metering_settle_seconds ago), under its primary key: a rerun or a second replica writes nothing
twice. Two reconcilers:
- vps.grants: vm.grant.slot.hours for every committed slot of every hour of a grant's term, used
  or not (fractions at the term's ends); a grant's metered_until records how far it went;
- vps.instances: what each instance ran as, from its billing segments: vm.grant.usage.hours
  (informational, inside a grant), vm.reserved.instance.hours (an ordinary slot, or beyond or after
  its grant), vm.ondemand.instance.hours (the reservation gone). Its progress is a row of
  metering_progress, locked while an hour is written. It stops before the hour of a grant start or
  end that is due but not applied yet: applied late, it moves segments back to that moment;
- gpu: gpu.hours for GPU reservations, from active until release, expiry or preemption (nothing
  before a calendar reservation's start, nothing while binding), read through
  controlplane.reservations.usage; within that, each GPU for the time it was booked, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane import db, errors
from controlplane.auth import Caller
from controlplane.common.names import POOL_ID, match
from controlplane.reservations import usage as reservation_usage
from controlplane.runtime import Runtime
from controlplane.vps import access, names
from controlplane.vps import queries as q

log = structlog.get_logger(__name__)

INSTANCES = "vps.instances"
GPU = "gpu"
HOUR = timedelta(hours=1)
HOURS_PER_PASS = 24 * 7  # an instance pass writes at most this many hours (the next pass goes on)


async def meter_grants(rt: Runtime) -> int:
    """One vps.grants pass; returns how many usage rows it wrote."""
    async def work(conn: AsyncConnection) -> int:
        rows = await (await conn.execute(q.METER_GRANTS, {"settle": rt.settings.metering_settle_seconds})).fetchall()
        return rows[0]["written"] if rows else 0

    return await db.run_in_transaction(rt.pool, work)


async def _hourly(rt: Runtime, source: str, first_sql: str,
                  meter_hour: Callable[[AsyncConnection, datetime], Awaitable[None]],
                  last_sql: str = q.LAST_METERABLE_HOUR, settle_seconds: int | None = None) -> int:
    """Every hour of `source` not yet metered that may be, oldest first, under its progress row's
    lock; returns how many hours it wrote. The first hour is `first_sql`'s, the last `last_sql`'s,
    for hours that ended `settle_seconds` ago (default metering_settle_seconds)."""
    settle = {"settle": rt.settings.metering_settle_seconds if settle_seconds is None else settle_seconds}

    async def work(conn: AsyncConnection) -> int:
        last = (await (await conn.execute(last_sql, settle)).fetchone())["hour"]
        first = (await (await conn.execute(first_sql, settle)).fetchone())["hour"]
        if first is None:
            return 0
        await conn.execute(q.INSERT_PROGRESS, {"source": source, "at": first})
        hour: datetime = (await (await conn.execute(q.PROGRESS_FOR_UPDATE, {"source": source})).fetchone())[
            "metered_until"]
        done = 0
        while hour <= last and done < HOURS_PER_PASS:
            await meter_hour(conn, hour)
            hour += HOUR
            done += 1
        await conn.execute(q.SET_PROGRESS, {"source": source, "at": hour})
        return done

    return await db.run_in_transaction(rt.pool, work)


async def meter_instances(rt: Runtime) -> int:
    """One vps.instances pass (from the first billing segment's hour). An hour waits until no grant
    made now may start in it (grant_start_past_seconds): such a grant takes its tenant's instances
    in from its start, and an hour already metered would bill them at the reservation rate beside
    the grant's slot-hours."""
    async def hour(conn: AsyncConnection, at: datetime) -> None:
        await conn.execute(q.METER_INSTANCES_HOUR, {"hour": at})

    settle = max(rt.settings.metering_settle_seconds, rt.settings.grant_start_past_seconds)
    return await _hourly(rt, INSTANCES, q.FIRST_SEGMENT_HOUR, hour, q.INSTANCES_METERABLE_HOUR, settle)


async def meter_gpus(rt: Runtime) -> int:
    """One gpu.hours pass (from the last meterable hour when it first runs: no back-billing)."""
    async def hour(conn: AsyncConnection, at: datetime) -> None:
        for r in await reservation_usage.active_gpu_stretches(conn, at, at + HOUR):
            # Each GPU for the time it was held within the stretch, once (not the stretch times
            # every atom it ever booked: a node lease's GPUs join later, beside MIG instances).
            since, until = max(r["active_from"], at), min(r["active_until"], at + HOUR)
            if since >= until:  # its window overlaps the hour, but a lease deadline passed before
                continue
            held = await (await conn.execute(q.GPU_HOURS_HELD, {"id": r["id"], "from": since, "to": until})).fetchone()
            quantity = held["gpu_hours"]
            if quantity > 0:
                await conn.execute(q.INSERT_USAGE, {
                    "tenant_id": r["tenant_id"], "meter": "gpu.hours", "subject": f"reservation/{r['id']}",
                    "hour": at, "quantity": quantity, "region": r["region"] or "", "pool_id": r["pool_id"],
                    "provider": ""})

    return await _hourly(rt, GPU, q.LAST_METERABLE_HOUR, hour)


async def run_once(rt: Runtime) -> None:
    written = await meter_grants(rt)
    hours = await meter_instances(rt)
    gpu_hours = await meter_gpus(rt)
    if written or hours or gpu_hours:
        log.info("metered", grant_rows=written, instance_hours=hours, gpu_hours=gpu_hours)


async def run(rt: Runtime, stop: asyncio.Event) -> None:
    """The reconcilers, every metering_seconds until `stop` is set."""
    while not stop.is_set():
        try:
            await run_once(rt)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("metering failed; continuing")
        try:
            await asyncio.wait_for(stop.wait(), timeout=rt.settings.metering_seconds)
        except TimeoutError:
            pass


LAST_EPOCH_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: later hours are no hours of a ledger


async def query(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    """The tenant's ledger rows by meter (exact, or a prefix ending in "."), pool and hour range:
    `items` (at most usage_query_max_rows, oldest first), the `total` of every matching row and
    whether rows were left out (`truncated`)."""
    tenant_id = raw.get("tenant_id", "")
    meter = match("meter", raw.get("meter") or "", names.METER)
    pool_id = raw.get("pool_id") or ""
    if pool_id:
        match("poolId", pool_id, POOL_ID)
    from_ms = raw.get("from") or 0
    if not 0 <= from_ms <= LAST_EPOCH_MS:
        raise errors.InvalidInput("from", f"must be epoch ms from 0 to {LAST_EPOCH_MS}")
    to_ms = raw.get("to")
    if to_ms is not None and not from_ms < to_ms <= LAST_EPOCH_MS:
        raise errors.InvalidInput("to", f"must be after from and at most {LAST_EPOCH_MS}")
    await access.on_tenant(rt, caller, tenant_id, access.USAGE_READ)
    async with db.read_only(rt.pool) as conn:
        if to_ms is None:
            to_ms = await db.now_ms(conn) + 3_600_000
        items = await (await conn.execute(q.USAGE, {
            "tenant_id": tenant_id, "meter": meter, "pool_id": pool_id, "from_ms": from_ms, "to_ms": to_ms,
            "limit": rt.settings.usage_query_max_rows})).fetchall()
    if not items:
        return {"items": [], "total": 0.0, "truncated": False}
    return {"items": items, "total": items[0]["window_total"], "truncated": items[0]["window_rows"] > len(items)}
