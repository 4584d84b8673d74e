"""Pure X.509 (no database): the CA, node CSRs, issuing certificates, reading them back.

A node certificate: subject `O=Better Compute, OU=<role>, CN=<node id>`, extended key usage
clientAuth, and the node's Ed25519 report-signing key in the extension `SIGNING_KEY_OID`, whose
value is the DER `SEQUENCE { OCTET STRING key (32 bytes), OCTET STRING proof (64 bytes) }` with
proof = Ed25519(signing key, SIGNING_KEY_PURPOSE || SubjectPublicKeyInfo DER of the TLS key): the
node proves it holds the key it asks the CA to certify, bound to this TLS key. A node puts the
same extension in its CSR (`build_csr` shows how); the CA checks it and copies it over.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from controlplane import errors
from controlplane.pki import GATEWAY

# A UUID-based OID (ITU-T X.667, arc 2.25): ours without registering a private enterprise number.
SIGNING_KEY_OID = x509.ObjectIdentifier("2.25.131991232204660843171121375611500670581")
SIGNING_KEY_PURPOSE = b"bc-signing-key\x00"
ORGANIZATION = "Better Compute"
CA_COMMON_NAME = "Better Compute control-plane CA"
MAX_CSR_BYTES = 16 * 1024
CLOCK_SKEW = dt.timedelta(minutes=5)  # certificates start a little in the past

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


# The signing-key extension ------------------------------------------------------------------

def encode_signing_key(signing_key: ed25519.Ed25519PrivateKey, tls_public_key: PublicKey) -> bytes:
    proof = signing_key.sign(SIGNING_KEY_PURPOSE + spki(tls_public_key))
    inner = b"\x04\x20" + raw_ed25519(signing_key.public_key()) + b"\x04\x40" + proof
    return b"\x30" + bytes([len(inner)]) + inner


def decode_signing_key(value: bytes, tls_public_key: PublicKey) -> bytes:
    """The raw Ed25519 key of the extension, after checking its proof; InvalidInput otherwise."""
    if len(value) != 102 or value[:4] != b"\x30\x64\x04\x20" or value[36:38] != b"\x04\x40":
        raise errors.InvalidInput("csr_pem", "the signing-key extension is malformed")
    raw, proof = value[4:36], value[38:]
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(raw).verify(proof, SIGNING_KEY_PURPOSE + spki(tls_public_key))
    except (InvalidSignature, ValueError):
        raise errors.InvalidInput("csr_pem", "the signing-key proof does not verify") from None
    return raw


def build_csr(tls_key: PrivateKey, signing_key: ed25519.Ed25519PrivateKey | None = None) -> bytes:
    """A node's CSR (PEM); the CA ignores its subject and sets its own."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
    if signing_key is not None:
        value = encode_signing_key(signing_key, tls_key.public_key())
        builder = builder.add_extension(x509.UnrecognizedExtension(SIGNING_KEY_OID, value), critical=False)
    algorithm = None if isinstance(tls_key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(tls_key, algorithm).public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class CsrFacts:
    public_key: PublicKey
    signing_key: bytes  # raw Ed25519
    extension: bytes | None  # the checked signing-key extension, copied into the certificate


def parse_csr(csr_pem: bytes) -> CsrFacts:
    """Check a node's CSR: a valid self-signature over a P-256 or Ed25519 key, and an Ed25519
    signing key (the extension, or the CSR's own key when that is Ed25519)."""
    if not csr_pem or len(csr_pem) > MAX_CSR_BYTES:
        raise errors.InvalidInput("csr_pem", "must be a PEM CSR of at most 16 KiB")
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
        valid = csr.is_signature_valid
        public_key = csr.public_key()
    except ValueError:
        raise errors.InvalidInput("csr_pem", "is not a PEM PKCS#10 CSR") from None
    if not valid:
        raise errors.InvalidInput("csr_pem", "the CSR's signature does not verify")
    if isinstance(public_key, ec.EllipticCurvePublicKey) and isinstance(public_key.curve, ec.SECP256R1):
        own = None
    elif isinstance(public_key, ed25519.Ed25519PublicKey):
        own = raw_ed25519(public_key)
    else:
        raise errors.InvalidInput("csr_pem", "the key must be ECDSA P-256 or Ed25519")
    try:
        ext = csr.extensions.get_extension_for_oid(SIGNING_KEY_OID).value
    except x509.ExtensionNotFound:
        if own is None:
            raise errors.InvalidInput("csr_pem", "an ECDSA CSR must carry the Ed25519 signing-key extension") from None
        return CsrFacts(public_key, own, None)
    return CsrFacts(public_key, decode_signing_key(ext.value, public_key), ext.value)


# Issuing ------------------------------------------------------------------------------------

def _name(role: str, common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _sign(builder: x509.CertificateBuilder, key: PrivateKey) -> x509.Certificate:
    return builder.sign(key, None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256())


def new_ca(now: dt.datetime, years: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                      x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    builder = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + dt.timedelta(days=365 * years))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return key, _sign(builder, key)


def issue(
    ca_key: PrivateKey, ca_cert: x509.Certificate, *, public_key: PublicKey, role: str, common_name: str,
    not_before: dt.datetime, not_after: dt.datetime, signing_extension: bytes | None = None,
    hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    """A leaf: a node's client certificate, or with role `gateway` a server certificate for `hosts`."""
    server = role == GATEWAY
    builder = (
        x509.CertificateBuilder().subject_name(_name(role, common_name)).issuer_name(ca_cert.subject)
        .public_key(public_key).serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                              else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False)
    if signing_extension is not None:
        builder = builder.add_extension(x509.UnrecognizedExtension(SIGNING_KEY_OID, signing_extension), critical=False)
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
    role: str
    common_name: str  # the node id (or "gateway")
    not_before: dt.datetime
    not_after: dt.datetime
    public_key: bytes  # SubjectPublicKeyInfo DER
    signing_key: bytes | None  # raw Ed25519


def _attribute(name: x509.Name, oid: x509.ObjectIdentifier) -> str:
    values = name.get_attributes_for_oid(oid)
    return str(values[0].value) if len(values) == 1 else ""


def signing_key_of(cert: x509.Certificate) -> bytes | None:
    """The certificate's Ed25519 report-signing key: the extension's, or its own Ed25519 key."""
    public_key = cert.public_key()
    try:
        value = cert.extensions.get_extension_for_oid(SIGNING_KEY_OID).value.value
    except x509.ExtensionNotFound:
        return raw_ed25519(public_key) if isinstance(public_key, ed25519.Ed25519PublicKey) else None
    return decode_signing_key(value, public_key)


def facts(cert: x509.Certificate) -> CertFacts:
    return CertFacts(
        serial=serial_hex(cert), key_id=key_id(cert),
        role=_attribute(cert.subject, NameOID.ORGANIZATIONAL_UNIT_NAME),
        common_name=_attribute(cert.subject, NameOID.COMMON_NAME),
        not_before=cert.not_valid_before_utc, not_after=cert.not_valid_after_utc,
        public_key=spki(cert.public_key()), signing_key=signing_key_of(cert),
    )
