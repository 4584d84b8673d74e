"""VM instances on a pool's provider reservation, with spec 001's slot rules.

`create` puts the grantee's instance into its grant while the grant has a slot its instances do
not hold; once full, into an ordinary free slot of the reservation; else CAPACITY_UNAVAILABLE.
Others share `total - in use - unused granted slots`; a grant naming a project serves only that
project's instances; a physically full reservation refuses everyone. A grant's stopped instances
keep their slots; other stopped instances hold none (as at the provider). Instances with billing
'none' are never put into a grant and never metered.

The slot is decided under the reservation's row lock and recorded; the provider is then asked
outside the transaction. If it refuses, the row is removed again (its slot freed).
"""

from __future__ import annotations

from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane import db, errors
from controlplane.auth import Caller
from controlplane.common.names import IDEMPOTENCY_KEY, POOL_ID, TENANT_ID, match
from controlplane.ids import new_id, request_hash
from controlplane.runtime import Runtime
from controlplane.vps import access, lifecycle, names, scan
from controlplane.vps import queries as q
from controlplane.vps.provider import Provider, ProviderFailure

log = structlog.get_logger(__name__)

BILLING = ("standard", "none")
# Provider answers that say an instance was not started (not a failure to answer).
REFUSED = ("exhausted", "invalid")


async def slot_for(conn: AsyncConnection, reservation: dict[str, Any], tenant_id: str, project_id: str | None,
                   billing: str, except_id: str = "") -> tuple[str, str | None]:
    """(placement, grant id) for one more running instance of the tenant on the locked reservation."""
    keys = {"account_id": reservation["account_id"], "reservation_id": reservation["reservation_id"]}
    held = await (await conn.execute(q.HELD, {**keys, "except": except_id})).fetchone()
    total = reservation["total"]
    if held["held"] >= total:
        raise errors.CapacityUnavailable("the reservation is full", total=total, inUse=held["held"])
    in_term = await (await conn.execute(q.GRANTS_IN_TERM, keys)).fetchall()
    if billing == "standard":
        for grant in in_term:
            if (grant["tenant_id"] == tenant_id and grant["project_id"] in (None, project_id)
                    and grant["used"] < grant["slots"]):
                return "grant", grant["id"]
    granted = sum(g["slots"] for g in in_term)
    # total - in use - unused granted slots = total - held outside grants - granted slots
    if total - held["outside"] - granted <= 0:
        raise errors.CapacityUnavailable("no free slot of the reservation outside its grants", total=total,
                                         inUse=held["held"], granted=granted)
    return "reserved", None


async def _first_slot(conn: AsyncConnection, spec: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, str | None]]:
    """The pool's reservation of the flavor a new instance goes to, and its slot there: the ready
    reservations tried in turn (one where the caller's grant has a slot to spare first, then by
    id), so one full or all granted leaves the others' free slots to take. Refused as the first
    of them refuses when none has a slot."""
    found = await (await conn.execute(q.POOL_RESERVATIONS_FOR_UPDATE, spec)).fetchall()
    if not found:
        raise errors.InvalidInput("flavor", "no provider reservation of this flavor is bound to the pool",
                                  poolId=spec["pool_id"])
    ready = sorted((r for r in found if r["state"] == "ready"), key=lambda r: (not r["own_grant"], r["reservation_id"]))
    if not ready:
        raise errors.InvalidState("the pool's reservation of this flavor is not ready",
                                  reservationId=found[0]["reservation_id"], reason=found[0]["state"])
    refusal: errors.CapacityUnavailable | None = None
    for reservation in ready:
        try:
            return reservation, await slot_for(conn, reservation, spec["tenant_id"], spec["project_id"], spec["billing"])
        except errors.CapacityUnavailable as exc:
            refusal = refusal or exc
    assert refusal is not None
    raise refusal


def _create_input(raw: dict[str, Any]) -> dict[str, Any]:
    spec = {
        "tenant_id": match("tenantId", raw.get("tenant_id", ""), TENANT_ID),
        "pool_id": match("poolId", raw.get("pool_id", ""), POOL_ID),
        "flavor": match("flavor", raw.get("flavor", ""), names.FLAVOR),
        "name": match("name", raw.get("name", ""), names.NAME),
        "billing": raw.get("billing") or "standard",
        "project_id": None,
    }
    if spec["billing"] not in BILLING:
        raise errors.InvalidInput("billing", f"must be one of {list(BILLING)}")
    if raw.get("project_id") is not None:
        spec["project_id"] = match("projectId", raw["project_id"], names.PROJECT_ID)
    match("idempotencyKey", raw.get("idempotency_key", ""), IDEMPOTENCY_KEY)
    return spec


async def create(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    spec = _create_input(raw)
    key = raw["idempotency_key"]
    digest = request_hash(spec)
    await access.on_tenant(rt, caller, spec["tenant_id"], access.INSTANCES_MANAGE, poolId=spec["pool_id"],
                           flavor=spec["flavor"], billing=spec["billing"])

    async def decide(conn: AsyncConnection) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        # The tenant's creates one at a time: its key and its instance count are read under this.
        await conn.execute(q.TENANT_INSTANCES_LOCK, spec)
        found = await (await conn.execute(q.INSTANCE_BY_KEY, {"tenant_id": spec["tenant_id"], "key": key})).fetchone()
        if found is not None:
            if found["request_hash"] != digest:
                raise errors.Conflict("the idempotency key was used with another request", instanceId=found["id"])
            return found, None, False
        if await (await conn.execute(q.POOL_OFFERED, spec)).fetchone() is None:
            raise errors.NotFound("no such pool", poolId=spec["pool_id"])
        if spec["project_id"] is not None:
            owner = await (await conn.execute(q.PROJECT_TENANT, {"id": spec["project_id"]})).fetchone()
            if owner is None or owner["tenant_id"] != spec["tenant_id"]:
                raise errors.NotFound("no such project", projectId=spec["project_id"])
        live = await (await conn.execute(q.INSTANCES_OF_TENANT, spec)).fetchall()
        if len(live) >= rt.settings.instances_per_tenant:
            raise errors.InvalidState("the tenant has as many instances as it may",
                                      limit=rt.settings.instances_per_tenant)
        reservation, (placement, grant_id) = await _first_slot(conn, spec)
        row = await (await conn.execute(q.INSERT_INSTANCE, {
            **spec, "id": new_id("inst"), "account_id": reservation["account_id"],
            "reservation_id": reservation["reservation_id"], "grant_id": grant_id, "placement": placement,
            "key": key, "request_hash": digest})).fetchone()
        await lifecycle.open_segment(conn, row, None, reservation)
        return row, reservation, True

    row, reservation, new = await db.run_in_transaction(rt.pool, decide)
    if not new and (row["state"] != "running" or row["placement"] == "on-demand"):
        return row
    # A retry asks the provider again (it answers the same name with the same instance), so a
    # create whose first answer was lost, or whose process died after the commit, completes.
    account = await _account_of(rt, row)
    if reservation is None:
        async with db.read_only(rt.pool) as conn:
            reservation = await (await conn.execute(q.RESERVATION, {
                "account_id": row["account_id"], "reservation_id": row["reservation_id"]})).fetchone()
    provider = scan.provider_of(rt, account)
    try:
        await provider.create_instance(account["external_account"], row["id"], row["flavor"],
                                       reservation["region"] if reservation else "", row["reservation_id"])
    except ProviderFailure as exc:
        log.warning("provider refused an instance", instance_id=row["id"], kind=exc.kind, error=str(exc))
        if new:  # its slot is freed again (a retry under the key decides anew), unless a retry made it
            if exc.kind == "unavailable":  # unanswered: the provider may have made it all the same
                # Its row stays, deleted and billed nothing, so a create still on its way that
                # lands after the delete below is known to the scan's drift check, which deletes it.
                stands = await db.run_in_transaction(rt.pool, lambda conn: _given_up(conn, row))
                if stands is None:
                    await _undo_at_provider(provider, account, row["id"])
            else:
                stands = await db.run_in_transaction(rt.pool, lambda conn: _refused(conn, row))
            if stands is not None:  # a retry under its key had the provider's answer meanwhile
                return stands
        raise errors.CapacityUnavailable("the provider did not create the instance", reason=f"provider-{exc.kind}",
                                         reservationId=row["reservation_id"]) from exc
    confirmed = await db.run_in_transaction(rt.pool, lambda conn: _confirmed(conn, row))
    if confirmed is None:  # given up (or deleted) while the provider made it: it must not run
        await _undo_at_provider(provider, account, row["id"])
        raise errors.CapacityUnavailable("the create was given up while the provider made the instance; retry",
                                         reason="provider-unavailable", reservationId=row["reservation_id"])
    return confirmed


async def _confirmed(conn: AsyncConnection, made: dict[str, Any]) -> dict[str, Any] | None:
    """The provider answered the create: the row is confirmed (never given up from now on), or
    None if it was given up or deleted first (its row's lock orders the two)."""
    return await (await conn.execute(q.CONFIRM_INSTANCE, {"id": made["id"]})).fetchone()


async def _given_up(conn: AsyncConnection, made: dict[str, Any]) -> dict[str, Any] | None:
    """A create the provider did not answer: deleted, its segment billing nothing, its key freed;
    None. If a retry under its key had the provider's answer first, it stands: its row."""
    await lifecycle.lock_reservation(conn, made["account_id"], made["reservation_id"])
    if await (await conn.execute(q.GIVE_UP_INSTANCE, {"id": made["id"]})).fetchone() is None:
        return await (await conn.execute(q.INSTANCE, {"id": made["id"]})).fetchone()
    await conn.execute(q.CLOSE_SEGMENT, {"instance_id": made["id"], "at_ms": 0})
    return None


async def _refused(conn: AsyncConnection, made: dict[str, Any]) -> dict[str, Any] | None:
    """A create the provider refused: its row goes (None), unless a retry under its key had the
    provider's answer first (its row)."""
    await lifecycle.lock_reservation(conn, made["account_id"], made["reservation_id"])
    if await (await conn.execute(q.DELETE_INSTANCE_ROW, {"id": made["id"]})).fetchone() is None:
        return await (await conn.execute(q.INSTANCE, {"id": made["id"]})).fetchone()
    return None


async def _undo_at_provider(provider: Provider, account: dict[str, Any], name: str) -> None:
    """Delete what an unanswered create may have made, so no instance runs that no row knows of."""
    try:
        await provider.delete_instance(account["external_account"], name)
    except ProviderFailure as exc:
        if exc.kind != "not-found":
            log.error("an unanswered instance create could not be undone: it may run at the provider",
                      instance_id=name, kind=exc.kind)


async def _account_of(rt: Runtime, row: dict[str, Any]) -> dict[str, Any]:
    async with db.read_only(rt.pool) as conn:
        account = await (await conn.execute(q.ACCOUNT, {"id": row["account_id"]})).fetchone()
    if account is None:
        raise errors.InvalidState("the instance's provider account is gone", accountId=row["account_id"])
    return account


async def _visible(conn: AsyncConnection, tenant_id: str, instance_id: str, *, lock: bool = False) -> dict[str, Any]:
    row = await (await conn.execute(q.INSTANCE_IN_TENANT, {"id": instance_id, "tenant_id": tenant_id})).fetchone()
    if row is None:
        raise errors.NotFound("no such instance", instanceId=instance_id)
    if lock:
        await lifecycle.lock_reservation(conn, row["account_id"], row["reservation_id"])
        row = await (await conn.execute(q.INSTANCE_FOR_UPDATE, {"id": instance_id})).fetchone()
    return row


async def get(rt: Runtime, caller: Caller, tenant_id: str, instance_id: str) -> dict[str, Any]:
    match("instanceId", instance_id, names.INSTANCE_ID)
    await access.on_tenant(rt, caller, tenant_id, access.INSTANCES_READ)
    async with db.read_only(rt.pool) as conn:
        return await _visible(conn, tenant_id, instance_id)


async def list_(rt: Runtime, caller: Caller, tenant_id: str) -> list[dict[str, Any]]:
    await access.on_tenant(rt, caller, tenant_id, access.INSTANCES_READ)
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(q.INSTANCES_OF_TENANT, {"tenant_id": tenant_id})).fetchall()


async def _change(rt: Runtime, caller: Caller, tenant_id: str, instance_id: str, action: str) -> dict[str, Any]:
    match("instanceId", instance_id, names.INSTANCE_ID)
    await access.on_tenant(rt, caller, tenant_id, access.INSTANCES_MANAGE, instanceId=instance_id)

    async def work(conn: AsyncConnection) -> tuple[dict[str, Any], bool, dict[str, Any] | None]:
        row = await _visible(conn, tenant_id, instance_id, lock=True)
        account = await (await conn.execute(q.ACCOUNT, {"id": row["account_id"]})).fetchone()
        if row["state"] == "deleted":
            if action == "delete":
                return row, False, account
            raise errors.InvalidState("the instance is deleted", instanceId=instance_id)
        if action != "delete" and account is None:
            raise errors.InvalidState("the instance's provider account is gone", accountId=row["account_id"],
                                      instanceId=instance_id)
        if action == "stop":
            if row["state"] == "stopped":
                return row, False, account
            await conn.execute(q.CLOSE_SEGMENT, {"instance_id": instance_id, "at_ms": None})
            return await _set(conn, row, "stopped", row["grant_id"], row["placement"]), True, account
        if action == "delete":
            await conn.execute(q.CLOSE_SEGMENT, {"instance_id": instance_id, "at_ms": None})
            return await _set(conn, row, "deleted", None, row["placement"] if row["placement"] != "grant"
                              else "reserved"), True, account
        if row["state"] == "running":
            return row, False, account
        return await _restart(conn, row), True, account

    row, changed, account = await db.run_in_transaction(rt.pool, work)
    if account is None:  # a delete whose account is gone: there is no provider to ask, the row is deleted
        return row
    # The provider is asked even when the row was already so: its calls are idempotent, and a
    # retry after a failed or lost answer brings the provider in line with the row.
    call = {"stop": "stop_instance", "start": "start_instance", "delete": "delete_instance"}[action]
    try:
        await getattr(scan.provider_of(rt, account), call)(account["external_account"], row["id"])
    except ProviderFailure as exc:
        if action == "start" and exc.kind in REFUSED:
            # The provider refused to run it: it stays stopped, and a start just recorded bills nothing.
            row = await db.run_in_transaction(rt.pool, lambda conn: _refused_start(conn, row, changed))
        if exc.kind != "not-found" or action != "delete":
            # The slot decision stands (it is ours); the provider's side is retried by the caller.
            log.warning("provider call failed", instance_id=row["id"], call=call, kind=exc.kind)
            raise errors.CapacityUnavailable("the provider did not answer; retry", reason=f"provider-{exc.kind}",
                                             instanceId=row["id"], retryAfterSeconds=5) from exc
    return row


async def _refused_start(conn: AsyncConnection, started: dict[str, Any], changed: bool) -> dict[str, Any]:
    """Stop again an instance whose start the provider refused, keeping the slot as a stop does;
    its billing segment ends where it began when this start opened it."""
    row = await _visible(conn, started["tenant_id"], started["id"], lock=True)
    if row["state"] != "running":
        return row
    await conn.execute(q.CLOSE_SEGMENT, {"instance_id": row["id"], "at_ms": 0 if changed else None})
    return await _set(conn, row, "stopped", row["grant_id"], row["placement"])


async def _set(conn: AsyncConnection, row: dict[str, Any], state: str, grant_id: str | None,
               placement: str) -> dict[str, Any]:
    return await (await conn.execute(q.SET_INSTANCE, {"id": row["id"], "state": state, "grant_id": grant_id,
                                                      "placement": placement})).fetchone()


async def _restart(conn: AsyncConnection, row: dict[str, Any]) -> dict[str, Any]:
    """A stopped instance runs again: in its grant while the grant is in its term (its slot was
    kept), else it needs a slot again as a new instance would (its grant's end, handled late or
    not yet, is no slot: its minutes from endsAt are not the grant's)."""
    reservation = await (await conn.execute(q.RESERVATION, {"account_id": row["account_id"],
                                                            "reservation_id": row["reservation_id"]})).fetchone()
    if row["placement"] == "on-demand" or reservation is None or reservation["state"] == "gone":
        row = await _set(conn, row, "running", None, "on-demand")
    elif row["grant_id"] is not None and await _in_term(conn, row["grant_id"]):
        row = await _set(conn, row, "running", row["grant_id"], "grant")
    else:
        placement, grant_id = await slot_for(conn, reservation, row["tenant_id"], row["project_id"], row["billing"],
                                             except_id=row["id"])
        row = await _set(conn, row, "running", grant_id, placement)
    await lifecycle.open_segment(conn, row, None, reservation)
    return row


async def _in_term(conn: AsyncConnection, grant_id: str) -> bool:
    return await (await conn.execute(q.GRANT_IN_TERM, {"id": grant_id})).fetchone() is not None


async def stop(rt: Runtime, caller: Caller, tenant_id: str, instance_id: str) -> dict[str, Any]:
    return await _change(rt, caller, tenant_id, instance_id, "stop")


async def start(rt: Runtime, caller: Caller, tenant_id: str, instance_id: str) -> dict[str, Any]:
    return await _change(rt, caller, tenant_id, instance_id, "start")


async def delete(rt: Runtime, caller: Caller, tenant_id: str, instance_id: str) -> dict[str, Any]:
    return await _change(rt, caller, tenant_id, instance_id, "delete")
