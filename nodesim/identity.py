"""The node's keys and certificates, kept under `var/lib/bcd/` of its root.

A node holds two key pairs, each with a certificate from the gateway's CA naming the node:
- the attestation key (Ed25519): signs reports; `key_id` is the SHA-256 of its certificate's DER;
- the TLS key (ECDSA P-256): the client certificate of the mutual-TLS session.

Two, because gRPC's TLS stack (BoringSSL with gRPC's fixed signature-algorithm list) cannot
handshake with an Ed25519 certificate (grpc/grpc#24252; checked here with grpcio 1.85: the handshake
fails with NO_COMMON_SIGNATURE_ALGORITHMS), while the spec signs reports with Ed25519.

On the wire (node.proto has one CSR field): `csr_pem` carries both PEM CSRs, the Ed25519 one first,
and `certificate_pem` both certificates; each certificate is matched to its key by public key.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from nodesim.files import write_atomic

REPORT_PURPOSE = b"attested-report\x00"

_SIGN_KEY = "node.key"
_SIGN_CERT = "node.crt"
_TLS_KEY = "tls.key"
_TLS_CERT = "tls.crt"
_CA = "ca.crt"
_NODE_ID = "node-id"
_SEQUENCE = "report-sequence"
# Sequence numbers are reserved on disk in blocks, so a restart never reuses one.
_SEQUENCE_BLOCK = 1024


class IdentityError(Exception):
    """The gateway's answer does not give this node a usable identity."""


def _pem_key(key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _public_raw(key: object) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class KeyPair:
    """Fresh keys waiting for certificates (enrolment or renewal)."""

    sign_key: ed25519.Ed25519PrivateKey
    tls_key: ec.EllipticCurvePrivateKey

    @classmethod
    def generate(cls) -> KeyPair:
        return cls(ed25519.Ed25519PrivateKey.generate(), ec.generate_private_key(ec.SECP256R1()))

    def csr_bundle(self, common_name: str) -> bytes:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        sign_csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(self.sign_key, None)
        tls_csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(self.tls_key, hashes.SHA256())
        return sign_csr.public_bytes(serialization.Encoding.PEM) + tls_csr.public_bytes(serialization.Encoding.PEM)

    def certify(self, node_id: str, certificate_pem: bytes, ca_pem: bytes) -> Identity:
        """Match the gateway's certificates to these keys."""
        try:
            certs = x509.load_pem_x509_certificates(certificate_pem)
        except ValueError as exc:
            raise IdentityError(f"certificate_pem is not PEM certificates: {exc}") from exc
        by_key = {_public_raw(c.public_key()): c for c in certs}
        sign_cert = by_key.get(_public_raw(self.sign_key.public_key()))
        tls_cert = by_key.get(_public_raw(self.tls_key.public_key()))
        if sign_cert is None:
            raise IdentityError("no certificate for the node's Ed25519 attestation key")
        if tls_cert is None:
            raise IdentityError("no certificate for the node's TLS key (the session needs a non-Ed25519 one)")
        if not ca_pem:
            raise IdentityError("no CA certificate")
        return Identity(
            node_id=node_id or _common_name(sign_cert),
            sign_key=self.sign_key,
            sign_cert_der=sign_cert.public_bytes(serialization.Encoding.DER),
            tls_key_pem=_pem_key(self.tls_key),
            tls_cert_pem=tls_cert.public_bytes(serialization.Encoding.PEM),
            ca_pem=ca_pem,
            not_before=max(sign_cert.not_valid_before_utc, tls_cert.not_valid_before_utc).timestamp(),
            not_after=min(sign_cert.not_valid_after_utc, tls_cert.not_valid_after_utc).timestamp(),
        )


def _common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


@dataclass(frozen=True)
class Identity:
    node_id: str
    sign_key: ed25519.Ed25519PrivateKey
    sign_cert_der: bytes
    tls_key_pem: bytes
    tls_cert_pem: bytes
    ca_pem: bytes
    # Epoch seconds: the later start and the earlier end of the two certificates.
    not_before: float
    not_after: float

    @functools.cached_property
    def key_id(self) -> str:
        return hashlib.sha256(self.sign_cert_der).hexdigest()

    def renew_at(self, jitter: float = 0.0) -> float:
        """Past half the validity (plus up to `jitter` of it, so a fleet does not renew at once)."""
        return self.not_before + (self.not_after - self.not_before) * (0.5 + jitter)

    def sign(self, body: bytes) -> bytes:
        return self.sign_key.sign(REPORT_PURPOSE + body)


class IdentityStore:
    """`<root>/var/lib/bcd/`: keys (mode 0600), certificates, the node id, the report sequence."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "var" / "lib" / "bcd"

    def load(self) -> Identity | None:
        try:
            sign_key = serialization.load_pem_private_key((self.dir / _SIGN_KEY).read_bytes(), None)
            sign_cert = x509.load_pem_x509_certificate((self.dir / _SIGN_CERT).read_bytes())
            tls_key_pem = (self.dir / _TLS_KEY).read_bytes()
            tls_key = serialization.load_pem_private_key(tls_key_pem, None)
            tls_cert_pem = (self.dir / _TLS_CERT).read_bytes()
            ca_pem = (self.dir / _CA).read_bytes()
        except FileNotFoundError:
            return None
        if not isinstance(sign_key, ed25519.Ed25519PrivateKey) or not isinstance(tls_key, ec.EllipticCurvePrivateKey):
            raise IdentityError(f"{self.dir}: unexpected key types")
        try:
            node_id = (self.dir / _NODE_ID).read_text().strip()
        except FileNotFoundError:
            node_id = ""
        keys = KeyPair(sign_key, tls_key)
        return keys.certify(node_id, sign_cert.public_bytes(serialization.Encoding.PEM) + tls_cert_pem, ca_pem)

    def save(self, identity: Identity) -> None:
        sign_cert = x509.load_der_x509_certificate(identity.sign_cert_der)
        write_atomic(self.dir / _SIGN_KEY, _pem_key(identity.sign_key), mode=0o600)
        write_atomic(self.dir / _TLS_KEY, identity.tls_key_pem, mode=0o600)
        write_atomic(self.dir / _SIGN_CERT, sign_cert.public_bytes(serialization.Encoding.PEM))
        write_atomic(self.dir / _TLS_CERT, identity.tls_cert_pem)
        write_atomic(self.dir / _CA, identity.ca_pem)
        write_atomic(self.dir / _NODE_ID, identity.node_id + "\n")


class Sequence:
    """Report sequence numbers, increasing across restarts: blocks are reserved on disk ahead of use."""

    def __init__(self, store: IdentityStore) -> None:
        self._path = store.dir / _SEQUENCE
        try:
            self._next = int(self._path.read_text().strip() or 0)
        except FileNotFoundError:
            self._next = 1
        self._reserved = self._next

    def take(self) -> int:
        if self._next >= self._reserved:
            self._reserved = self._next + _SEQUENCE_BLOCK
            write_atomic(self._path, f"{self._reserved}\n")
        value = self._next
        self._next += 1
        return value
