"""Reading reservations: get and list. Drafts are internal: get answers NOT_FOUND, list skips them."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import authorize, db, errors, iam
from controlplane.auth import Caller
from controlplane.reservations import queries, states
from controlplane.common import pages
from controlplane.common.names import POOL_ID, RESERVATION_ID, TENANT_ID, match
from controlplane.runtime import Runtime


async def load_view(conn: AsyncConnection, rid: str) -> dict[str, Any]:
    """The reservation with its allocations: one statement (in autocommit, one round trip)."""
    row = await (await conn.execute(queries.VIEW_BY_ID, {"id": rid})).fetchone()
    if row is None:
        raise errors.NotFound("no such reservation", reservationId=rid)
    return row


async def fetch_view(rt: Runtime, rid: str) -> dict[str, Any]:
    """load_view on a connection of its own, in autocommit."""
    return await db.run_autocommit(rt.pool, lambda conn: load_view(conn, rid))


async def with_allocations(conn: AsyncConnection, row: dict[str, Any]) -> dict[str, Any]:
    row["allocations"] = await (await conn.execute(queries.ALLOCATIONS, {"id": row["id"]})).fetchall()
    return row


def resource_attributes(row: dict[str, Any]) -> dict[str, Any]:
    return {"tenantId": row["tenant_id"], "ownerIdentityId": row["owner_identity_id"],
            "poolId": row["pool_id"], "state": row["state"]}


async def authorize_on(rt: Runtime, caller: Caller, action: str, row: dict[str, Any]) -> None:
    """Decide `action` on an existing reservation, read before (its transaction closed): the
    policy is read in a transaction of its own and the decision is taken outside any."""
    await authorize.require(rt.pool, caller, row["tenant_id"], action, "Reservation", row["id"],
                            resource_attributes(row), reservationId=row["id"])


async def find_visible(conn: AsyncConnection, caller: Caller, tenant_id: str, rid: str) -> dict[str, Any]:
    match("tenantId", tenant_id, TENANT_ID)
    match("reservationId", rid, RESERVATION_ID)
    caller.require_member(tenant_id)
    row = await (
        await conn.execute(queries.BY_ID_IN_TENANT, {"id": rid, "tenant_id": tenant_id})
    ).fetchone()
    if row is None:
        raise errors.NotFound("no such reservation", reservationId=rid)
    return row


async def get(rt: Runtime, caller: Caller, tenant_id: str, rid: str) -> dict[str, Any]:
    async with db.read_only(rt.pool) as conn:
        row = await with_allocations(conn, await find_visible(conn, caller, tenant_id, rid))
    await authorize_on(rt, caller, iam.READ, row)
    return row


# A listing examines at most this many reservations for the ones the caller may read; a page cut
# short by it ends with a cursor to go on from.
LIST_SCAN_CAP = 1000

SUBJECT_PREFIX = "reservation/"  # an event about a reservation: subject reservation/<id>


def subject_of(event: dict[str, Any]) -> str | None:
    """The id of the reservation an event (or a delivery of one) is about; None if none."""
    subject = str(event["subject"])
    return subject[len(SUBJECT_PREFIX):] if subject.startswith(SUBJECT_PREFIX) else None


def readable_events(policy: str | None, caller: Caller, tenant_id: str, events: list[dict[str, Any]]) -> list[bool]:
    """For each event (or delivery) row, whether the caller may read it beyond the events
    decision: one about a reservation only when it may read that reservation as get decides (one
    gone or a draft: not), so events tell no more than reading their reservations would; others,
    yes. Each row carries its reservation's columns (queries.EVENT_RESERVATION_COLUMNS, joined by
    queries.event_reservation_join); the reservations are decided in one Cedar batch, no
    transaction open."""
    subjects = {rid: {"tenant_id": tenant_id, "owner_identity_id": e["reservation_owner"],
                      "pool_id": e["reservation_pool"], "state": e["reservation_state"]}
                for e in events if (rid := subject_of(e)) is not None and e["reservation_state"] is not None}
    ids = list(subjects)
    allowed = authorize.allowed_each(policy, caller, iam.READ, "Reservation",
                                     [(i, resource_attributes(subjects[i])) for i in ids],
                                     tenant_id=tenant_id) if ids else []
    ok = {i for i, yes in zip(ids, allowed) if yes}
    return [(rid := subject_of(e)) is None or rid in ok for e in events]


async def list_(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """A page of the tenant's reservations (the caller's own, scope 'mine'), newest first. The
    listing is decided as compute:reservations:list on the tenant, and each reservation as Get
    decides it (compute:reservations:read): one the caller may not read is left out, so a listing
    tells no more than reading its items would. The cursor is the last reservation examined."""
    tenant_id, scope, params, cursor = _listing(caller, raw)
    policy = await authorize.fetch_policy(rt.pool, tenant_id)
    authorize.check(policy, caller, tenant_id, iam.LIST, "Tenant", tenant_id, {"scope": scope},
                    message="IAM refused this listing", tenantId=tenant_id)
    limit = params["limit"]

    async def more(after: str | None) -> list[dict[str, Any]]:
        async with db.read_only(rt.pool) as conn:
            return await (await conn.execute(queries.LIST, {**params, "cursor": after})).fetchall()

    def allowed(rows: list[dict[str, Any]]) -> list[bool]:
        return authorize.allowed_each(policy, caller, iam.READ, "Reservation",
                                      [(row["id"], resource_attributes(row)) for row in rows], tenant_id=tenant_id)

    return await pages.filtered(await more(cursor), more, allowed, lambda row: row["id"],
                                limit=limit, cap=LIST_SCAN_CAP, end="")


def _listing(caller: Caller, raw: dict[str, Any]) -> tuple[str, str, dict[str, Any], str | None]:
    """A listing's tenant, scope, query parameters and cursor, checked."""
    tenant_id = match("tenantId", raw.get("tenant_id", ""), TENANT_ID)
    caller.require_member(tenant_id)
    scope = raw.get("scope") or "mine"
    if scope not in ("mine", "all"):
        raise errors.InvalidInput("scope", "must be 'mine' or 'all'")
    limit = raw.get("limit") or 50
    if not 1 <= limit <= 200:
        raise errors.InvalidInput("limit", "must be 1 to 200")
    wanted = list(raw.get("states") or [])
    for s in wanted:
        if s not in states.TRANSITIONS or s in states.INTERNAL:
            raise errors.InvalidInput("states", f"unknown state {s!r}")
    cursor = raw.get("cursor") or None
    if cursor is not None:
        match("cursor", cursor, RESERVATION_ID)
    pool_id = raw.get("pool_id") or ""
    if pool_id:
        match("poolId", pool_id, POOL_ID)
    params = {"tenant_id": tenant_id, "owner": caller.identity_id if scope == "mine" else None,
              "states": wanted, "pool_id": pool_id, "limit": limit}
    return tenant_id, scope, params, cursor
