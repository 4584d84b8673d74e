"""The PKI's SQL: the CA row, join tokens, issued certificates and revocations. Node rows belong
to controlplane.nodes; the PKI calls it (enrolment's node, revoked marks, waking sessions).

Every function takes a connection inside the caller's transaction.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from psycopg import AsyncConnection

from controlplane.nodes import sessions
from controlplane.pki import certs

_CA_LOCK = "pki:ca"


@dataclass(frozen=True)
class Ca:
    key: certs.PrivateKey
    cert: x509.Certificate

    @property
    def pem(self) -> bytes:
        return certs.pem(self.cert)

    @property
    def fingerprint(self) -> str:
        return certs.key_id(self.cert)


async def db_now(conn: AsyncConnection) -> dt.datetime:
    return (await (await conn.execute("SELECT now() AS now")).fetchone())["now"]


async def load_ca(conn: AsyncConnection, passphrase: str, years: int = 10) -> Ca:
    """The CA, created by the first caller; replicas agree through an advisory lock."""
    row = await (await conn.execute("SELECT key_pem, certificate_der FROM pki_ca")).fetchone()
    if row is None:
        await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (_CA_LOCK,))
        row = await (await conn.execute("SELECT key_pem, certificate_der FROM pki_ca")).fetchone()
    if row is None:
        key, cert = certs.new_ca(await db_now(conn), years)
        encryption = (serialization.BestAvailableEncryption(passphrase.encode()) if passphrase
                      else serialization.NoEncryption())
        row = {"key_pem": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            encryption),
               "certificate_der": cert.public_bytes(serialization.Encoding.DER)}
        await conn.execute("INSERT INTO pki_ca (key_pem, certificate_der) VALUES (%(key_pem)s, %(certificate_der)s)",
                           row)
    key = serialization.load_pem_private_key(bytes(row["key_pem"]), passphrase.encode() or None)
    return Ca(key, x509.load_der_x509_certificate(bytes(row["certificate_der"])))  # type: ignore[arg-type]


async def ca_certificate(conn: AsyncConnection) -> x509.Certificate | None:
    row = await (await conn.execute("SELECT certificate_der FROM pki_ca")).fetchone()
    return x509.load_der_x509_certificate(bytes(row["certificate_der"])) if row else None


# Join tokens --------------------------------------------------------------------------------

async def insert_join_token(
    conn: AsyncConnection, token_hash: bytes, pool_id: str, node_name: str, role: str, ttl_seconds: int
) -> dict[str, Any]:
    return await (await conn.execute(
        "INSERT INTO join_tokens (token_hash, pool_id, node_name, role, expires_at)"
        " VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s))"
        " RETURNING pool_id, node_name, role, epoch_ms(expires_at) AS expires_at",
        (token_hash, pool_id, node_name, role, ttl_seconds))).fetchone()


async def claim_join_token(conn: AsyncConnection, token_hash: bytes) -> dict[str, Any] | None:
    """Lock an unused, unexpired token. A concurrent claim of the same token waits on the row
    lock and then finds it used: a token enrols one node, once."""
    return await (await conn.execute(
        "SELECT pool_id, node_name, role FROM join_tokens"
        " WHERE token_hash = %s AND used_at IS NULL AND expires_at > now() FOR UPDATE",
        (token_hash,))).fetchone()


async def void_join_tokens(conn: AsyncConnection, pool_id: str, node_name: str) -> None:
    """The unspent join tokens of this node name expire now (its node was revoked: a token issued
    before, perhaps on the machine taken, must not enrol it once it is readmitted)."""
    await conn.execute("UPDATE join_tokens SET expires_at = now()"
                       " WHERE pool_id = %s AND node_name = %s AND used_at IS NULL AND expires_at > now()",
                       (pool_id, node_name))


_ANSWERED_AGAIN = """
SELECT c.node_id, c.usage, c.role, c.certificate, c.not_after
FROM join_tokens j
JOIN nodes n ON n.id = j.node_id AND n.revoked_at IS NULL
JOIN node_certs c ON c.node_id = j.node_id
WHERE j.token_hash = %(token_hash)s AND j.used_at IS NOT NULL AND j.expires_at > now()
  AND c.public_key = ANY(%(keys)s) AND c.usage IN ('signing', 'tls') AND c.not_after > now()
  AND NOT EXISTS (SELECT 1 FROM revocations r WHERE r.serial = c.serial)
ORDER BY c.usage, c.not_before DESC
"""


async def enrolled_with(conn: AsyncConnection, token_hash: bytes, keys: list[bytes]) -> list[dict[str, Any]]:
    """The live certificates a spent, unexpired join token's enrolment issued for these public
    keys (SubjectPublicKeyInfo DER), newest first per usage: what a node that lost the answer
    gets again when it retries with the same token and the same CSRs."""
    return await (await conn.execute(_ANSWERED_AGAIN, {"token_hash": token_hash, "keys": keys})).fetchall()


_CERTIFIED_TO = """
SELECT c.node_id, c.usage, c.role, c.certificate, c.not_after
FROM node_certs c
WHERE c.node_id = %(node_id)s AND c.role = %(role)s AND c.public_key = ANY(%(keys)s)
  AND c.usage IN ('signing', 'tls') AND c.not_after > now()
  AND NOT EXISTS (SELECT 1 FROM revocations r WHERE r.serial = c.serial)
ORDER BY c.usage, c.not_before DESC
"""


async def certified_to(conn: AsyncConnection, node_id: str, role: str, keys: list[bytes]) -> list[dict[str, Any]]:
    """The node's live certificates in `role` for these public keys, newest first per usage: what
    a node whose renewal's answer was lost gets again when it retries with the same CSRs."""
    return await (await conn.execute(_CERTIFIED_TO, {"node_id": node_id, "role": role, "keys": keys})).fetchall()


async def issued_lately(conn: AsyncConnection, node_id: str) -> tuple[int, float]:
    """Certificate pairs issued to the node in the last hour (one TLS certificate each), and the
    seconds until the oldest of them is an hour old."""
    row = await (await conn.execute(
        "SELECT count(*) AS issued, extract(epoch FROM min(created_at) + interval '1 hour' - now()) AS frees_in"
        " FROM node_certs WHERE node_id = %s AND usage = 'tls' AND created_at > now() - interval '1 hour'",
        (node_id,))).fetchone()
    return row["issued"], float(row["frees_in"] or 0)


async def spend_join_token(conn: AsyncConnection, token_hash: bytes, node_id: str) -> None:
    await conn.execute("UPDATE join_tokens SET used_at = now(), node_id = %s WHERE token_hash = %s",
                       (node_id, token_hash))


# Certificates -------------------------------------------------------------------------------

_KEY_LOCK = "pki:key:"


async def already_certified(conn: AsyncConnection, keys: list[bytes]) -> bool:
    """Whether any certificate (revoked, expired or another node's too) names one of these public
    keys (SubjectPublicKeyInfo DER). Each key's advisory lock is held to the end of the caller's
    transaction, so two issuances of one key run one after the other and the second sees the first."""
    for key in sorted(keys):
        await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (_KEY_LOCK + key.hex(),))
    row = await (await conn.execute(
        "SELECT 1 FROM node_certs WHERE public_key = ANY(%s) LIMIT 1", (keys,))).fetchone()
    return row is not None


async def record_certificate(conn: AsyncConnection, cert: x509.Certificate, node_id: str | None) -> certs.CertFacts:
    facts = certs.facts(cert)
    await conn.execute(
        "INSERT INTO node_certs (serial, node_id, usage, role, key_id, public_key, signing_key, certificate,"
        " not_before, not_after) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (facts.serial, node_id, facts.usage, facts.role, facts.key_id, facts.public_key, facts.signing_key,
         cert.public_bytes(serialization.Encoding.DER), facts.not_before, facts.not_after))
    return facts


_CERT = """
SELECT c.serial, c.node_id, c.usage, c.role, c.key_id, c.signing_key, c.certificate,
       c.not_before, c.not_after, r.revoked_at, now() AS now
FROM node_certs c LEFT JOIN revocations r USING (serial)
"""


async def certificate_by_key_id(conn: AsyncConnection, key_id: str) -> dict[str, Any] | None:
    return await (await conn.execute(_CERT + " WHERE c.key_id = %s", (key_id,))).fetchone()


async def certificate_by_serial(conn: AsyncConnection, serial: str) -> dict[str, Any] | None:
    return await (await conn.execute(_CERT + " WHERE c.serial = %s", (serial,))).fetchone()


async def node_certificates(conn: AsyncConnection, node_id: str) -> list[dict[str, Any]]:
    return await (await conn.execute(
        _CERT + " WHERE c.node_id = %s ORDER BY c.not_before DESC, c.serial", (node_id,))).fetchall()


async def node_role(conn: AsyncConnection, node_id: str) -> str | None:
    """The role the node's certificates carry now: node-tenant while its machine is leased to a
    tenant (controlplane.nodes.tenancy), otherwise the role of the join token it enrolled with."""
    row = await (await conn.execute(
        "SELECT CASE WHEN n.state = 'leased' THEN 'node-tenant' ELSE"
        " (SELECT t.role FROM join_tokens t WHERE t.node_id = n.id AND t.used_at IS NOT NULL"
        "  ORDER BY t.used_at DESC LIMIT 1) END AS role"
        " FROM nodes n WHERE n.id = %s", (node_id,))).fetchone()
    return row["role"] if row else None


async def revoke_other_roles(conn: AsyncConnection, node_id: str, key_id: str, reason: str) -> list[str]:
    """Revoke the node's certificates issued no later than `key_id`'s in another role; wakes the
    node's sessions when any was revoked."""
    rows = await (await conn.execute(
        "INSERT INTO revocations (serial, reason)"
        " SELECT c.serial, %s FROM node_certs mine JOIN node_certs c ON c.node_id = mine.node_id"
        " WHERE mine.key_id = %s AND mine.node_id = %s AND c.role <> mine.role AND c.created_at <= mine.created_at"
        " ON CONFLICT (serial) DO NOTHING RETURNING serial", (reason, key_id, node_id))).fetchall()
    if rows:
        await sessions.recheck(conn, node_id)
    return sorted(r["serial"] for r in rows)


async def revoke(conn: AsyncConnection, *, node_id: str = "", serial: str = "", reason: str = "") -> list[str]:
    """Revoke one certificate, or every certificate of a node (expired ones too: within the
    offline grace they still sign reports). Wakes the node's sessions to re-check theirs."""
    rows = await (await conn.execute(
        "INSERT INTO revocations (serial, reason)"
        " SELECT serial, %(reason)s FROM node_certs"
        " WHERE node_id IS NOT NULL AND (node_id = %(node_id)s OR serial = %(serial)s)"
        " ON CONFLICT (serial) DO NOTHING RETURNING serial",
        {"node_id": node_id, "serial": serial, "reason": reason})).fetchall()
    serials = sorted(r["serial"] for r in rows)
    nodes = await (await conn.execute(
        "SELECT DISTINCT node_id FROM node_certs WHERE serial = ANY(%s)", (serials,))).fetchall()
    for node in nodes:
        await sessions.recheck(conn, node["node_id"])
    return serials
