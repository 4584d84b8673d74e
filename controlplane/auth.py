"""Who is calling: bearer tokens (stored as SHA-256, with an expiry) resolved to an identity and its
tenants. A revoked or expired token, or one of an offboarded identity, is UNAUTHENTICATED.

A delegated agent acts for its person, never beyond: not at all once its person is offboarded, and
only in the tenants both it and its person are members of (an agent row naming a tenant its
person is not in gives it nothing there)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from psycopg_pool import AsyncConnectionPool

from controlplane import db, errors
from controlplane.bootstrap import ROOT_TENANT
from controlplane.ids import token_hash


@dataclass(frozen=True)
class Caller:
    identity_id: str
    kind: str
    tenant_ids: frozenset[str]
    delegator_id: str | None = None
    # The person's own kind ("user" or "service"): IAM decides the person as it is, never as
    # another kind a policy may allow more.
    delegator_kind: str = "user"
    confirm_actions: tuple[str, ...] = ()
    token_id: str = ""
    # When the token expires on the wall clock (its expiry on the product clock less the clock's
    # offset, as read at authentication): a Watch stream's timer.
    token_expires_ms: int = 0

    @property
    def delegated(self) -> bool:
        return self.delegator_id is not None

    def require_member(self, tenant_id: str) -> None:
        """A caller acts only in tenants it belongs to (ACCESS_DENIED, never a hint of existence)."""
        if tenant_id not in self.tenant_ids:
            raise errors.AccessDenied("the caller is not a member of this tenant", tenantId=tenant_id)

    def require_root(self) -> None:
        """Root-only calls (Admin, NodeAdmin) skip IAM, so a person's delegation (its policy,
        its confirm_actions) could not hold an agent there: agents are refused outright."""
        if ROOT_TENANT not in self.tenant_ids:
            raise errors.AccessDenied("this call needs a member of the root tenant")
        if self.delegated:
            raise errors.AccessDenied("an agent acting for a person cannot make root-only calls",
                                      identityId=self.identity_id)


@dataclass
class Unverified:
    """A bearer token this process has seen authenticate before, not yet checked for this call:
    who it named then (a token never changes identity), so a call can read its first facts for
    that identity and verify the token in the same statement (`CALLER_COLUMN`) before it acts on
    anything it read. `verify` sets `caller`."""

    token_hash: bytes
    identity_id: str
    caller: Caller | None = None


class TokenIdentities:
    """Token hash -> the identity it authenticated as, for the calls that verify the token in their
    first statement (Reservations.Create). Only a successful authentication adds an entry; an entry
    proves nothing about the token now. Least recently used entries leave first beyond `entries`."""

    def __init__(self, entries: int = 4096) -> None:
        self.entries = entries
        self._known: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()  # servers in threads of one process (tests) share it

    def remember(self, token_hash: bytes, identity_id: str) -> None:
        with self._lock:
            self._known[token_hash] = identity_id
            self._known.move_to_end(token_hash)
            while len(self._known) > self.entries:
                self._known.popitem(last=False)

    def unverified(self, secret: str) -> Unverified | None:
        digest = token_hash(secret)
        identity_id = self._known.get(digest)
        return None if identity_id is None else Unverified(digest, identity_id)

    def forget(self, token_hash: bytes) -> None:
        with self._lock:
            self._known.pop(token_hash, None)


KNOWN = TokenIdentities()


_CALLER_SQL = """
SELECT i.id, i.kind, i.delegator_id, (SELECT p.kind FROM identities p WHERE p.id = i.delegator_id) AS delegator_kind,
       i.confirm_actions, t.id AS token_id,
       epoch_ms(t.expires_at - (compute_now() - now())) AS expires_ms, t.expires_at <= compute_now() AS expired,
       coalesce(array_agg(m.tenant_id) FILTER (WHERE m.tenant_id IS NOT NULL), '{}') AS tenant_ids
FROM api_tokens t
JOIN identities i ON i.id = t.identity_id
LEFT JOIN memberships m ON m.identity_id = i.id
    AND (i.delegator_id IS NULL OR EXISTS (
        SELECT 1 FROM memberships pm WHERE pm.identity_id = i.delegator_id AND pm.tenant_id = m.tenant_id))
WHERE t.token_hash = %(hash)s AND t.revoked_at IS NULL AND i.offboarded_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM identities p WHERE p.id = i.delegator_id AND p.offboarded_at IS NOT NULL)
GROUP BY i.id, t.token_hash
"""


def bearer_secret(metadata: dict[str, str]) -> str:
    header = metadata.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise errors.Unauthenticated("missing bearer token")
    return secret.strip()


# The caller of `%(hash)s` as one JSON value (NULL: the token does not authenticate), for a call's
# first statement to verify an Unverified caller in (its parameter `hash` is the token's hash).
CALLER_COLUMN = f"(SELECT to_jsonb(c) FROM ({_CALLER_SQL.strip()}) c) AS caller"


async def authenticate(pool: AsyncConnectionPool, secret: str) -> Caller:
    return await authenticate_hash(pool, token_hash(secret))


async def authenticate_hash(pool: AsyncConnectionPool, digest: bytes) -> Caller:
    """The caller of the token with SHA-256 `digest`, read in its own statement."""
    found = _caller_of(await db.fetch_one(pool, _CALLER_SQL, {"hash": digest}))
    KNOWN.remember(digest, found.identity_id)
    return found


async def verify_now(pool: AsyncConnectionPool, unverified: Unverified) -> Caller:
    """The caller `unverified` names, read in a statement of its own (a handler that must wait
    before its first statement verifies the token first)."""
    unverified.caller = await authenticate_hash(pool, unverified.token_hash)
    return unverified.caller


def verify(unverified: Unverified, row: dict[str, Any] | None) -> Caller:
    """The caller `unverified` names, from its CALLER_COLUMN read in the call's first statement:
    UNAUTHENTICATED exactly as `authenticate` would answer now (revoked, expired, offboarded)."""
    if row is not None and row["id"] != unverified.identity_id:  # a token never changes identity
        KNOWN.forget(unverified.token_hash)
        row = None
    unverified.caller = _caller_of(row)
    return unverified.caller


def _caller_of(row: dict[str, Any] | None) -> Caller:
    if row is None:
        raise errors.Unauthenticated("invalid or revoked token")
    if row["expired"]:
        raise errors.Unauthenticated("the token has expired", tokenId=row["token_id"])
    return Caller(
        identity_id=row["id"],
        kind=row["kind"],
        tenant_ids=frozenset(row["tenant_ids"]),
        delegator_id=row["delegator_id"],
        delegator_kind=row["delegator_kind"] or "user",
        confirm_actions=tuple(row["confirm_actions"]),
        token_id=row["token_id"],
        token_expires_ms=row["expires_ms"],
    )
