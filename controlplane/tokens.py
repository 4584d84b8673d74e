"""API bearer tokens: minted for an identity with an expiry, listed and revoked by id, by prefix
or per identity. The secret is shown once and stored only as its SHA-256; the first characters
of the secret (its prefix) are kept so an operator can recognise and revoke a token without it.

Expiry is a time on the product clock, `compute_now()` (DESIGN "Time"), when minted and when
judged: moving the dev or test clock past a token's expiry expires it. (Node certificates and
join tokens keep the database's real `now()`.)
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import psycopg
from psycopg import AsyncConnection

from controlplane import db, db_errors, errors
from controlplane.durations import parse_duration_ms
from controlplane.ids import keyed_id, new_id, request_hash, token_hash
from controlplane.common.names import IDEMPOTENCY_KEY, match
from controlplane.runtime import Runtime

SECRET_PREFIX = "bct_"
PREFIX_LENGTH = 12  # "bct_" and 8 characters (48 random bits) of the secret
TOKEN_ID = re.compile(r"^tok_[0-9a-hjkmnp-tv-z]{26}$")
TOKEN_PREFIX = re.compile(r"^bct_[A-Za-z0-9_-]{8}$")
IDENTITY_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
MIN_TTL_MS = 1000

_COLUMNS = """id, identity_id, prefix, epoch_ms(created_at) AS created_ms, epoch_ms(expires_at) AS expires_ms,
       coalesce(epoch_ms(revoked_at), 0) AS revoked_ms"""

MINT = f"""
INSERT INTO api_tokens (id, token_hash, prefix, identity_id, expires_at, request_hash)
VALUES (%(id)s, %(hash)s, %(prefix)s, %(identity_id)s, compute_now() + %(ttl_ms)s * interval '1 millisecond',
        %(request_hash)s)
ON CONFLICT (id) DO NOTHING
RETURNING {_COLUMNS}
"""

# A retry under an idempotency key: the token's row, locked (a concurrent retry waits for this one).
_KEYED = f"SELECT {_COLUMNS}, request_hash, (revoked_at IS NULL AND expires_at > compute_now()) AS live" \
         " FROM api_tokens WHERE id = %(id)s FOR UPDATE"
# ... whose secret the lost answer carried is replaced: that secret stops working now.
_RESECRET = f"""
UPDATE api_tokens SET token_hash = %(hash)s, prefix = %(prefix)s WHERE id = %(id)s RETURNING {_COLUMNS}
"""


_LIST = f"""
SELECT {_COLUMNS} FROM api_tokens
WHERE identity_id = %(identity_id)s
  AND (%(all)s OR (revoked_at IS NULL AND expires_at > compute_now()))
ORDER BY created_at DESC, id
"""

_FIND = f"""
SELECT {_COLUMNS} FROM api_tokens
WHERE (%(id)s::text IS NULL OR id = %(id)s) AND (%(prefix)s::text IS NULL OR prefix = %(prefix)s)
"""

_REVOKE = f"""
UPDATE api_tokens SET revoked_at = now()
WHERE id = ANY(%(ids)s) AND revoked_at IS NULL
RETURNING {_COLUMNS}
"""

_REVOKE_IDENTITIES = f"""
UPDATE api_tokens SET revoked_at = now()
WHERE identity_id = ANY(%(identity_ids)s) AND revoked_at IS NULL
RETURNING {_COLUMNS}
"""

_IDENTITY_EXISTS = "SELECT 1 FROM identities WHERE id = %s"
# Locked (key share): an offboarding in progress holds the row, and is waited for and read.
_IDENTITY_OFFBOARDED = "SELECT offboarded_at IS NOT NULL AS offboarded FROM identities WHERE id = %s FOR KEY SHARE"

# Open Watch streams end when a token they run on is revoked (controlplane.watch listens).
REVOKED_CHANNEL = "bc_tokens_revoked"
_IDS_PER_NOTIFY = 200


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def _mint_params(identity_id: str, ttl_ms: int, token_id: str | None = None,
                 digest: str | None = None) -> tuple[str, dict[str, Any]]:
    secret = new_secret()
    return secret, {"id": token_id or new_id("tok"), "hash": token_hash(secret), "prefix": secret[:PREFIX_LENGTH],
                    "identity_id": identity_id, "ttl_ms": ttl_ms, "request_hash": digest}


def mint_sync(conn: psycopg.Connection, identity_id: str, ttl_ms: int) -> str:
    """Bootstrap's path (no server yet): a new token for an existing identity; the secret."""
    secret, params = _mint_params(identity_id, ttl_ms)
    conn.execute(MINT, params)
    return secret


def remaining_ms(conn: psycopg.Connection, secret: str) -> int:
    """How long the token stays valid (ms), or 0 when it is unknown, revoked or expired."""
    row = conn.execute(
        "SELECT epoch_ms(expires_at) - epoch_ms(compute_now()) FROM api_tokens"
        " WHERE token_hash = %s AND revoked_at IS NULL AND expires_at > compute_now()", (token_hash(secret),),
    ).fetchone()
    return int(row[0]) if row else 0


def _ttl_ms(rt: Runtime, now_ms: int, expires_at_ms: int, ttl: str) -> int:
    """The lifetime asked for: an absolute expiry, a duration, or the configured default."""
    if expires_at_ms and ttl:
        raise errors.InvalidInput("ttl", "give either expiresAt or ttl")
    if ttl:
        try:
            ttl_ms = parse_duration_ms(ttl)
        except ValueError as exc:
            raise errors.InvalidInput("ttl", str(exc)) from None
        field = "ttl"
    elif expires_at_ms:
        ttl_ms, field = expires_at_ms - now_ms, "expiresAt"
    else:
        return rt.settings.token_ttl_seconds * 1000
    if ttl_ms < MIN_TTL_MS:
        raise errors.InvalidInput(field, "must end at least a second in the future")
    if ttl_ms > rt.settings.token_max_ttl_seconds * 1000:
        raise errors.InvalidInput(field, f"at most {rt.settings.token_max_ttl_seconds} s ahead")
    return ttl_ms


def _request_hash(identity_id: str, expires_at_ms: int, ttl: str) -> str:
    """What a keyed CreateToken asked for: the identity and the expiry as given (an absolute time,
    or a lifetime in ms, so "8h" and "480m" are one request; neither: the default)."""
    return request_hash({"identityId": identity_id, "expiresAt": expires_at_ms or None,
                         "ttlMs": parse_duration_ms(ttl) if ttl else None})


async def mint(rt: Runtime, identity_id: str, expires_at_ms: int = 0, ttl: str = "", key: str = "",
               caller_id: str = "") -> dict[str, Any]:
    """A new token for the identity; the answer holds the secret, shown this once.

    With an idempotency key the token's id is derived from the caller and the key: a retry with
    the same request answers that token with a new secret (the earlier one stops working), or as it
    is, without a secret, once it is revoked or expired; another request is CONFLICT."""
    match("identityId", identity_id, IDENTITY_ID)
    token_id = digest = None
    if key:
        match("idempotencyKey", key, IDEMPOTENCY_KEY)
        _ttl_ms(rt, 0, 0, ttl)  # the ttl's own checks before it is hashed (expiresAt is checked below)
        token_id, digest = keyed_id("tok", 26, "CreateToken", caller_id, key), _request_hash(identity_id, expires_at_ms, ttl)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        identity = await (await conn.execute(_IDENTITY_OFFBOARDED, (identity_id,))).fetchone()
        if identity is None:
            raise errors.NotFound("no such identity", identityId=identity_id)
        if identity["offboarded"]:
            raise errors.InvalidState("this identity is offboarded", identityId=identity_id, state="offboarded")
        if token_id is not None and (found := await (await conn.execute(_KEYED, {"id": token_id})).fetchone()):
            return await _again(conn, found, digest)
        now_ms = await db.now_ms(conn)
        secret, params = _mint_params(identity_id, _ttl_ms(rt, now_ms, expires_at_ms, ttl), token_id, digest)
        row = await (await conn.execute(MINT, params)).fetchone()
        if row is None:  # a concurrent call with the key wrote the row first: it is read locked now
            return await _again(conn, await (await conn.execute(_KEYED, {"id": token_id})).fetchone(), digest)
        return {**row, "secret": secret}

    with db_errors.mapped(identityId=identity_id):  # api_tokens_identity_id_fkey: deleted meanwhile
        return await db.run_in_transaction(rt.pool, work)


async def _again(conn: AsyncConnection, found: dict[str, Any], digest: str | None) -> dict[str, Any]:
    """A keyed CreateToken again: the token under a new secret (the old one revoked by the
    replacement, so its open Watch streams end), or as it is when no longer live."""
    if found["request_hash"] != digest:
        raise errors.Conflict("this idempotency key was used with another request", tokenId=found["id"])
    if not found["live"]:
        return found
    secret = new_secret()
    row = await (await conn.execute(_RESECRET, {"id": found["id"], "hash": token_hash(secret),
                                                "prefix": secret[:PREFIX_LENGTH]})).fetchone()
    await _notify_revoked(conn, [row])
    return {**row, "secret": secret}


async def list_(rt: Runtime, identity_id: str, include_inactive: bool) -> list[dict[str, Any]]:
    match("identityId", identity_id, IDENTITY_ID)
    async with db.read_only(rt.pool) as conn:
        if await (await conn.execute(_IDENTITY_EXISTS, (identity_id,))).fetchone() is None:
            raise errors.NotFound("no such identity", identityId=identity_id)
        return await (await conn.execute(_LIST, {"identity_id": identity_id, "all": include_inactive})).fetchall()


async def revoke(rt: Runtime, token_id: str, prefix: str, identity_id: str) -> list[dict[str, Any]]:
    """Revoke one token (by id or prefix) or every token of an identity; the tokens revoked now.

    Revoking a token again changes nothing and answers it as it is (with its first revocation)."""
    given = [name for name, value in (("tokenId", token_id), ("prefix", prefix), ("identityId", identity_id))
             if value]
    if len(given) != 1:
        raise errors.InvalidInput(given[-1] if given else "tokenId",
                                  "give exactly one of tokenId, prefix or identityId")
    if token_id:
        match("tokenId", token_id, TOKEN_ID)
    if prefix:
        match("prefix", prefix, TOKEN_PREFIX)
    if identity_id:
        match("identityId", identity_id, IDENTITY_ID)

    async def work(conn: AsyncConnection) -> list[dict[str, Any]]:
        if identity_id:
            if await (await conn.execute(_IDENTITY_EXISTS, (identity_id,))).fetchone() is None:
                raise errors.NotFound("no such identity", identityId=identity_id)
            return await revoke_identities(conn, [identity_id])
        found = await (await conn.execute(_FIND, {"id": token_id or None, "prefix": prefix or None})).fetchall()
        if not found:
            raise errors.NotFound("no such token", tokenId=token_id or None, prefix=prefix or None)
        if len(found) > 1:
            raise errors.Conflict("the prefix names several tokens: revoke by id",
                                  prefix=prefix, tokenIds=[r["id"] for r in found])
        revoked = await (await conn.execute(_REVOKE, {"ids": [found[0]["id"]]})).fetchall()
        await _notify_revoked(conn, revoked)
        return revoked or found

    return await db.run_in_transaction(rt.pool, work)


async def revoke_identities(conn: AsyncConnection, identity_ids: list[str]) -> list[dict[str, Any]]:
    """Revoke every live token of these identities in the caller's transaction; the tokens revoked."""
    rows = await (await conn.execute(_REVOKE_IDENTITIES, {"identity_ids": identity_ids})).fetchall()
    await _notify_revoked(conn, rows)
    return rows


_EXPIRED_BY_CLOCK = """
SELECT id FROM api_tokens
WHERE revoked_at IS NULL AND expires_at <= compute_now()
  AND expires_at > compute_now() - %(by_ms)s * interval '1 millisecond'
"""


async def notify_expired_by_clock(conn: AsyncConnection, by_ms: int) -> None:
    """The clock moved `by_ms` forward (dev and test) in the caller's transaction: the open Watch
    streams of the tokens that move expired end (their timers run on the wall clock)."""
    await _notify_revoked(conn, await (await conn.execute(_EXPIRED_BY_CLOCK, {"by_ms": by_ms})).fetchall())


async def _notify_revoked(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    ids = [r["id"] for r in rows]
    for i in range(0, len(ids), _IDS_PER_NOTIFY):  # a payload holds at most 8000 bytes
        await conn.execute("SELECT pg_notify(%s, %s)", (REVOKED_CHANNEL, ",".join(ids[i:i + _IDS_PER_NOTIFY])))
