"""Pure X.509 (no database): the CA, node CSR bundles, issuing certificates, reading them back.

A node has two keys, each certified for the node: an Ed25519 report-signing key (DESIGN §12) and
an ECDSA P-256 TLS key (grpc Python's TLS cannot handshake with Ed25519). On the wire (node.proto
has one CSR field) `csr_pem` carries both PEM CSRs, and `certificate_pem` both certificates, the
signing one first; the node matches them to its keys by public key. Both certificates have the
subject `O=Better Compute, OU=<role>, CN=<node id>`; the TLS one has extended key usage
clientAuth. A report's key id is the SHA-256 of the signing certificate's DER.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from controlplane import errors

ORGANIZATION = "Better Compute"
CA_COMMON_NAME = "Better Compute control-plane CA"
MAX_CSR_BYTES = 16 * 1024
CLOCK_SKEW = dt.timedelta(minutes=5)  # certificates start this much in the past (a tenth of a short life)
_CSR_END = b"-----END CERTIFICATE REQUEST-----"

SIGNING, TLS, SERVER = "signing", "tls", "server"  # what a certificate is for (node_certs.usage)

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey


def key_id(cert: x509.Certificate) -> str:
    """The SHA-256 (hex) of the certificate's DER: the key id of the reports it signs."""
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def serial_hex(cert: x509.Certificate) -> str:
    return format(cert.serial_number, "x")


def spki(public_key: PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def raw_ed25519(public_key: ed25519.Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def backdate(life: dt.timedelta) -> dt.timedelta:
    return min(CLOCK_SKEW, life / 10)


# CSR bundles --------------------------------------------------------------------------------

def _csr(key: PrivateKey) -> bytes:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM)


def build_csr_bundle(signing_key: ed25519.Ed25519PrivateKey, tls_key: ec.EllipticCurvePrivateKey) -> bytes:
    """What a node sends as csr_pem: the signing CSR, then the TLS CSR (the CA ignores subjects)."""
    return _csr(signing_key) + _csr(tls_key)


@dataclass(frozen=True)
class CsrBundle:
    signing: ed25519.Ed25519PublicKey
    tls: ec.EllipticCurvePublicKey


def parse_csr_bundle(csr_pem: bytes) -> CsrBundle:
    """Two CSRs with valid self-signatures (each proves its key): one Ed25519, one ECDSA P-256."""
    if not csr_pem or len(csr_pem) > MAX_CSR_BYTES:
        raise errors.InvalidInput("csr_pem", "must be PEM CSRs, at most 16 KiB")
    blocks = [b.strip() + b"\n" + _CSR_END + b"\n" for b in csr_pem.split(_CSR_END) if b.strip()]
    if len(blocks) != 2:
        raise errors.InvalidInput("csr_pem", "must hold two CSRs: the Ed25519 signing key's and the TLS key's")
    signing: ed25519.Ed25519PublicKey | None = None
    tls: ec.EllipticCurvePublicKey | None = None
    for block in blocks:
        try:
            csr = x509.load_pem_x509_csr(block)
            valid, key = csr.is_signature_valid, csr.public_key()
        except ValueError:
            raise errors.InvalidInput("csr_pem", "is not PEM PKCS#10 CSRs") from None
        if not valid:
            raise errors.InvalidInput("csr_pem", "a CSR's signature does not verify")
        if isinstance(key, ed25519.Ed25519PublicKey) and signing is None:
            signing = key
        elif isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1) and tls is None:
            tls = key
        else:
            raise errors.InvalidInput("csr_pem", "needs one Ed25519 key and one ECDSA P-256 key")
    assert signing is not None and tls is not None
    return CsrBundle(signing, tls)


# Issuing ------------------------------------------------------------------------------------

def _sign(builder: x509.CertificateBuilder, key: PrivateKey) -> x509.Certificate:
    return builder.sign(key, None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256())


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         encipher_only=False, decipher_only=False)


def new_ca(now: dt.datetime, years: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                      x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    builder = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + dt.timedelta(days=365 * years))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return key, _sign(builder, key)


def issue(
    ca_key: PrivateKey, ca_cert: x509.Certificate, *, public_key: PublicKey, usage: str, role: str,
    common_name: str, now: dt.datetime, life: dt.timedelta, hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    """A leaf: a node's signing or TLS client certificate, or a gateway's server certificate for `hosts`."""
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                         x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
        .public_key(public_key).serial_number(x509.random_serial_number())
        .not_valid_before(now - backdate(life)).not_valid_after(now + life)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if usage != SIGNING:
        purpose = ExtendedKeyUsageOID.SERVER_AUTH if usage == SERVER else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False)
    return _sign(builder, ca_key)


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


# Reading certificates back ------------------------------------------------------------------

@dataclass(frozen=True)
class CertFacts:
    serial: str
    key_id: str
    usage: str
    role: str
    common_name: str  # the node id (or "gateway")
    not_before: dt.datetime
    not_after: dt.datetime
    public_key: bytes  # SubjectPublicKeyInfo DER
    signing_key: bytes | None  # raw Ed25519, for a signing certificate


def _attribute(name: x509.Name, oid: x509.ObjectIdentifier) -> str:
    values = name.get_attributes_for_oid(oid)
    return str(values[0].value) if len(values) == 1 else ""


def usage_of(cert: x509.Certificate) -> str:
    if isinstance(cert.public_key(), ed25519.Ed25519PublicKey):
        return SIGNING
    try:
        purposes = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return TLS
    return SERVER if ExtendedKeyUsageOID.SERVER_AUTH in purposes else TLS


def facts(cert: x509.Certificate) -> CertFacts:
    public_key = cert.public_key()
    return CertFacts(
        serial=serial_hex(cert), key_id=key_id(cert), usage=usage_of(cert),
        role=_attribute(cert.subject, NameOID.ORGANIZATIONAL_UNIT_NAME),
        common_name=_attribute(cert.subject, NameOID.COMMON_NAME),
        not_before=cert.not_valid_before_utc, not_after=cert.not_valid_after_utc,
        public_key=spki(public_key),  # type: ignore[arg-type]
        signing_key=raw_ed25519(public_key) if isinstance(public_key, ed25519.Ed25519PublicKey) else None,
    )
