"""The node PKI with real keys, real certificates and a real database: the CA, CSR checks, join
tokens, enrolment, renewal, revocation, the NodeAdmin API, and every branch of the attested-report
check."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import psycopg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from psycopg.rows import dict_row

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import nodes_pb2_grpc
from controlplane import bootstrap, db, errors
from controlplane.api.interceptor import ApiInterceptor
from controlplane.api.node_admin import NodeAdminServicer
from controlplane.config import Settings
from controlplane.ids import new_id
from controlplane.nodes import sessions
from controlplane.pki import admin, attest, certs, enrolment
from controlplane.pki.config import PkiSettings
from controlplane.runtime import Runtime
from tests.support import rpc_error

T = TypeVar("T")
GRACE = dt.timedelta(hours=1)


def arun(conninfo: str, work: Callable[[Any], Awaitable[T]]) -> T:
    """Run `work(pool)` against the database on a fresh event loop."""

    async def main() -> T:
        pool = await db.open_pool(conninfo, size=4)
        try:
            return await work(pool)
        finally:
            await pool.close()

    return asyncio.run(main())


def seed_pool(conninfo: str, tenant: str = "acme") -> str:
    pool_id = new_id("pool")
    with psycopg.connect(conninfo) as conn:
        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s) ON CONFLICT DO NOTHING", (tenant, tenant))
        conn.execute("INSERT INTO pools (id, owner_tenant_id, name) VALUES (%s, %s, 'p')", (pool_id, tenant))
    return pool_id


def sql(conninfo: str, query: str, params: Any = None) -> list[dict[str, Any]]:
    with psycopg.connect(conninfo, row_factory=dict_row) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


@dataclass
class NodeKeys:
    """A node's two keys: ECDSA P-256 for TLS, Ed25519 for signing reports."""

    tls: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    signing: ed25519.Ed25519PrivateKey = field(default_factory=ed25519.Ed25519PrivateKey.generate)

    def csr(self) -> bytes:
        return certs.build_csr_bundle(self.signing, self.tls)


def split(certificate_pem: bytes) -> tuple[x509.Certificate, x509.Certificate]:
    """(signing certificate, TLS certificate) of an enrolment or renewal answer."""
    signing, tls = x509.load_pem_x509_certificates(certificate_pem)
    assert isinstance(signing.public_key(), ed25519.Ed25519PublicKey)
    assert isinstance(tls.public_key(), ec.EllipticCurvePublicKey)
    return signing, tls


@dataclass
class Enrolled:
    keys: NodeKeys
    issued: enrolment.Issued

    @property
    def node_id(self) -> str:
        return self.issued.node_id

    @property
    def signing_cert(self) -> x509.Certificate:
        return split(self.issued.certificate_pem)[0]

    @property
    def cert(self) -> x509.Certificate:  # the TLS certificate
        return split(self.issued.certificate_pem)[1]

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.signing_cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def enrol(conninfo: str, pool_id: str, name: str, *, role: str = "node",
          settings: PkiSettings | None = None, keys: NodeKeys | None = None) -> Enrolled:
    settings = settings or PkiSettings()
    keys = keys or NodeKeys()

    async def work(pool: Any) -> enrolment.Issued:
        ca = await enrolment.load_ca(pool, settings)
        token = await admin.create_join_token(pool, pool_id, name, role, 600)
        return await enrolment.enrol(pool, ca, settings, token["secret"], keys.csr())

    return Enrolled(keys, arun(conninfo, work))


def bound_report(node_id: str, allocation_id: str, *, at_ms: int | None = None, **event: Any) -> bytes:
    report = node_pb2.Report(node_id=node_id, sequence=1, time=int(time.time() * 1000) if at_ms is None else at_ms)
    if event.get("failed"):
        report.failed.CopyFrom(node_pb2.AllocationFailed(allocation_id=allocation_id, reason="device-missing"))
    else:
        report.bound.CopyFrom(node_pb2.AllocationBound(allocation_id=allocation_id,
                                                       cdi_devices=["bcd.dev/gpu=GPU-1"]))
    return report.SerializeToString()


def sign(key: ed25519.Ed25519PrivateKey, body: bytes) -> bytes:
    return key.sign(b"attested-report\x00" + body)


def verify(conninfo: str, allocation_id: str, node_id: str, body: bytes | None, key_id: str | None,
           signature: bytes | None, grace: dt.timedelta = GRACE, **kw: Any) -> tuple[bool, str]:
    async def work(pool: Any) -> tuple[bool, str, Any]:
        async with pool.connection() as conn:
            return await attest.verify_bound_report(conn, allocation_id, node_id, body, key_id, signature, grace, **kw)

    ok, reason, report = arun(conninfo, work)
    assert (report is not None) == ok
    return ok, reason


# The CA -------------------------------------------------------------------------------------

def test_the_ca_is_created_once_and_replicas_agree(database: str) -> None:
    async def work(pool: Any) -> list[str]:
        cas = await asyncio.gather(*(enrolment.load_ca(pool, PkiSettings()) for _ in range(4)))
        return [ca.fingerprint for ca in cas]

    assert len(set(arun(database, work))) == 1
    assert sql(database, "SELECT count(*) AS n FROM pki_ca")[0]["n"] == 1
    ca = arun(database, lambda pool: enrolment.load_ca(pool, PkiSettings()))
    assert isinstance(ca.key, ec.EllipticCurvePrivateKey) and ca.cert.extensions.get_extension_for_class(
        x509.BasicConstraints).value.ca


def test_the_ca_key_is_stored_encrypted_with_a_passphrase(database: str) -> None:
    secret = PkiSettings(ca_passphrase="correct horse")
    arun(database, lambda pool: enrolment.load_ca(pool, secret))
    assert bytes(sql(database, "SELECT key_pem FROM pki_ca")[0]["key_pem"]).startswith(
        b"-----BEGIN ENCRYPTED PRIVATE KEY")
    with pytest.raises((TypeError, ValueError)):
        arun(database, lambda pool: enrolment.load_ca(pool, PkiSettings(ca_passphrase="wrong")))


# CSRs ---------------------------------------------------------------------------------------

def _csr(key: Any) -> bytes:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n")]))
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM)


def test_a_csr_bundle_proves_an_ed25519_signing_key_and_a_p256_tls_key() -> None:
    keys = NodeKeys()
    bundle = certs.parse_csr_bundle(keys.csr())
    assert certs.raw_ed25519(bundle.signing) == certs.raw_ed25519(keys.signing.public_key())
    assert certs.spki(bundle.tls) == certs.spki(keys.tls.public_key())
    assert certs.parse_csr_bundle(_csr(keys.tls) + _csr(keys.signing)).signing is not None  # either order

    forged = bytearray(_csr(keys.tls))
    forged[-80] = ord("A") if forged[-80] != ord("A") else ord("B")  # corrupt the signature
    bad = {
        "one CSR": _csr(keys.signing),
        "three CSRs": keys.csr() + _csr(keys.tls),
        "two Ed25519": _csr(keys.signing) + _csr(ed25519.Ed25519PrivateKey.generate()),
        "two ECDSA": _csr(keys.tls) + _csr(ec.generate_private_key(ec.SECP256R1())),
        "RSA": _csr(keys.signing) + _csr(rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        "P-384": _csr(keys.signing) + _csr(ec.generate_private_key(ec.SECP384R1())),
        "bad signature": _csr(keys.signing) + bytes(forged),
        "not CSRs": b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n" * 2,
        "empty": b"",
    }
    for name, pem in bad.items():
        with pytest.raises(errors.InvalidInput):
            certs.parse_csr_bundle(pem)
            pytest.fail(f"accepted: {name}")


# Enrolment and join tokens ------------------------------------------------------------------

def test_enrolment_issues_short_lived_signing_and_tls_certificates_naming_the_node(database: str) -> None:
    pool_id = seed_pool(database)
    node = enrol(database, pool_id, "gpu-01", role="node-tenant")
    ca = arun(database, lambda pool: enrolment.load_ca(pool, PkiSettings()))
    signing, tls = split(node.issued.certificate_pem)
    assert certs.raw_ed25519(signing.public_key()) == certs.raw_ed25519(node.keys.signing.public_key())
    assert certs.spki(tls.public_key()) == certs.spki(node.keys.tls.public_key())
    for cert in (signing, tls):
        cert.verify_directly_issued_by(ca.cert)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node.node_id
        assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "node-tenant"
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(hours=24) + certs.CLOCK_SKEW
    assert list(tls.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(x509.ExtensionNotFound):  # the signing certificate is not for TLS
        signing.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    assert node.issued.not_after_ms == int(tls.not_valid_after_utc.timestamp() * 1000)

    rows = sql(database, "SELECT * FROM node_certs WHERE node_id = %s ORDER BY usage", (node.node_id,))
    assert [(r["usage"], r["role"], r["serial"]) for r in rows] == [
        ("signing", "node-tenant", certs.serial_hex(signing)), ("tls", "node-tenant", certs.serial_hex(tls))]
    assert rows[0]["key_id"] == node.key_id and bytes(rows[0]["signing_key"]) == certs.raw_ed25519(
        signing.public_key())
    assert rows[1]["signing_key"] is None and rows[1]["not_after"] == tls.not_valid_after_utc
    [created] = sql(database, "SELECT pool_id, name FROM nodes WHERE id = %s", (node.node_id,))
    assert created == {"pool_id": pool_id, "name": "gpu-01"}


def test_node_certificate_lifetime_is_configurable(database: str) -> None:
    node = enrol(database, seed_pool(database), "gpu-01", settings=PkiSettings(node_cert_hours=2))
    assert node.cert.not_valid_after_utc - node.cert.not_valid_before_utc == dt.timedelta(hours=2) + certs.CLOCK_SKEW
    short = enrol(database, seed_pool(database), "gpu-02", settings=PkiSettings(node_cert_hours=0.01))
    life = short.cert.not_valid_after_utc - short.cert.not_valid_before_utc  # backdated by a tenth of a short life
    assert dt.timedelta(seconds=39) <= life <= dt.timedelta(seconds=40)


def _enrol_with(conninfo: str, secret: str, csr: bytes) -> enrolment.Issued:
    async def work(pool: Any) -> enrolment.Issued:
        ca = await enrolment.load_ca(pool, PkiSettings())
        return await enrolment.enrol(pool, ca, PkiSettings(), secret, csr)

    return arun(conninfo, work)


def test_a_join_token_enrols_once_and_only_before_it_expires(database: str) -> None:
    pool_id = seed_pool(database)
    token = arun(database, lambda pool: admin.create_join_token(pool, pool_id, "gpu-01", "", 600))
    assert token["role"] == "node" and token["secret"].startswith("bcj_")
    stored = sql(database, "SELECT token_hash FROM join_tokens")[0]["token_hash"]
    assert bytes(stored) == hashlib.sha256(token["secret"].encode()).digest()  # only the hash is kept

    with pytest.raises(errors.InvalidInput):  # a bad CSR does not spend the token
        _enrol_with(database, token["secret"], b"junk")
    issued = _enrol_with(database, token["secret"], NodeKeys().csr())
    with pytest.raises(errors.Unauthenticated):
        _enrol_with(database, token["secret"], NodeKeys().csr())
    assert sql(database, "SELECT node_id FROM join_tokens")[0]["node_id"] == issued.node_id

    with pytest.raises(errors.Unauthenticated):
        _enrol_with(database, "bcj_not-a-token", NodeKeys().csr())
    expiring = arun(database, lambda pool: admin.create_join_token(pool, pool_id, "gpu-02", "node", 1))
    time.sleep(1.1)
    with pytest.raises(errors.Unauthenticated):
        _enrol_with(database, expiring["secret"], NodeKeys().csr())


def test_one_token_raced_by_two_nodes_enrols_one(database: str) -> None:
    pool_id = seed_pool(database)
    token = arun(database, lambda pool: admin.create_join_token(pool, pool_id, "gpu-01", "node", 600))

    async def work(pool: Any) -> list[Any]:
        ca = await enrolment.load_ca(pool, PkiSettings())
        return await asyncio.gather(*(enrolment.enrol(pool, ca, PkiSettings(), token["secret"], NodeKeys().csr())
                                      for _ in range(3)), return_exceptions=True)

    results = arun(database, work)
    assert sum(isinstance(r, enrolment.Issued) for r in results) == 1
    assert sum(isinstance(r, errors.Unauthenticated) for r in results) == 2


def test_enrolling_the_same_name_again_reuses_the_node_and_revokes_its_earlier_certificates(database: str) -> None:
    pool_id = seed_pool(database)
    first = enrol(database, pool_id, "gpu-01")
    other = enrol(database, pool_id, "gpu-02")
    with psycopg.connect(database, autocommit=True) as listener:
        listener.execute(f"LISTEN {sessions.SESSION_CHANNEL}")
        again = enrol(database, pool_id, "gpu-01")
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == [first.node_id]  # sessions re-check
    assert first.node_id == again.node_id != other.node_id
    assert first.key_id != again.key_id
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        _identify(database, first.cert)
    _identify(database, again.cert)
    body = bound_report(first.node_id, "alloc_1")
    assert verify(database, "alloc_1", first.node_id, body, first.key_id, sign(first.keys.signing, body)) == (
        False, attest.REVOKED)
    reasons = sql(database, "SELECT c.serial, r.reason FROM node_certs c LEFT JOIN revocations r USING (serial)"
                            " WHERE c.node_id = %s", (first.node_id,))
    assert {r["serial"]: r["reason"] for r in reasons} == {
        **{certs.serial_hex(c): enrolment.SUPERSEDED for c in (first.cert, first.signing_cert)},
        **{certs.serial_hex(c): None for c in (again.cert, again.signing_cert)}}
    assert sql(database, "SELECT revoked_at FROM nodes WHERE id = %s", (first.node_id,)) == [{"revoked_at": None}]
    _identify(database, other.cert)  # another name is not touched


def test_a_node_revoked_by_an_operator_enrols_again_only_once_readmitted(database: str) -> None:
    pool_id = seed_pool(database)
    node = enrol(database, pool_id, "gpu-01")
    serial = certs.serial_hex(node.cert)
    arun(database, lambda pool: admin.revoke_certificates(pool, "", serial, "one key leaked"))
    enrol(database, pool_id, "gpu-01")  # revoking a certificate is not revoking the node

    arun(database, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "decommissioned"))
    token = arun(database, lambda pool: admin.create_join_token(pool, pool_id, "gpu-01", "node", 600))
    with pytest.raises(errors.AccessDenied, match="readmit") as refused:
        _enrol_with(database, token["secret"], NodeKeys().csr())
    assert refused.value.details == {"nodeId": node.node_id, "poolId": pool_id, "nodeName": "gpu-01"}
    assert sql(database, "SELECT used_at FROM join_tokens WHERE node_id IS NULL") == [{"used_at": None}]

    assert arun(database, lambda pool: admin.readmit_node(pool, node.node_id)) is True
    assert arun(database, lambda pool: admin.readmit_node(pool, node.node_id)) is False  # nothing to readmit
    assert _enrol_with(database, token["secret"], NodeKeys().csr()).node_id == node.node_id
    with pytest.raises(errors.InvalidInput):
        arun(database, lambda pool: admin.readmit_node(pool, "gpu-01"))
    with pytest.raises(errors.NotFound):
        arun(database, lambda pool: admin.readmit_node(pool, new_id("node")))


def test_join_token_requests_are_validated(database: str) -> None:
    pool_id = seed_pool(database)
    for args in ((pool_id, "gpu 01", "node", 60), (pool_id, "gpu-01", "gateway", 60),
                 (pool_id, "gpu-01", "node", 8 * 24 * 3600), ("pool_x", "gpu-01", "node", 60)):
        with pytest.raises(errors.InvalidInput):
            arun(database, lambda pool, a=args: admin.create_join_token(pool, *a))
    with pytest.raises(errors.NotFound):
        arun(database, lambda pool: admin.create_join_token(pool, new_id("pool"), "gpu-01", "node", 60))


# Peers, renewal, revocation ---------------------------------------------------------------

def _identify(conninfo: str, cert: x509.Certificate) -> enrolment.Peer:
    return arun(conninfo, lambda pool: enrolment.identify(pool, certs.pem(cert)))


def test_a_peer_is_the_node_its_recorded_certificate_names(database: str) -> None:
    pool_id = seed_pool(database)
    node = enrol(database, pool_id, "gpu-01")
    peer = _identify(database, node.cert)
    assert (peer.node_id, peer.role, peer.key_id) == (node.node_id, "node", certs.key_id(node.cert))
    with pytest.raises(errors.Unauthenticated):
        arun(database, lambda pool: enrolment.identify(pool, None))

    # Signed by our CA but never recorded (the issuing transaction rolled back): not a node.
    ca = arun(database, lambda pool: enrolment.load_ca(pool, PkiSettings()))
    now = dt.datetime.now(dt.UTC)
    stray = certs.issue(ca.key, ca.cert, public_key=NodeKeys().tls.public_key(), usage=certs.TLS, role="node",
                        common_name=node.node_id, now=now, life=dt.timedelta(hours=1))
    with pytest.raises(errors.Unauthenticated):
        _identify(database, stray)

    # A gateway's certificate is not a node's, and a signing certificate is not for TLS.
    server = arun(database, lambda pool: enrolment.gateway_certificate(pool, ca, PkiSettings(), ("localhost",)))
    for cert in (x509.load_pem_x509_certificate(server.certificate_pem), node.signing_cert):
        with pytest.raises(errors.Unauthenticated):
            _identify(database, cert)

    short = enrol(database, pool_id, "gpu-02", settings=PkiSettings(node_cert_hours=1 / 3600))
    time.sleep(1.1)
    with pytest.raises(errors.Unauthenticated, match="expired"):
        _identify(database, short.cert)


def test_renewal_keeps_the_node_and_role_and_stops_at_revocation(database: str) -> None:
    node = enrol(database, seed_pool(database), "gpu-01", role="node-tenant")
    peer = _identify(database, node.cert)
    new_keys = NodeKeys()

    async def renew(pool: Any) -> enrolment.Issued:
        ca = await enrolment.load_ca(pool, PkiSettings())
        return await enrolment.renew(pool, ca, PkiSettings(), peer, new_keys.csr())

    renewed = arun(database, renew)
    signing, cert = split(renewed.certificate_pem)
    assert (renewed.node_id, renewed.role) == (node.node_id, "node-tenant")
    assert certs.raw_ed25519(signing.public_key()) == certs.raw_ed25519(new_keys.signing.public_key())
    assert len(sql(database, "SELECT 1 FROM node_certs WHERE node_id = %s", (node.node_id,))) == 4

    arun(database, lambda pool: admin.revoke_certificates(pool, "", peer.serial, "key leaked"))
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        arun(database, renew)
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        _identify(database, node.cert)
    _identify(database, cert)  # the renewed certificate is still good


def test_revoking_a_node_revokes_all_its_certificates_and_wakes_its_sessions(database: str) -> None:
    pool_id = seed_pool(database)
    a1, a2, b = enrol(database, pool_id, "a"), enrol(database, pool_id, "a"), enrol(database, pool_id, "b")

    with psycopg.connect(database, autocommit=True) as listener:
        listener.execute(f"LISTEN {sessions.SESSION_CHANNEL}")
        serials = arun(database, lambda pool: admin.revoke_certificates(pool, a1.node_id, "", "decommissioned"))
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == [a1.node_id]
    # a1's certificates went when the name enrolled again (a2); this call revokes a2's.
    assert serials == sorted(certs.serial_hex(c) for c in (a2.cert, a2.signing_cert))
    assert arun(database, lambda pool: admin.revoke_certificates(pool, a1.node_id, "", "")) == []  # idempotent
    listed = arun(database, lambda pool: admin.list_node_certificates(pool, a1.node_id))
    assert {r["serial"] for r in listed} == {certs.serial_hex(c) for n in (a1, a2) for c in (n.cert, n.signing_cert)}
    assert all(r["revoked_at"] for r in listed)
    assert arun(database, lambda pool: admin.list_node_certificates(pool, b.node_id))[0]["revoked_at"] is None

    with pytest.raises(errors.InvalidInput):
        arun(database, lambda pool: admin.revoke_certificates(pool, a1.node_id, "ab", ""))
    with pytest.raises(errors.NotFound):
        arun(database, lambda pool: admin.revoke_certificates(pool, "", "abcdef", ""))
    with pytest.raises(errors.NotFound):
        arun(database, lambda pool: admin.list_node_certificates(pool, new_id("node")))


# The attested-report check: every branch -----------------------------------------------------

@pytest.fixture
def fleet(database: str) -> dict[str, Any]:
    pool_id = seed_pool(database)
    return {"db": database, "pool": pool_id, "a": enrol(database, pool_id, "a"), "b": enrol(database, pool_id, "b")}


def test_a_report_signed_by_the_node_about_this_allocation_bound_counts(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    body = bound_report(a.node_id, "alloc_1")
    assert verify(fleet["db"], "alloc_1", a.node_id, body, a.key_id, sign(a.keys.signing, body)) == (True, "")
    tenant = enrol(fleet["db"], fleet["pool"], "t", role="node-tenant")
    body = bound_report(tenant.node_id, "alloc_1")
    assert verify(fleet["db"], "alloc_1", tenant.node_id, body, tenant.key_id, sign(tenant.keys.signing, body))[0]


def test_an_unsigned_report_never_counts(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    body = bound_report(a.node_id, "alloc_1")
    for args in ((body, a.key_id, b""), (body, "", sign(a.keys.signing, body)), (None, None, None), (b"", a.key_id, b"x")):
        assert verify(fleet["db"], "alloc_1", a.node_id, *args) == (False, attest.UNSIGNED)


def test_a_report_signed_by_an_unknown_key_never_counts(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    body = bound_report(a.node_id, "alloc_1")
    foreign = ed25519.Ed25519PrivateKey.generate()
    assert verify(fleet["db"], "alloc_1", a.node_id, body, "00" * 32, sign(foreign, body)) == (False, attest.UNKNOWN_KEY)


def test_a_report_signed_by_another_nodes_certificate_never_counts(fleet: dict[str, Any]) -> None:
    a, b = fleet["a"], fleet["b"]
    body = bound_report(a.node_id, "alloc_1")
    assert verify(fleet["db"], "alloc_1", a.node_id, body, b.key_id, sign(b.keys.signing, body)) == (
        False, attest.OTHER_NODE)
    ca = arun(fleet["db"], lambda pool: enrolment.load_ca(pool, PkiSettings()))
    server = arun(fleet["db"], lambda pool: enrolment.gateway_certificate(pool, ca, PkiSettings(), ("localhost",)))
    gateway_kid = certs.key_id(x509.load_pem_x509_certificate(server.certificate_pem))
    assert verify(fleet["db"], "alloc_1", a.node_id, body, gateway_kid, b"x" * 64) == (False, attest.OTHER_NODE)
    # The node's own TLS certificate signs no reports (its ECDSA key is not the signing key).
    tls_kid = certs.key_id(a.cert)
    signature = a.keys.tls.sign(attest.signed_message(body), ec.ECDSA(hashes.SHA256()))
    assert verify(fleet["db"], "alloc_1", a.node_id, body, tls_kid, signature) == (False, attest.BAD_SIGNATURE)


def test_a_report_signed_by_a_revoked_certificate_never_counts(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    body = bound_report(a.node_id, "alloc_1")
    arun(fleet["db"], lambda pool: admin.revoke_certificates(pool, "", certs.serial_hex(a.signing_cert), ""))
    assert verify(fleet["db"], "alloc_1", a.node_id, body, a.key_id, sign(a.keys.signing, body)) == (
        False, attest.REVOKED)


def test_an_expired_certificate_counts_only_within_the_offline_grace(fleet: dict[str, Any]) -> None:
    short = enrol(fleet["db"], fleet["pool"], "s", settings=PkiSettings(node_cert_hours=1 / 3600))
    time.sleep(1.2)
    body = bound_report(short.node_id, "alloc_1")
    signature = sign(short.keys.signing, body)
    assert verify(fleet["db"], "alloc_1", short.node_id, body, short.key_id, signature, dt.timedelta(0)) == (
        False, attest.EXPIRED)
    assert verify(fleet["db"], "alloc_1", short.node_id, body, short.key_id, signature, GRACE) == (True, "")


def test_a_role_that_runs_no_workloads_never_counts(fleet: dict[str, Any]) -> None:
    tenant = enrol(fleet["db"], fleet["pool"], "t", role="node-tenant")
    body = bound_report(tenant.node_id, "alloc_1")
    assert verify(fleet["db"], "alloc_1", tenant.node_id, body, tenant.key_id, sign(tenant.keys.signing, body),
                  roles=frozenset({"node"})) == (False, attest.ROLE)


def test_a_bad_signature_never_counts(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    body = bound_report(a.node_id, "alloc_1")
    other = ed25519.Ed25519PrivateKey.generate()
    cases = [sign(other, body),  # the right key id, another key
             sign(a.keys.signing, bound_report(a.node_id, "alloc_2")),  # a signature over another body
             a.keys.signing.sign(body),  # no purpose prefix
             b"\x00" * 10]
    for signature in cases:
        assert verify(fleet["db"], "alloc_1", a.node_id, body, a.key_id, signature) == (False, attest.BAD_SIGNATURE)


def test_a_genuine_signature_over_anything_but_this_allocation_bound_never_counts(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    for body in (bound_report(a.node_id, "alloc_2"),  # another allocation
                 bound_report(a.node_id, "alloc_1", failed=True),  # not a bind
                 bound_report(fleet["b"].node_id, "alloc_1"),  # says it is another node
                 b"\xff\xff\xff"):  # not a Report at all
        assert verify(fleet["db"], "alloc_1", a.node_id, body, a.key_id, sign(a.keys.signing, body)) == (
            False, attest.NOT_THIS_BOUND)


def test_a_report_dated_in_the_future_or_before_its_certificate_never_counts(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    issued_ms = int(a.signing_cert.not_valid_before_utc.timestamp() * 1000)
    now_ms = int(time.time() * 1000)
    skew = dt.timedelta(minutes=1)
    cases = {now_ms + 30_000: (True, ""),  # within the skew
             now_ms + 90_000: (False, attest.FROM_THE_FUTURE),
             issued_ms - 30_000: (True, ""),
             issued_ms - 90_000: (False, attest.BEFORE_CERTIFICATE),
             0: (False, attest.BEFORE_CERTIFICATE)}  # no time at all
    for at_ms, expected in cases.items():
        body = bound_report(a.node_id, "alloc_1", at_ms=at_ms)
        assert verify(fleet["db"], "alloc_1", a.node_id, body, a.key_id, sign(a.keys.signing, body),
                      clock_skew=skew) == expected, at_ms


# The NodeAdmin API over real gRPC -----------------------------------------------------------

class AdminServer:
    """NodeAdmin behind the control plane's interceptor, on a loopback port, in its own loop."""

    def __init__(self, conninfo: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.pool, port = self.call(self._start(conninfo))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = nodes_pb2_grpc.NodeAdminStub(self.channel)

    async def _start(self, conninfo: str) -> tuple[grpc.aio.Server, Any, int]:
        pool = await db.open_pool(conninfo, size=4)
        server = grpc.aio.server(interceptors=[ApiInterceptor(pool)])
        nodes_pb2_grpc.add_NodeAdminServicer_to_server(NodeAdminServicer(Runtime(pool, Settings())), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, pool, port

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop(0))
        self.call(self.pool.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():  # its selector and self-pipe: no descriptors left behind
            self.loop.close()


@pytest.fixture
def node_admin(database: str) -> Iterator[tuple[AdminServer, tuple[tuple[str, str], ...]]]:
    server = AdminServer(database)
    token = bootstrap.ensure_root(database)
    try:
        yield server, (("authorization", f"Bearer {token}"),)
    finally:
        server.close()


def test_node_admin_issues_tokens_lists_and_revokes_certificates_for_root(database: str, node_admin: Any) -> None:
    server, root = node_admin
    pool_id = seed_pool(database)
    token = server.stub.CreateJoinToken(npb.CreateJoinTokenRequest(pool_id=pool_id, node_name="gpu-01",
                                                                   role="node-tenant", ttl_seconds=60), metadata=root)
    assert token.role == "node-tenant" and token.expires_at > time.time() * 1000
    issued = _enrol_with(database, token.secret, NodeKeys().csr())

    listed = server.stub.ListNodeCertificates(npb.ListNodeCertificatesRequest(node_id=issued.node_id), metadata=root)
    assert sorted(i.usage for i in listed.items) == ["signing", "tls"]
    assert all(i.role == "node-tenant" and not i.revoked for i in listed.items)
    assert b"".join(sorted(i.certificate_pem.encode() for i in listed.items)) == b"".join(
        sorted(certs.pem(c) for c in split(issued.certificate_pem)))
    item = next(i for i in listed.items if i.usage == "tls")
    revoked = server.stub.RevokeCertificates(npb.RevokeCertificatesRequest(serial=item.serial), metadata=root)
    assert list(revoked.serials) == [item.serial]
    again = server.stub.ListNodeCertificates(npb.ListNodeCertificatesRequest(node_id=issued.node_id), metadata=root)
    assert {i.usage: (i.revoked, i.revoked_at > 0) for i in again.items} == {
        "tls": (True, True), "signing": (False, False)}

    ca = server.stub.ExportCaCertificate(npb.ExportCaCertificateRequest(), metadata=root)
    loaded = arun(database, lambda pool: enrolment.load_ca(pool, PkiSettings()))
    assert ca.certificate_pem.encode() == loaded.pem and ca.fingerprint == loaded.fingerprint


def test_node_admin_is_root_only_and_maps_errors(database: str, node_admin: Any) -> None:
    server, root = node_admin
    pool_id = seed_pool(database)
    with psycopg.connect(database) as conn:
        conn.execute("INSERT INTO identities (id, kind, name) VALUES ('u', 'user', 'u')")
        conn.execute("INSERT INTO memberships (tenant_id, identity_id) VALUES ('acme', 'u')")
        conn.execute("INSERT INTO api_tokens (token_hash, identity_id) VALUES (sha256('bct_user'), 'u')")
    user = (("authorization", "Bearer bct_user"),)
    with pytest.raises(grpc.RpcError) as denied:
        server.stub.CreateJoinToken(npb.CreateJoinTokenRequest(pool_id=pool_id, node_name="n"), metadata=user)
    assert rpc_error(denied)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    with pytest.raises(grpc.RpcError) as anonymous:
        server.stub.ExportCaCertificate(npb.ExportCaCertificateRequest())
    assert rpc_error(anonymous)[0] == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as bad_role:
        server.stub.CreateJoinToken(npb.CreateJoinTokenRequest(pool_id=pool_id, node_name="n", role="root"),
                                    metadata=root)
    assert rpc_error(bad_role)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT")
    with pytest.raises(grpc.RpcError) as missing:
        server.stub.RevokeCertificates(npb.RevokeCertificatesRequest(node_id=new_id("node")), metadata=root)
    assert rpc_error(missing)[:2] == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
    with pytest.raises(grpc.RpcError) as not_root:
        server.stub.ReadmitNode(npb.ReadmitNodeRequest(node_id=new_id("node")), metadata=user)
    assert rpc_error(not_root)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    with pytest.raises(grpc.RpcError) as bad_id:
        server.stub.ReadmitNode(npb.ReadmitNodeRequest(node_id="gpu-01"), metadata=root)
    assert rpc_error(bad_id) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", {"field": "nodeId"})
