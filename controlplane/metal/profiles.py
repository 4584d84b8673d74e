"""Node profiles: what a leased machine runs, registered by operators (the Admin API, root only).

A profile has an id and a description; each version names an image and its checksum and never
changes once registered (a lease pins the version it deploys). Registering the same thing again
changes nothing, so an operator's retry is safe; a version registered again with another image or
checksum is CONFLICT.
"""

from __future__ import annotations

import re
from typing import Any

from psycopg import AsyncConnection

from controlplane import db, errors
from controlplane.common.names import match
from controlplane.metal import queries
from controlplane.runtime import Runtime

PROFILE_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# An OCI reference or a URL: no spaces, quotes or control characters.
IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=%~?&#-]{0,511}$")
CHECKSUM = re.compile(r"^sha256:[0-9a-f]{64}$")
MAX_VERSION = 1_000_000
MAX_DESCRIPTION = 1024


def _version(field: str, value: Any) -> int:
    if not isinstance(value, int) or not 1 <= value <= MAX_VERSION:
        raise errors.InvalidInput(field, f"must be 1 to {MAX_VERSION}")
    return value


async def create(rt: Runtime, profile_id: str, description: str) -> dict[str, Any]:
    match("id", profile_id, PROFILE_ID)
    if len(description) > MAX_DESCRIPTION:
        raise errors.InvalidInput("description", f"is at most {MAX_DESCRIPTION} characters")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        existing = await _one(conn, profile_id)
        if existing is not None:
            return existing
        cap = rt.settings.node_profiles_max
        await conn.execute(queries.PROFILES_LOCK)
        if (await (await conn.execute(queries.PROFILE_COUNT)).fetchone())["n"] >= cap:
            raise errors.QuotaExceeded(f"at most {cap} node profiles", reason="profile-limit", limit=cap)
        await conn.execute(queries.INSERT_PROFILE, {"id": profile_id, "description": description})
        found = await _one(conn, profile_id)
        assert found is not None
        return found

    return await db.run_in_transaction(rt.pool, work)


async def add_version(rt: Runtime, profile_id: str, version: int, image: str, checksum: str) -> dict[str, Any]:
    match("profileId", profile_id, PROFILE_ID)
    _version("version", version)
    match("image", image, IMAGE)
    match("checksum", checksum, CHECKSUM)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        params = {"id": profile_id, "version": version, "image": image, "checksum": checksum}
        if await (await conn.execute(queries.LOCK_PROFILE, params)).fetchone() is None:
            raise errors.NotFound("no such node profile", profileId=profile_id)
        existing = await (await conn.execute(queries.VERSION, params)).fetchone()
        if existing is not None:
            if (existing["image"], existing["checksum"]) != (image, checksum):
                raise errors.Conflict("this profile version is registered with another image or checksum",
                                      profileId=profile_id, version=version)
        else:
            cap = rt.settings.node_profile_versions_max
            if (await (await conn.execute(queries.VERSION_COUNT, params)).fetchone())["n"] >= cap:
                raise errors.QuotaExceeded(f"a profile has at most {cap} versions", reason="profile-version-limit",
                                           profileId=profile_id, limit=cap)
            await conn.execute(queries.INSERT_VERSION, params)
        found = await _one(conn, profile_id)
        assert found is not None
        return found

    return await db.run_in_transaction(rt.pool, work)


async def get(rt: Runtime, profile_id: str) -> dict[str, Any]:
    match("profileId", profile_id, PROFILE_ID)
    async with db.read_only(rt.pool) as conn:
        found = await _one(conn, profile_id)
    if found is None:
        raise errors.NotFound("no such node profile", profileId=profile_id)
    return found


async def list_(rt: Runtime) -> list[dict[str, Any]]:
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(queries.PROFILES, {"id": None})).fetchall()


async def _one(conn: AsyncConnection, profile_id: str) -> dict[str, Any] | None:
    return await (await conn.execute(queries.PROFILES, {"id": profile_id})).fetchone()
