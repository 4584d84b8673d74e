"""reservation-grant.* events (DESIGN section 18): in the grantee's tenant, subject
reservation-grant/<id>, data { grantId, poolId, projectId?, slots, startsAt, endsAt, state, reason? }."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import events
from controlplane.bootstrap import ROOT_TENANT


async def grant_event(conn: AsyncConnection, grant: dict[str, Any], type_: str) -> None:
    data: dict[str, Any] = {"grantId": grant["id"], "poolId": grant["pool_id"], "slots": grant["slots"],
                            "startsAt": grant["starts_ms"], "endsAt": grant["ends_ms"], "state": grant["state"]}
    if grant["project_id"]:
        data["projectId"] = grant["project_id"]
    if grant["reason"] and type_ in ("reservation-grant.ended", "reservation-grant.cancelled"):
        data["reason"] = grant["reason"]
    await events.emit(conn, grant["tenant_id"], type_, f"reservation-grant/{grant['id']}", data)


async def capacity_short(conn: AsyncConnection, account_id: str, reservation_id: str, total: int,
                         granted: int, grant_ids: list[str]) -> None:
    """In the platform's tenant: root decides which grants to end."""
    await events.emit(conn, ROOT_TENANT, "reservation-grant.capacity-short",
                      f"provider-reservation/{account_id}/{reservation_id}",
                      {"accountId": account_id, "reservationId": reservation_id, "total": total,
                       "grantedSlots": granted, "grantIds": grant_ids})
