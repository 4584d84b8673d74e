"""The live-drafts cap per identity (DESIGN.md 7a): an identity holds at most
max_drafts_per_identity unfinished creates (drafts, and requests awaiting confirmation) until the
retention window deletes them or their confirmation ends. Transaction 1 refuses early from its
count (`require`), and the draft's insert holds the cap under concurrency (`insert`)."""

from __future__ import annotations

import math
from typing import Any

import psycopg
from psycopg import AsyncConnection

from controlplane import db_errors, errors
from controlplane.reservations import queries
from controlplane.runtime import Runtime


def require(rt: Runtime, live: dict[str, Any]) -> None:
    """An identity holds at most max_drafts_per_identity drafts (refused or in-flight creates, and
    requests awaiting confirmation) until the retention window deletes them or their confirmation
    ends: QUOTA_EXCEEDED, retryable after the window.
    `live`: its drafts as LIVE_DRAFTS counts them."""
    cap = rt.settings.max_drafts_per_identity
    if live["n"] >= cap:
        raise errors.QuotaExceeded(
            f"this identity has {cap} unfinished create requests; retry one of their keys or wait for them to expire",
            reason="draft-limit", limit=cap,
            retryAfterSeconds=max(1, live["expires_in_s"] + math.ceil(rt.settings.draft_sweep_seconds)),
        )


async def insert(conn: AsyncConnection, rt: Runtime, live: dict[str, Any],
                 params: dict[str, Any]) -> dict[str, Any] | None:
    """The draft and its IAM attributes, inserted in one statement that holds the identity's
    live-drafts cap under its lock (draft_room, migration 0046): shared while transaction 1's count
    left room for every backend, so creates far from the cap do not wait for each other;
    exclusive near it. A shared insert that finds the identity near the cap after all runs again
    as near (a second round trip, only at the cap's edge). None: a concurrent twin's draft."""
    cap = rt.settings.max_drafts_per_identity
    seen = live["n"]
    while True:
        try:
            return await (await conn.execute(queries.INSERT_DRAFT_WITH_AUTHZ,
                                             {**params, "cap": cap, "seen": seen})).fetchone()
        except psycopg.errors.IntegrityError as exc:
            if db_errors.violates(exc, db_errors.OWNER_OFFBOARDED):  # since the call authenticated
                raise errors.Unauthenticated("this identity was offboarded",
                                             identityId=params["identity_id"]) from None
            if db_errors.violates(exc, db_errors.OWNER_NOT_MEMBER):  # removed from the tenant since
                raise errors.AccessDenied("the caller is not a member of this tenant",
                                          tenantId=params["tenant_id"]) from None
            if db_errors.violates(exc, db_errors.DRAFT_ROOM_NEAR) and seen < cap:
                seen = cap
                continue
            if db_errors.violates(exc, db_errors.DRAFT_ROOM):  # concurrent creates took the room
                require(rt, {**live, "n": cap})
            raise
