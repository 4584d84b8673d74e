"""Hostile review, round 26p: the node PKI and attested reports, tried as a hostile node would.
Real PostgreSQL, real certificates from the control-plane CA, real Ed25519 signatures.

- **A key certified once was certified again.** The CA checked that a CSR proves its key, never
  that the key was new: a renewal or an enrolment could bring keys already certified, the node's
  own (a revoked certificate's too) or another node's (its CSR bundle, copied: the CSRs prove the
  keys, not who sends them). So a node revoked because its key was stolen, readmitted and enrolled
  again with the same keys gave the thief a live certificate for the stolen key, and every report
  the thief signed with it counted; and a report the node signed just before its revocation
  (within the clock skew of the new certificate's start) counted under the new key id. Now a key any certificate names is never certified
  again (INVALID_INPUT, the join token not spent). A lost enrolment's answer is still answered
  again, and so now is a lost renewal's (the same CSRs get the live certificates that renewal
  issued, in the node's current role): neither issues anything.
- **A node whose signing certificate was revoked went on signing with it.** Revoking one
  certificate by serial (its key leaked) left the node's TLS certificate, and its session, good:
  the node signed every report with the revoked key until its next renewal, half a certificate's
  life later, so every report was rejected (each bound re-report a BindingLost) with nothing to
  tell the node. Now revoking a node's signing certificate sends its sessions a RenewHint; the
  node renews with new keys and its reports count again. (Found probing revocations; a hostile
  node gains nothing from it, an honest one lost its bindings.)
- **A node renewing in a loop cost a read per call.** Past its burst a renewal is refused, but
  only after a read of the node's certificate (the throttle is per node, and the read says whose
  it is): a node calling Renew in a loop over one connection took a read from the gateway's small
  pool per call, unpaced. The gateway now paces a renewal before the read, by the name the CA
  wrote in the TLS peer's certificate (as round 26n paces session opens).

What held, kept here so it stays held: what a CSR asks for (another node's CN, the OU `gateway`,
extra subject attributes, SANs, CA:TRUE, serverAuth) is never what it gets, the node's own name and
the role the control plane gives it; an Ed448 (or RSA, P-384: tests/test_pki.py) key is refused; a
renewal racing a re-enrolment of the node's name ends with only the enrolment's keys live,
whichever takes the node's row first; an expired certificate never renews, the offline grace
notwithstanding; a node's TLS certificate cannot serve as a gateway (clientAuth only: a client
trusting the CA refuses it), nor a gateway's server certificate open a node session or renew; a
join token enrols its own name in its own pool as a node whatever its CSRs name, and takes no
lifetime beyond 7 days (nor a negative one) nor a role but `node` or `node-tenant`; one CSR
bundle enrolled under two names at once is certified once (the per-key lock); a stolen key's
report counts neither under its revoked certificate nor under the node's new one.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent import futures
from typing import Any

import grpc
import psycopg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed448, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc

from controlplane import errors
from controlplane.pki import admin, attest, certs, enrolment
from controlplane.pki.config import PkiSettings
from gateway.config import GatewaySettings
from tests.support import rpc_error
from tests.test_gateway import GatewayThread, Session, connected, enrolled, gateway, pool_id  # noqa: F401
from tests.test_gateway import eventually as until
from tests.test_pki import (Enrolled, NodeKeys, _enrol_with, _identify, arun, bound_report, enrol, seed_pool,
                            sign, split, sql, verify)


def _renew(conninfo: str, by: Enrolled, keys: NodeKeys) -> enrolment.Issued:
    peer = _identify(conninfo, by.cert)

    async def work(pool: Any) -> enrolment.Issued:
        ca = await enrolment.load_ca(pool, PkiSettings())
        return await enrolment.renew(pool, ca, PkiSettings(), peer, keys.csr())

    return arun(conninfo, work)


def _token(conninfo: str, pool_id: str, name: str) -> str:
    return arun(conninfo, lambda pool: admin.create_join_token(pool, pool_id, name, "node", 600))["secret"]


# Keys certified again ----------------------------------------------------------------------------

def test_a_stolen_key_is_never_certified_again_after_the_nodes_revocation(database: str) -> None:
    """Attack: the node's keys are stolen; the operator revokes the node, readmits it and gives it a
    new join token; the daemon enrols again with the keys on its disk (the stolen ones). The thief's
    reports, signed with the stolen key and naming the new certificate's key id, must not count."""
    pool_id = seed_pool(database)
    node = enrol(database, pool_id, "gpu-01")
    arun(database, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "keys stolen"))
    arun(database, lambda pool: admin.readmit_node(pool, node.node_id))
    token = _token(database, pool_id, "gpu-01")
    with pytest.raises(errors.InvalidInput, match="already certified"):
        _enrol_with(database, token, node.keys.csr())
    for mixed in (NodeKeys(tls=node.keys.tls), NodeKeys(signing=node.keys.signing)):  # one old key is enough
        with pytest.raises(errors.InvalidInput, match="already certified"):
            _enrol_with(database, token, mixed.csr())
    assert sql(database, "SELECT used_at FROM join_tokens WHERE node_id IS NULL") == [{"used_at": None}]
    fresh = NodeKeys()
    again = Enrolled(fresh, _enrol_with(database, token, fresh.csr()))  # new keys: enrolled
    assert again.node_id == node.node_id
    body = bound_report(node.node_id, "alloc_1")  # the thief, with the stolen key
    stolen = sign(node.keys.signing, body)
    assert verify(database, "alloc_1", node.node_id, body, again.key_id, stolen) == (False, attest.BAD_SIGNATURE)
    assert verify(database, "alloc_1", node.node_id, body, node.key_id, stolen) == (False, attest.REVOKED)
    assert verify(database, "alloc_1", node.node_id, body, again.key_id, sign(fresh.signing, body)) == (True, "")


def test_one_csr_bundle_enrolled_by_two_names_at_once_is_certified_once(database: str) -> None:
    """Two enrolments (two tokens, two names) racing with one CSR bundle: the per-key lock makes the
    second see the first's certificates, so exactly one is issued."""
    pool_id = seed_pool(database)
    keys, tokens = NodeKeys(), [_token(database, pool_id, name) for name in ("a", "b")]
    results: list[Any] = []

    def attempt(token: str) -> None:
        try:
            results.append(_enrol_with(database, token, keys.csr()))
        except errors.DomainError as exc:
            results.append(exc)

    threads = [threading.Thread(target=attempt, args=(t,)) for t in tokens]
    first_key = min(certs.spki(keys.signing.public_key()), certs.spki(keys.tls.public_key()))
    waiting = ("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
               " AND wait_event = 'advisory' AND datname = current_database()")
    with psycopg.connect(database, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", ("pki:key:" + first_key.hex(),))
        for thread in threads:
            thread.start()
        until(lambda: sql(database, waiting)[0]["n"] >= 2, what="both enrolments waiting for the key")
        holder.execute("SELECT pg_advisory_unlock_all()")
    for thread in threads:
        thread.join(30)
    assert sorted(type(r).__name__ for r in results) == ["InvalidInput", "Issued"]
    assert sql(database, "SELECT count(*) AS n FROM node_certs WHERE public_key = %s", (first_key,)) == [{"n": 1}]


def test_a_renewal_brings_new_keys_never_its_own_nor_another_nodes(database: str) -> None:
    """Attack: a renewal CSR carrying another node's keys (its CSR bundle, copied on its way to the
    gateway), or the node's own mixed with another's. The node's own current keys get its current
    certificates back (a lost answer's retry), nothing new."""
    pool_id = seed_pool(database)
    a, b = enrol(database, pool_id, "a"), enrol(database, pool_id, "b")
    for keys in (b.keys, NodeKeys(signing=a.keys.signing, tls=b.keys.tls), NodeKeys(signing=b.keys.signing)):
        with pytest.raises(errors.InvalidInput, match="already certified"):
            _renew(database, a, keys)
    assert _renew(database, a, a.keys).certificate_pem == a.issued.certificate_pem
    stranger = NodeKeys()  # a CSR bundle not certified yet, sent by two nodes: the first one gets it
    assert _renew(database, b, stranger).node_id == b.node_id
    with pytest.raises(errors.InvalidInput, match="already certified"):
        _renew(database, a, stranger)
    renewed = Enrolled(NodeKeys(), None)  # type: ignore[arg-type]
    renewed.issued = _renew(database, a, renewed.keys)
    assert renewed.node_id == a.node_id
    assert sql(database, "SELECT count(*) AS n FROM node_certs WHERE node_id = %s", (a.node_id,)) == [{"n": 4}]
    body = bound_report(a.node_id, "alloc_1")
    assert verify(database, "alloc_1", a.node_id, body, renewed.key_id, sign(renewed.keys.signing, body)) == (
        True, "")
    assert verify(database, "alloc_1", a.node_id, body, renewed.key_id, sign(a.keys.signing, body)) == (
        False, attest.BAD_SIGNATURE)


# A revoked signing certificate --------------------------------------------------------------------

def test_a_node_whose_signing_certificate_is_revoked_is_told_to_renew(gateway: GatewayThread, pool_id: str) -> None:
    """The operator revokes a node's report-signing certificate by serial (its key leaked). Its TLS
    certificate is still good, so its session went on, and the node went on signing with the revoked
    key until its next renewal (half a certificate's life): every report rejected, each bound
    re-report a BindingLost. Now its sessions get a RenewHint, and with the renewed key its reports
    count again."""
    node, session = connected(gateway, pool_id, "n1")
    serial = certs.serial_hex(x509.load_pem_x509_certificate(node.signing_pem))
    arun(gateway.conninfo, lambda pool: admin.revoke_certificates(pool, "", serial, "signing key leaked"))
    assert session.recv("renew_hint", timeout=30) is not None
    fresh = NodeKeys()
    with node.channel() as ch:
        renewed = node_pb2_grpc.NodeGatewayStub(ch).Renew(pb.RenewRequest(csr_pem=fresh.csr()), timeout=10)
    node.keys = fresh
    node.certified(renewed.certificate_pem)
    body = bound_report(node.node_id, "alloc_1")
    assert verify(gateway.conninfo, "alloc_1", node.node_id, body, node.key_id, sign(fresh.signing, body)) == (True, "")
    session.close()


# Renewing in a loop -------------------------------------------------------------------------------

def test_a_node_renewing_in_a_loop_past_its_burst_is_refused_without_a_read(database: str, pool_id: str) -> None:
    """Past its burst a renewal is refused (QUOTA_EXCEEDED), but each call first read the node's
    certificate to learn who it was (the throttle is per node): a node calling Renew in a loop over
    one connection cost the gateway's small pool a read per call, unpaced. Now the node's turn is
    taken by the TLS peer's certified name before the read: with node_certs locked (a read would
    wait) the refusal still comes at once."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_renewals_per_hour=1,
                                                     node_renewals_burst=1))
    try:
        node = enrolled(gw, pool_id, "loops")
        with node.channel() as channel:
            stub = node_pb2_grpc.NodeGatewayStub(channel)
            assert stub.Renew(pb.RenewRequest(csr_pem=NodeKeys().csr()), timeout=10).certificate_pem
            with psycopg.connect(database) as holder:
                holder.execute("LOCK TABLE node_certs IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Renew(pb.RenewRequest(csr_pem=NodeKeys().csr()), timeout=10)
                holder.rollback()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        assert rpc_error(refused)[1] == "QUOTA_EXCEEDED"
    finally:
        gw.stop()


# What held ----------------------------------------------------------------------------------------

def _csr_asking(key: Any, *, common_name: str, unit: str, sans: list[str], ca: bool) -> bytes:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Better Compute"),
                         x509.NameAttribute(NameOID.EMAIL_ADDRESS, "root@example.com")])
    builder = (x509.CertificateSigningRequestBuilder().subject_name(subject)
               .add_extension(x509.SubjectAlternativeName([x509.DNSName(s) for s in sans]), critical=False)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    algorithm = None if isinstance(key, (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM)


def test_what_a_csr_asks_for_is_never_what_it_gets(database: str) -> None:
    """A renewal (and an enrolment) whose CSRs name another node, the role `gateway`, extra subject
    attributes, SANs, CA:TRUE and serverAuth get the node's own name and role, and nothing else;
    an Ed448 signing key (or an RSA, P-384 TLS key) is refused."""
    pool_id = seed_pool(database)
    a, b = enrol(database, pool_id, "a"), enrol(database, pool_id, "b")
    keys = NodeKeys()
    asking = b"".join(_csr_asking(k, common_name=b.node_id, unit="gateway", sans=["gateway.example", "localhost"],
                                  ca=True) for k in (keys.signing, keys.tls))
    peer = _identify(database, a.cert)

    async def work(pool: Any) -> enrolment.Issued:
        ca = await enrolment.load_ca(pool, PkiSettings())
        return await enrolment.renew(pool, ca, PkiSettings(), peer, asking)

    issued = arun(database, work)
    assert (issued.node_id, issued.role) == (a.node_id, "node")
    for cert in split(issued.certificate_pem):
        assert cert.subject.rfc4514_string() == f"CN={a.node_id},OU=node,O=Better Compute"
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
        with pytest.raises(x509.ExtensionNotFound):
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert certs.usage_of(split(issued.certificate_pem)[1]) == certs.TLS  # clientAuth, never serverAuth
    other = NodeKeys()  # a join token for "c" with CSRs naming b, role gateway: c, as a node
    joined = _enrol_with(database, _token(database, pool_id, "c"), b"".join(
        _csr_asking(k, common_name=b.node_id, unit="gateway", sans=["b"], ca=True) for k in (other.signing, other.tls)))
    assert joined.node_id != b.node_id and joined.role == "node"
    assert sql(database, "SELECT name, pool_id FROM nodes WHERE id = %s", (joined.node_id,)) == [
        {"name": "c", "pool_id": pool_id}]
    ed448_bundle = (_csr_asking(ed448.Ed448PrivateKey.generate(), common_name="n", unit="node", sans=["x"], ca=False)
                    + _csr_asking(NodeKeys().tls, common_name="n", unit="node", sans=["x"], ca=False))
    with pytest.raises(errors.InvalidInput, match="Ed25519"):
        _enrol_with(database, _token(database, pool_id, "d"), ed448_bundle)


def test_a_renewal_racing_a_re_enrolment_of_the_name_leaves_only_the_enrolments_keys(database: str) -> None:
    """A node renewing while its name is enrolled again (the machine replaced): whichever takes the
    node's row first, afterwards only the enrolment's certificates are live; the renewal is refused
    or its certificates revoked with the rest."""
    pool_id = seed_pool(database)
    node = enrol(database, pool_id, "gpu-01")
    token = _token(database, pool_id, "gpu-01")
    results: dict[str, Any] = {}

    def attempt(name: str, call: Any) -> None:
        try:
            results[name] = call()
        except errors.DomainError as exc:
            results[name] = exc

    fresh = NodeKeys()
    renewing = threading.Thread(target=attempt, args=("renewal", lambda: _renew(database, node, NodeKeys())))
    enrolling = threading.Thread(target=attempt, args=("enrolment", lambda: _enrol_with(database, token, fresh.csr())))
    waiting = ("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
               " AND datname = current_database()")
    with psycopg.connect(database) as holder:
        holder.execute("SELECT 1 FROM nodes WHERE id = %s FOR UPDATE", (node.node_id,))
        renewing.start()
        enrolling.start()
        until(lambda: sql(database, waiting)[0]["n"] >= 2, what="the renewal and the enrolment waiting")
        holder.rollback()
    renewing.join(30)
    enrolling.join(30)
    assert isinstance(results["enrolment"], enrolment.Issued)
    live = {r["key_id"] for r in sql(database, "SELECT c.key_id FROM node_certs c LEFT JOIN revocations r"
                                               " USING (serial) WHERE c.node_id = %s AND r.serial IS NULL",
                                     (node.node_id,))}
    assert live == {certs.key_id(c) for c in split(results["enrolment"].certificate_pem)}


def test_an_expired_certificate_never_renews_within_the_offline_grace(database: str) -> None:
    """The offline grace lets an expired certificate's reports count; it never lets it renew, even
    for a peer identified while the certificate was still good."""
    pool_id = seed_pool(database)
    short = enrol(database, pool_id, "s", settings=PkiSettings(node_cert_hours=2 / 3600))
    peer = _identify(database, short.cert)
    until(lambda: sql(database, "SELECT now() > %s AS past", (peer.not_after,))[0]["past"], what="expiry")

    async def work(pool: Any) -> enrolment.Issued:
        ca = await enrolment.load_ca(pool, PkiSettings())
        return await enrolment.renew(pool, ca, PkiSettings(), peer, NodeKeys().csr())

    with pytest.raises(errors.Unauthenticated, match="expired"):
        arun(database, work)


def _health(endpoint: str, ca_pem: bytes, target: str, key_pem: bytes | None = None,
            cert_pem: bytes | None = None) -> grpc.StatusCode:
    """The code of a health check over TLS trusting only the CA (OK when the handshake passed)."""
    credentials = grpc.ssl_channel_credentials(ca_pem, key_pem, cert_pem)
    with grpc.secure_channel(endpoint, credentials, options=[("grpc.ssl_target_name_override", target)]) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_node_certificate_never_serves_as_a_gateway_nor_a_gateways_as_a_node(gateway: GatewayThread,
                                                                             pool_id: str) -> None:
    """A node that listens with its TLS certificate (CA-signed, its id as CN) to play the gateway
    for other nodes: a client trusting the CA refuses it (clientAuth only), as it accepts a real
    gateway certificate served the same way. A gateway's server certificate as a node's client
    certificate opens no session and renews nothing."""
    node = enrolled(gateway, pool_id, "n1")
    ca = arun(gateway.conninfo, lambda pool: enrolment.load_ca(pool, PkiSettings()))
    server_cert = arun(gateway.conninfo, lambda pool: enrolment.gateway_certificate(pool, ca, PkiSettings(),
                                                                                      ("127.0.0.1",)))
    for key_pem, cert_pem, target, expected in (
            (node.key_pem(), node.cert_pem, node.node_id, grpc.StatusCode.UNAVAILABLE),
            (server_cert.key_pem, server_cert.certificate_pem, "127.0.0.1", grpc.StatusCode.OK)):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, cert_pem)]))
        server.start()
        try:
            assert _health(f"127.0.0.1:{port}", gateway.ca_pem, target) == expected
        finally:
            server.stop(None)

    issued = sql(gateway.conninfo, "SELECT count(*) AS n FROM node_certs")
    creds = grpc.ssl_channel_credentials(gateway.ca_pem, server_cert.key_pem, server_cert.certificate_pem)
    with grpc.secure_channel(gateway.endpoint, creds) as ch:
        with pytest.raises(grpc.RpcError) as renew:
            node_pb2_grpc.NodeGatewayStub(ch).Renew(pb.RenewRequest(csr_pem=NodeKeys().csr()), timeout=10)
        assert renew.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
        session = Session(ch)
        assert session.ended(10).code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    assert sql(gateway.conninfo, "SELECT count(*) AS n FROM node_certs") == issued


def test_a_renewal_retried_after_its_answer_was_lost_gets_the_same_certificates(database: str) -> None:
    """A key is certified once, so a daemon that retries a renewal with the same CSRs (its answer
    lost on the way) gets the certificates that renewal issued, nothing new; not once they are
    revoked, nor in a role the node no longer has."""
    pool_id = seed_pool(database)
    node = enrol(database, pool_id, "gpu-01")
    keys = NodeKeys()
    first = _renew(database, node, keys)
    assert _renew(database, node, keys) == first
    assert sql(database, "SELECT count(*) AS n FROM node_certs WHERE node_id = %s", (node.node_id,)) == [{"n": 4}]
    sql(database, "UPDATE nodes SET state = 'leased' WHERE id = %s", (node.node_id,))  # a machine lease began
    with pytest.raises(errors.InvalidInput, match="already certified"):  # node-tenant now: new keys
        _renew(database, node, keys)
    sql(database, "UPDATE nodes SET state = 'ready' WHERE id = %s", (node.node_id,))
    signing = certs.serial_hex(split(first.certificate_pem)[0])
    arun(database, lambda pool: admin.revoke_certificates(pool, "", signing, "leaked"))
    with pytest.raises(errors.InvalidInput, match="already certified"):
        _renew(database, node, keys)


def test_join_tokens_take_no_absurd_lifetime_nor_a_role_beyond_a_nodes(database: str) -> None:
    pool_id = seed_pool(database)
    for ttl in (-1, -2**63, 2**63 - 1, 7 * 24 * 3600 + 1):
        with pytest.raises(errors.InvalidInput, match="ttlSeconds"):
            arun(database, lambda pool, t=ttl: admin.create_join_token(pool, pool_id, "n", "node", t))
    for role in ("gateway", "NODE", "node ", "node,gateway", "admin"):
        with pytest.raises(errors.InvalidInput, match="role"):
            arun(database, lambda pool, r=role: admin.create_join_token(pool, pool_id, "n", r, 60))
    assert sql(database, "SELECT count(*) AS n FROM join_tokens") == [{"n": 0}]
