"""Enrolment and renewal of node certificates, the gateways' server certificates, and who a
TLS peer is. Each entry point runs one transaction."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from controlplane import db, errors
from controlplane.ids import token_hash
from controlplane.nodes import registry
from controlplane.pki import GATEWAY, NODE_ROLES, certs, store
from controlplane.pki.config import PkiSettings

log = structlog.get_logger("pki.enrolment")
SUPERSEDED = "superseded by a new enrolment"
ROLE_CHANGED = "superseded: the node's role changed to"


@dataclass(frozen=True)
class Issued:
    node_id: str
    role: str
    # The signing certificate's PEM, then the TLS certificate's (what the node matches to its keys).
    certificate_pem: bytes
    not_after_ms: int


@dataclass(frozen=True)
class Peer:
    """A node as its client certificate names it (checked against the issued-certificate table)."""

    node_id: str
    role: str
    serial: str
    key_id: str
    not_before: dt.datetime
    not_after: dt.datetime


async def load_ca(pool: AsyncConnectionPool, settings: PkiSettings) -> store.Ca:
    return await db.run_in_transaction(pool, lambda conn: store.load_ca(conn, settings.ca_passphrase, settings.ca_years))


def _ms(when: dt.datetime) -> int:
    return int(when.timestamp() * 1000)


async def _issue(conn: AsyncConnection, ca: store.Ca, settings: PkiSettings, csr: certs.CsrBundle,
                 node_id: str, role: str) -> Issued:
    """Certify the CSRs' keys for the node, only if no certificate ever named them: a revoked
    key (perhaps stolen) never comes back under a new certificate, nor another node's keys (a copy
    of its CSRs proves them too) under this one. The caller's transaction rolls back on refusal."""
    if await store.already_certified(conn, _keys(csr)):
        raise errors.InvalidInput("csr_pem", "names a key already certified: enrolment and renewal need new keys")
    now = await store.db_now(conn)
    life = dt.timedelta(hours=settings.node_cert_hours)
    pems, not_after = [], []
    for usage, key in ((certs.SIGNING, csr.signing), (certs.TLS, csr.tls)):
        cert = certs.issue(ca.key, ca.cert, public_key=key, usage=usage, role=role, common_name=node_id,
                           now=now, life=life)
        not_after.append((await store.record_certificate(conn, cert, node_id)).not_after)
        pems.append(certs.pem(cert))
    return Issued(node_id, role, b"".join(pems), _ms(min(not_after)))


async def enrol(pool: AsyncConnectionPool, ca: store.Ca, settings: PkiSettings,
                join_token: str, csr_pem: bytes) -> Issued:
    """Spend a join token (once) and certify the node it names, created on first enrolment and
    reused when the same name enrols again: then every certificate it held before is revoked (one
    name, one live identity). A node an operator revoked is refused until it is readmitted; the
    token is then not spent. The role is the token's, except on a machine a tenant leases
    (node-tenant, as a renewal would give). A retry with the spent token and the same CSRs, while
    the token is unexpired, answers the certificates again (a node that lost the answer)."""
    if not join_token:
        raise errors.Unauthenticated("a join token is required")
    csr = certs.parse_csr_bundle(csr_pem)  # a bad CSR does not spend the token
    hashed = token_hash(join_token)

    async def work(conn: AsyncConnection) -> Issued:
        claim = await store.claim_join_token(conn, hashed)
        if claim is None:
            again = await _answered_again(conn, hashed, csr)
            if again is None:
                raise errors.Unauthenticated("invalid, used or expired join token")
            log.info("enrolment answered again", node_id=again.node_id)
            return again
        node = await registry.for_enrolment(conn, claim["pool_id"], claim["node_name"])
        node_id = node["id"]
        if node["revoked_at"] is not None:
            raise errors.AccessDenied(
                f"node {node['name']} ({node_id}) was revoked; an operator must readmit it"
                " (NodeAdmin.ReadmitNode) before it can enrol again",
                nodeId=node_id, poolId=node["pool_id"], nodeName=node["name"])
        await store.spend_join_token(conn, hashed, node_id)
        superseded = await store.revoke(conn, node_id=node_id, reason=SUPERSEDED)
        if superseded:
            log.info("earlier certificates revoked by re-enrolment", node_id=node_id, serials=superseded)
        # As at a renewal: node-tenant while a tenant holds the machine, else the token's role.
        role = await store.node_role(conn, node_id) or claim["role"]
        return await _issue(conn, ca, settings, csr, node_id, role)

    return await db.run_in_transaction(pool, work)


async def _answered_again(conn: AsyncConnection, hashed: bytes, csr: certs.CsrBundle) -> Issued | None:
    """A retry of an enrolment whose answer was lost: the token is spent, but by these very keys
    (the CSRs prove the caller holds them), so the node gets the certificates it was issued, as
    long as the token has not expired and they are live. Nothing is issued or spent again; other
    keys with the same token stay refused."""
    return _pair(await store.enrolled_with(conn, hashed, _keys(csr)))


def _keys(csr: certs.CsrBundle) -> list[bytes]:
    return [certs.spki(csr.signing), certs.spki(csr.tls)]


def _pair(rows: list[dict]) -> Issued | None:
    """The newest signing and TLS certificates of `rows` (newest first per usage) as an answer;
    None unless both keys have one."""
    newest = {}
    for row in rows:  # newest first per usage
        newest.setdefault(row["usage"], row)
    if set(newest) != {certs.SIGNING, certs.TLS}:
        return None
    signing, tls = newest[certs.SIGNING], newest[certs.TLS]
    pems = [certs.pem(x509.load_der_x509_certificate(bytes(r["certificate"]))) for r in (signing, tls)]
    return Issued(tls["node_id"], tls["role"], b"".join(pems), _ms(min(signing["not_after"], tls["not_after"])))


async def renew(pool: AsyncConnectionPool, ca: store.Ca, settings: PkiSettings, peer: Peer,
                csr_pem: bytes) -> Issued:
    """New certificates for the same node, in the role the control plane gives it now, never one
    the node asks for: `node-tenant` while a tenant holds the machine (a whole-machine lease, from
    its start until the machine was seen wiped), otherwise the role it enrolled with. The
    certificates of the old role are revoked once the node authenticates with a new one
    (`retire_other_roles`), so an answer lost on the way never locks the node out. The node brings
    new keys (a key is certified once); a retry with the CSRs of a renewal whose answer was lost
    gets that renewal's live certificates again."""
    csr = certs.parse_csr_bundle(csr_pem)

    async def work(conn: AsyncConnection) -> Issued:
        # The node's row first: a revocation of the node (which marks the row) that began before
        # waits here, so the check below sees it; one that begins after waits for this renewal
        # and then revokes what it issued too.
        node = await registry.lock(conn, peer.node_id)
        if node is None or node["revoked_at"] is not None:
            raise errors.Unauthenticated("node revoked", nodeId=peer.node_id)
        _check(await store.certificate_by_key_id(conn, peer.key_id))  # revoked since the call began?
        role = await store.node_role(conn, peer.node_id) or peer.role
        if role != peer.role:
            log.info("node role changes at renewal", node_id=peer.node_id, role=role, was=peer.role)
        # A retry of a renewal whose answer was lost: these keys' live certificates, issued to this
        # node in this role, are answered again (nothing issued); any other certified key is refused.
        again = _pair(await store.certified_to(conn, peer.node_id, role, _keys(csr)))
        if again is not None:
            log.info("renewal answered again", node_id=peer.node_id)
            return again
        # Each gateway paces renewals in memory; this bounds them across all of them (under the
        # node's row lock, so concurrent renewals count each other).
        issued, frees_in = await store.issued_lately(conn, peer.node_id)
        if settings.node_renewals_per_hour and issued >= settings.node_renewals_per_hour:
            raise errors.QuotaExceeded("this node renews too often", reason="rate-limited",
                                       retryAfterSeconds=max(1, math.ceil(frees_in)))
        return await _issue(conn, ca, settings, csr, peer.node_id, role)

    return await db.run_in_transaction(pool, work)


async def retire_other_roles(pool: AsyncConnectionPool, peer: Peer) -> list[str]:
    """The node opened a session with `peer`'s certificate: every certificate of the node in
    another role issued before it is revoked (its older sessions re-check and end). After a role
    change (a whole-machine lease began or ended) keys a tenant could have read never serve in
    the other role, once the node showed it holds the new certificate."""

    async def work(conn: AsyncConnection) -> list[str]:
        return await store.revoke_other_roles(conn, peer.node_id, peer.key_id, f"{ROLE_CHANGED} {peer.role}")

    revoked = await db.run_in_transaction(pool, work)
    if revoked:
        log.info("certificates of the node's former role revoked", node_id=peer.node_id, role=peer.role,
                 serials=revoked)
    return revoked


async def identify(pool: AsyncConnectionPool, cert_pem: bytes | None) -> Peer:
    """The node behind a verified TLS client certificate; UNAUTHENTICATED unless it is a node
    certificate we issued, unrevoked and within its validity."""
    if not cert_pem:
        raise errors.Unauthenticated("a node client certificate is required")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise errors.Unauthenticated("unreadable client certificate") from None
    async with db.read_only(pool) as conn:
        row = await store.certificate_by_key_id(conn, certs.key_id(cert))
    _check(row)
    return Peer(row["node_id"], row["role"], row["serial"], certs.key_id(cert), row["not_before"], row["not_after"])


def _check(row: dict | None) -> None:
    if row is None or row["usage"] != certs.TLS or row["role"] not in NODE_ROLES:
        raise errors.Unauthenticated("not a node TLS certificate issued by this control plane")
    if row["revoked_at"] is not None:
        raise errors.Unauthenticated("certificate revoked", serial=row["serial"])
    if not row["not_before"] <= row["now"] < row["not_after"]:
        raise errors.Unauthenticated("certificate expired", serial=row["serial"])


@dataclass(frozen=True)
class ServerCertificate:
    key_pem: bytes
    certificate_pem: bytes
    not_before: dt.datetime
    not_after: dt.datetime


async def gateway_certificate(pool: AsyncConnectionPool, ca: store.Ca, settings: PkiSettings,
                              hosts: tuple[str, ...]) -> ServerCertificate:
    """A fresh key and server certificate for a gateway (role `gateway`, SANs `hosts`)."""
    key = ec.generate_private_key(ec.SECP256R1())

    async def work(conn: AsyncConnection) -> ServerCertificate:
        cert = certs.issue(ca.key, ca.cert, public_key=key.public_key(), usage=certs.SERVER, role=GATEWAY,
                           common_name=GATEWAY, now=await store.db_now(conn),
                           life=dt.timedelta(hours=settings.gateway_cert_hours), hosts=hosts)
        await store.record_certificate(conn, cert, None)
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return ServerCertificate(key_pem, certs.pem(cert), cert.not_valid_before_utc, cert.not_valid_after_utc)

    return await db.run_in_transaction(pool, work)
