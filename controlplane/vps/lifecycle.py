"""A grant's states, driven by the work queue at startsAt and endsAt (and by end, the
reservation scan and tenant deletion): scheduled -> active -> ended, or scheduled -> cancelled.

Every transition runs in the caller's transaction, with the provider reservation's row locked
first (lock order: provider reservation -> grants -> instances), and publishes its event there.
A starting grant takes in its tenant's instances running on the reservation outside any grant,
oldest first, from its start; an ending grant hands its instances to a renewal (another live grant
of the tenant on the reservation) up to its free slots, the rest fall to the reservation rate.
"""

from __future__ import annotations

from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane import db
from controlplane.runtime import Runtime
from controlplane.vps import events
from controlplane.vps import queries as q

log = structlog.get_logger(__name__)

KIND = "grant"


async def now_ms(conn: AsyncConnection) -> int:
    return await db.now_ms(conn)


async def lock_reservation(conn: AsyncConnection, account_id: str, reservation_id: str) -> dict[str, Any] | None:
    return await (await conn.execute(q.RESERVATION_FOR_UPDATE, {"account_id": account_id,
                                                                 "reservation_id": reservation_id})).fetchone()


async def reconcile(conn: AsyncConnection, rt: Runtime, grant_id: str) -> None:
    """The work queue's handler for kind 'grant': act on whatever is due now."""
    found = await (await conn.execute(q.GRANT, {"id": grant_id})).fetchone()
    if found is None:
        return  # its account was deleted
    await lock_reservation(conn, found["account_id"], found["reservation_id"])
    grant = await (await conn.execute(q.GRANT_FOR_UPDATE, {"id": grant_id})).fetchone()
    await advance(conn, grant, await now_ms(conn))


async def advance(conn: AsyncConnection, grant: dict[str, Any], now: int) -> dict[str, Any]:
    """Apply the transitions due at `now` to a locked grant."""
    if grant["state"] == "scheduled" and grant["starts_ms"] <= now:
        grant = await activate(conn, grant)
    if grant["state"] == "active" and grant["ends_ms"] <= now:
        grant = await finish(conn, grant, "ended", "term", None)
    return grant


async def _set(conn: AsyncConnection, grant: dict[str, Any], state: str, reason: str | None,
               ends_ms: int | None) -> dict[str, Any]:
    return await (await conn.execute(q.SET_GRANT_STATE, {"id": grant["id"], "state": state, "reason": reason,
                                                           "ends_ms": ends_ms})).fetchone()


async def activate(conn: AsyncConnection, grant: dict[str, Any]) -> dict[str, Any]:
    grant = await _set(conn, grant, "active", None, None)
    await events.grant_event(conn, grant, "reservation-grant.active")
    await take_in(conn, grant, grant["starts_ms"])
    log.info("grant active", grant_id=grant["id"], tenant=grant["tenant_id"])
    return grant


async def finish(conn: AsyncConnection, grant: dict[str, Any], state: str, reason: str,
                 ends_ms: int | None, *, hand_over_instances: bool = True) -> dict[str, Any]:
    """ended (its instances handed over at endsAt) or cancelled."""
    grant = await _set(conn, grant, state, reason, ends_ms)
    await events.grant_event(conn, grant, f"reservation-grant.{state}")
    if state == "ended" and hand_over_instances:
        await hand_over(conn, grant, grant["ends_ms"])
    log.info(f"grant {state}", grant_id=grant["id"], tenant=grant["tenant_id"], reason=reason)
    return grant


async def end_now(conn: AsyncConnection, grant: dict[str, Any], now: int, reason: str) -> dict[str, Any]:
    """End a locked grant now, as `end` does: not started yet -> cancelled; in its term -> ended
    with endsAt now (never later); already ended or cancelled -> unchanged."""
    if grant["state"] in ("ended", "cancelled"):
        return grant
    if grant["starts_ms"] > now:
        return await finish(conn, grant, "cancelled", reason, None)
    if grant["state"] == "scheduled":
        grant = await activate(conn, grant)
    return await finish(conn, grant, "ended", reason, now)


async def used(conn: AsyncConnection, grant_id: str) -> int:
    return (await (await conn.execute(q.GRANT_USED, {"grant_id": grant_id})).fetchone())["used"]


async def move(conn: AsyncConnection, instance: dict[str, Any], placement: str, grant_id: str | None,
               at_ms: int | None, reservation: dict[str, Any] | None = None) -> dict[str, Any]:
    """Put an instance into a grant, an ordinary slot or on demand from `at_ms`: its open billing
    segment ends there and one of the new class starts (billing 'none' instances have none)."""
    row = await (await conn.execute(q.SET_INSTANCE, {"id": instance["id"], "state": instance["state"],
                                                      "grant_id": grant_id, "placement": placement})).fetchone()
    closed = await (await conn.execute(q.CLOSE_SEGMENT, {"instance_id": instance["id"], "at_ms": at_ms})).fetchone()
    if closed is not None:
        await open_segment(conn, row, closed["ended_ms"], reservation)
    return row


async def open_segment(conn: AsyncConnection, instance: dict[str, Any], at_ms: int | None,
                       reservation: dict[str, Any] | None = None) -> None:
    if instance["billing"] != "standard" or instance["state"] != "running":
        return
    if reservation is None:
        reservation = await (await conn.execute(q.RESERVATION, {
            "account_id": instance["account_id"], "reservation_id": instance["reservation_id"]})).fetchone()
    account = await (await conn.execute(q.ACCOUNT_OF_RESERVATION, {"id": instance["account_id"]})).fetchone()
    await conn.execute(q.OPEN_SEGMENT, {
        "instance_id": instance["id"], "tenant_id": instance["tenant_id"], "class": instance["placement"],
        "grant_id": instance["grant_id"], "pool_id": instance["pool_id"],
        "region": reservation["region"] if reservation else "", "provider": account["provider"] if account else "",
        "at_ms": at_ms})


async def take_in(conn: AsyncConnection, grant: dict[str, Any], at_ms: int) -> int:
    """The tenant's instances that ran on the reservation outside any grant at `at_ms`, oldest
    first, up to the grant's free slots, from `at_ms`: those running so now, and those stopped,
    deleted or started again since (a start in the past, or a late worker), whose reservation-rate
    minutes from `at_ms` are the grant's. Returns how many took a slot."""
    free = grant["slots"] - await used(conn, grant["id"])
    keys = {"tenant_id": grant["tenant_id"], "account_id": grant["account_id"],
            "reservation_id": grant["reservation_id"], "project_id": grant["project_id"], "at_ms": at_ms}
    running = await (await conn.execute(q.OUTSIDE_ANY_GRANT, {**keys, "limit": max(free, 0)})).fetchall()
    since = await (await conn.execute(q.RESERVED_AT, keys)).fetchall()
    segment = {row["id"]: row["segment_id"] for row in since}
    found = sorted({row["id"]: row for row in (*since, *running)}.values(), key=lambda r: (r["created_ms"], r["id"]))
    taken = 0
    for instance in found:
        mine = instance["grant_id"] == grant["id"]  # started again since, into this grant by its time
        if not mine:
            if free <= 0:
                continue
            free -= 1
            taken += 1
        if instance["id"] in segment:
            await conn.execute(q.SPLIT_SEGMENT, {"segment_id": segment[instance["id"]], "at_ms": at_ms,
                                                 "class": "grant", "grant_id": grant["id"]})
        if mine or instance["grant_id"] is not None or instance["placement"] != "reserved":
            continue
        if instance["state"] == "running":
            await move(conn, instance, "grant", grant["id"], at_ms)
        elif instance["state"] == "stopped":  # a grant's stopped instance keeps its slot
            await conn.execute(q.SET_INSTANCE, {"id": instance["id"], "state": "stopped", "grant_id": grant["id"],
                                                "placement": "grant"})
    return taken


async def hand_over(conn: AsyncConnection, grant: dict[str, Any], at_ms: int) -> None:
    """An ended grant's running instances: to a renewal live at `at_ms` up to its free slots (a
    scheduled renewal due by then is activated after), else to the reservation rate."""
    instances = await (await conn.execute(q.OF_GRANT, {"grant_id": grant["id"]})).fetchall()
    renewals = await (await conn.execute(q.RENEWALS, {
        "tenant_id": grant["tenant_id"], "account_id": grant["account_id"],
        "reservation_id": grant["reservation_id"], "id": grant["id"], "at_ms": at_ms})).fetchall()
    free = {r["id"]: r["slots"] - await used(conn, r["id"]) for r in renewals}
    for instance in instances:
        # Running instances only: a stopped one leaves with the grant and holds no slot.
        target = next((r for r in renewals if free[r["id"]] > 0 and instance["state"] == "running"
                       and r["project_id"] in (None, instance["project_id"])), None)
        if target is None:
            await move(conn, instance, "reserved", None, at_ms)
            continue
        free[target["id"]] -= 1
        await move(conn, instance, "grant", target["id"], at_ms)
    # Instances stopped or deleted after `at_ms` (a late worker): their minutes from then are no
    # longer the grant's, so not paid by its slot-hours: a renewal's free slot's, else at the
    # reservation rate.
    since = await (await conn.execute(q.GRANT_SEGMENTS_AT, {"grant_id": grant["id"], "at_ms": at_ms})).fetchall()
    for segment in since:
        target = next((r for r in renewals if free[r["id"]] > 0 and r["project_id"] in (None, segment["project_id"])),
                      None)
        if target is not None:
            free[target["id"]] -= 1
        await conn.execute(q.SPLIT_SEGMENT, {"segment_id": segment["id"], "at_ms": at_ms,
                                             "class": "reserved" if target is None else "grant",
                                             "grant_id": None if target is None else target["id"]})
    now = await now_ms(conn)
    for renewal in renewals:
        if renewal["state"] == "scheduled" and renewal["starts_ms"] <= now:
            await advance(conn, renewal, now)


async def reservation_gone(conn: AsyncConnection, reservation: dict[str, Any], now: int) -> None:
    """The provider stopped reporting the (locked) reservation: its active grants end now and its
    scheduled ones are cancelled (reason reservation-gone); its instances go on demand."""
    grants = await (await conn.execute(q.GRANTS_ON_RESERVATION_FOR_UPDATE, {
        "account_id": reservation["account_id"], "reservation_id": reservation["reservation_id"]})).fetchall()
    for grant in grants:
        if grant["starts_ms"] > now:
            await finish(conn, grant, "cancelled", "reservation-gone", None)
        else:
            if grant["state"] == "scheduled":
                grant = await activate(conn, grant)
            await finish(conn, grant, "ended", "reservation-gone", now, hand_over_instances=False)
    instances = await (await conn.execute(q.ON_RESERVATION, {
        "account_id": reservation["account_id"], "reservation_id": reservation["reservation_id"]})).fetchall()
    for instance in instances:
        if instance["placement"] != "on-demand":
            await move(conn, instance, "on-demand", None, now, reservation)


async def end_for_tenant(conn: AsyncConnection, tenant_id: str) -> list[dict[str, Any]]:
    """A deleted tenant's grants: active ones end now, scheduled ones are cancelled
    (reason tenant-deleted). For the tenant deletion to call in its transaction."""
    done = []
    for found in await (await conn.execute(q.LIVE_GRANTS_OF_TENANT, {"tenant_id": tenant_id})).fetchall():
        await lock_reservation(conn, found["account_id"], found["reservation_id"])
        grant = await (await conn.execute(q.GRANT_FOR_UPDATE, {"id": found["id"]})).fetchone()
        done.append(await end_now(conn, grant, await now_ms(conn), "tenant-deleted"))
    return done
