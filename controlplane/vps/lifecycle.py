"""A grant's states, driven by the work queue at startsAt and endsAt (and by end, the
reservation scan and tenant deletion): scheduled -> active -> ended, or scheduled -> cancelled.

Every transition runs in the caller's transaction, with the provider reservation's row locked
first (lock order: provider reservation -> grants -> instances), and publishes its event there.
A starting grant takes in its tenant's instances running on the reservation outside any grant,
oldest first, from its start; an ending grant hands its instances to a renewal (another live grant
of the tenant on the reservation) up to its free slots, the rest fall to the reservation rate.
Both re-class the instances' billing segments from startsAt or endsAt on (`reclass`), so a start
or end handled late bills every minute run since once, at the rate of its moment.
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


async def reclass(conn: AsyncConnection, instance_id: str, was: tuple[str, str | None], at_ms: int,
                  into: tuple[str, str | None]) -> None:
    """From `at_ms` on, the instance's minutes billed as `was` (class, grant id) are billed as
    `into`: a segment spanning `at_ms` is split there, later ones change. A start or end applied
    late (a start in the past, a late worker) so re-classes whatever ran since, closed or open."""
    keys = {"instance_id": instance_id, "was": was[0], "was_grant": was[1], "at_ms": at_ms,
            "class": into[0], "grant_id": into[1]}
    await conn.execute(q.RECLASS_SEGMENTS, keys)
    await conn.execute(q.SPLIT_SEGMENT, keys)


async def take_in(conn: AsyncConnection, grant: dict[str, Any], at_ms: int) -> int:
    """The tenant's instances that ran on the reservation at the reservation rate after `at_ms`,
    oldest first, up to the grant's free slots: their reservation-rate minutes from `at_ms` are the
    grant's, whether they run so now or were stopped, deleted or started again since (a start in
    the past, or a late worker); one running or stopped outside any grant joins it (a grant's
    stopped instance keeps its slot). Returns how many took a slot."""
    free = grant["slots"] - await used(conn, grant["id"])
    found = await (await conn.execute(q.RESERVED_SINCE, {
        "tenant_id": grant["tenant_id"], "account_id": grant["account_id"],
        "reservation_id": grant["reservation_id"], "project_id": grant["project_id"], "at_ms": at_ms})).fetchall()
    taken = 0
    for instance in found:
        if instance["grant_id"] != grant["id"]:  # not started again since, into this grant by its time
            if free <= 0:
                continue
            free -= 1
            taken += 1
        await reclass(conn, instance["id"], ("reserved", None), at_ms, ("grant", grant["id"]))
        if instance["grant_id"] is None and instance["placement"] == "reserved" and instance["state"] != "deleted":
            await conn.execute(q.SET_INSTANCE, {"id": instance["id"], "state": instance["state"],
                                                "grant_id": grant["id"], "placement": "grant"})
    return taken


async def hand_over(conn: AsyncConnection, grant: dict[str, Any], at_ms: int) -> None:
    """An ended grant's instances from `at_ms` on: to a renewal live then up to its free slots (a
    scheduled renewal due by now is activated after), else to the reservation rate. A running one
    moves with its minutes, a stopped one leaves the grant and holds no slot; the minutes of those
    that ran in it after `at_ms` (a late worker) are re-classed alike. The tenant's grants that
    started after `at_ms` and are active already (their start handled before this late end) then
    take in, from their start, what this left outside any grant."""
    keys = {"tenant_id": grant["tenant_id"], "account_id": grant["account_id"],
            "reservation_id": grant["reservation_id"], "grant_id": grant["id"], "id": grant["id"], "at_ms": at_ms}
    instances = await (await conn.execute(q.GRANT_INSTANCES_SINCE, keys)).fetchall()
    following = await (await conn.execute(q.NEXT_GRANTS, keys)).fetchall()
    renewals = [g for g in following if g["starts_ms"] <= at_ms]
    free = {r["id"]: r["slots"] - await used(conn, r["id"]) for r in renewals}
    for instance in instances:
        target = next((r for r in renewals if free[r["id"]] > 0 and instance["ran_since"]
                       and r["project_id"] in (None, instance["project_id"])), None)
        if target is not None:
            free[target["id"]] -= 1
        into = ("reserved", None) if target is None else ("grant", target["id"])
        await reclass(conn, instance["id"], ("grant", grant["id"]), at_ms, into)
        if instance["grant_id"] == grant["id"]:
            running = instance["state"] == "running"
            await conn.execute(q.SET_INSTANCE, {"id": instance["id"], "state": instance["state"],
                                                "grant_id": into[1] if running else None,
                                                "placement": into[0] if running else "reserved"})
    now = await now_ms(conn)
    for renewal in renewals:
        if renewal["state"] == "scheduled" and renewal["starts_ms"] <= now:
            await advance(conn, renewal, now)
    for later in following:
        if later["starts_ms"] > at_ms and later["state"] == "active":
            await take_in(conn, later, later["starts_ms"])


async def reservation_gone(conn: AsyncConnection, reservation: dict[str, Any], now: int) -> None:
    """The provider stopped reporting the (locked) reservation. What was due before now is applied
    first, as the worker would have (a start takes its instances in, an end hands them over at
    endsAt); then its grants still active end now and its scheduled ones are cancelled (reason
    reservation-gone), and its instances go on demand from now."""
    grants = await (await conn.execute(q.GRANTS_ON_RESERVATION_FOR_UPDATE, {
        "account_id": reservation["account_id"], "reservation_id": reservation["reservation_id"]})).fetchall()
    for found in grants:
        # Read again: an earlier grant's hand-over may have activated or ended this one.
        grant = await advance(conn, await (await conn.execute(q.GRANT, {"id": found["id"]})).fetchone(), now)
        if grant["state"] == "scheduled":
            await finish(conn, grant, "cancelled", "reservation-gone", None)
        elif grant["state"] == "active":
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
