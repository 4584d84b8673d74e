"""A small NodeGateway peer for testing nodesim: a real grpc.aio server on loopback with real TLS.

- a test CA (Ed25519) and a server certificate (ECDSA P-256) for 127.0.0.1 and localhost;
- two ports, since gRPC Python's server credentials either require a client certificate or never
  ask for one: the enrolment port (server-auth TLS) and the session port (mutual TLS);
- Enrol issues real certificates from the CSR bundle (one-time join tokens), Renew re-issues them
  for the node named by the client certificate, Session reads the node id from the client
  certificate, keeps the newest session, pushes desired state and records what the node sends,
  checking each report's signature against the certificates it issued to that node, and
  acknowledges each report.

`python -m tests.nodesim_peer --dir D --nodes N` serves it standalone (for `nodesim --sim N`).

It is a stand-in, not the gateway (its CA is Ed25519, the real one P-256; its report check is its
own): tests use it only for what the real gateway cannot be made to do (tests/test_nodesim.py
says which); everything else runs against gateway/ and the control plane.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import ipaddress
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc

PURPOSE = b"attested-report\x00"
_CSR_END = b"-----END CERTIFICATE REQUEST-----"


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def split_csrs(bundle: bytes) -> list[x509.CertificateSigningRequest]:
    parts = [p.strip() + b"\n" + _CSR_END + b"\n" for p in bundle.split(_CSR_END) if p.strip()]
    return [x509.load_pem_x509_csr(p) for p in parts]


class TestCA:
    def __init__(self) -> None:
        self.key = ed25519.Ed25519PrivateKey.generate()
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nodesim test CA")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self.key, None)
        )
        self.pem = _pem(self.cert)
        self.server_key = ec.generate_private_key(ec.SECP256R1())
        self.server_cert = self.issue(
            self.server_key.public_key(),
            "gateway",
            lifetime=2 * 86400,
            extra=[
                (
                    x509.SubjectAlternativeName(
                        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                    ),
                    False,
                ),
                (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
            ],
        )

    def issue(
        self, public_key: object, cn: str, lifetime: float, extra: list | None = None, aged: float = 0.0
    ) -> x509.Certificate:
        """A certificate of `lifetime` seconds, `aged` seconds of which are already over."""
        now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=aged)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.name)
            .public_key(public_key)  # type: ignore[arg-type]
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(seconds=1))
            .not_valid_after(now + datetime.timedelta(seconds=lifetime))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        for ext, critical in extra or []:
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(self.key, None)


@dataclass
class Received:
    attested: pb.AttestedReport
    report: pb.Report | None
    # "ok", or why the peer would not accept the report as the node's own.
    verdict: str
    at: float = field(default_factory=time.monotonic)


@dataclass
class PeerNode:
    node_id: str
    name: str
    # key id -> Ed25519 attestation certificate issued to the node (all of them, renewals too).
    signing_certs: dict[str, x509.Certificate] = field(default_factory=dict)
    tls_certs: list[x509.Certificate] = field(default_factory=list)
    hellos: list[pb.Hello] = field(default_factory=list)
    heartbeats: list[pb.Heartbeat] = field(default_factory=list)
    reports: list[Received] = field(default_factory=list)
    renewals: int = 0
    sessions: int = 0
    session_ends: int = 0
    active: asyncio.Queue | None = None
    desired: pb.DesiredState = field(default_factory=pb.DesiredState)

    def events(self, kind: str, verdict: str | None = "ok") -> list[pb.Report]:
        """Reports of one event kind ("bound", "failed", "released"), by default only verified ones."""
        return [
            r.report
            for r in self.reports
            if r.report is not None
            and r.report.WhichOneof("event") == kind
            and (verdict is None or r.verdict == verdict)
        ]


class Peer(node_pb2_grpc.NodeGatewayServicer):
    def __init__(self, cert_lifetime: float = 3600.0, enrol_aged: float = 0.0) -> None:
        """`enrol_aged`: the share of its life an enrolment's certificate has already used up
        (past 0.6, the node renews at once); renewals issue fresh ones."""
        self.ca = TestCA()
        self.cert_lifetime = cert_lifetime
        self.enrol_aged = enrol_aged
        self.tokens: dict[str, str] = {}  # token -> node name
        self.nodes: dict[str, PeerNode] = {}  # node id -> node
        self.server: grpc.aio.Server | None = None
        self.enrol_port = 0
        self.session_port = 0
        self._serial = 0

    # -- setup -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100_000)])
        node_pb2_grpc.add_NodeGatewayServicer_to_server(self, self.server)
        pair = [(_key_pem(self.ca.server_key), _pem(self.ca.server_cert))]
        self.enrol_port = self.server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(pair))
        mtls = grpc.ssl_server_credentials(pair, root_certificates=self.ca.pem, require_client_auth=True)
        self.session_port = self.server.add_secure_port("127.0.0.1:0", mtls)
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    @property
    def session_endpoint(self) -> str:
        return f"127.0.0.1:{self.session_port}"

    @property
    def enrol_endpoint(self) -> str:
        return f"127.0.0.1:{self.enrol_port}"

    def issue_tokens(self, names: list[str]) -> list[dict[str, str]]:
        out = []
        for name in names:
            token = secrets.token_urlsafe(24)
            self.tokens[token] = name
            out.append({"name": name, "joinToken": token})
        return out

    def write_files(self, directory: Path, names: list[str]) -> tuple[Path, Path]:
        """Tokens file and CA file for `nodesim --tokens ... --ca ...`."""
        directory.mkdir(parents=True, exist_ok=True)
        tokens = directory / "tokens.json"
        tokens.write_text(json.dumps(self.issue_tokens(names)))
        ca = directory / "ca.pem"
        ca.write_bytes(self.ca.pem)
        return tokens, ca

    def args(self, directory: Path, names: list[str], sandbox: Path) -> list[str]:
        tokens, ca = self.write_files(directory, names)
        return [
            "--sim", str(len(names)),
            "--gateway", self.session_endpoint,
            "--enrol-gateway", self.enrol_endpoint,
            "--sandbox", str(sandbox),
            "--tokens", str(tokens),
            "--ca", str(ca),
        ]  # fmt: skip

    # -- driving nodes -----------------------------------------------------------------------

    def by_name(self, name: str) -> PeerNode:
        return next(n for n in self.nodes.values() if n.name == name)

    def set_desired(self, node_id: str, assignments: list[pb.DeviceAssignment]) -> int:
        node = self.nodes[node_id]
        node.desired = pb.DesiredState(generation=node.desired.generation + 1, assignments=assignments)
        if node.active is not None:
            node.active.put_nowait(pb.GatewayMessage(desired_state=node.desired))
        return node.desired.generation

    def renew_hint(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if node.active is not None:
            node.active.put_nowait(pb.GatewayMessage(renew_hint=pb.RenewHint(not_after=0)))

    def connected(self) -> int:
        return sum(1 for n in self.nodes.values() if n.active is not None)

    # -- the service -------------------------------------------------------------------------

    def _certify(self, node: PeerNode, csr_pem: bytes, aged: float = 0.0) -> tuple[bytes, int]:
        csrs = split_csrs(csr_pem)
        out = b""
        not_after = 0
        for csr in csrs:
            if not csr.is_signature_valid:
                raise ValueError("CSR signature invalid")
            cert = self.ca.issue(csr.public_key(), node.node_id, self.cert_lifetime, aged=aged)
            if isinstance(csr.public_key(), ed25519.Ed25519PublicKey):
                kid = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
                node.signing_certs[kid] = cert
            else:
                node.tls_certs.append(cert)
            out += _pem(cert)
            not_after = int(cert.not_valid_after_utc.timestamp() * 1000)
        return out, not_after

    async def Enrol(self, request: pb.EnrolRequest, context: grpc.aio.ServicerContext) -> pb.EnrolResponse:
        name = self.tokens.pop(request.join_token, None)
        if name is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown or used join token")
        csrs = split_csrs(request.csr_pem)
        cns = {c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value for c in csrs}
        if cns != {name} or len(csrs) != 2:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"want two CSRs for {name}, got {cns}")
        self._serial += 1
        node = PeerNode(node_id=f"node_{self._serial:026d}", name=name)
        self.nodes[node.node_id] = node
        cert_pem, not_after = self._certify(node, request.csr_pem, aged=self.enrol_aged * self.cert_lifetime)
        return pb.EnrolResponse(
            node_id=node.node_id, certificate_pem=cert_pem, ca_certificate_pem=self.ca.pem, not_after=not_after
        )

    def _peer_node(self, context: grpc.aio.ServicerContext) -> PeerNode | None:
        cn = context.auth_context().get("x509_common_name")
        return self.nodes.get(cn[0].decode()) if cn else None

    async def Renew(self, request: pb.RenewRequest, context: grpc.aio.ServicerContext) -> pb.RenewResponse:
        node = self._peer_node(context)
        if node is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no node certificate")
        node.renewals += 1
        cert_pem, not_after = self._certify(node, request.csr_pem)
        return pb.RenewResponse(certificate_pem=cert_pem, not_after=not_after)

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        node = self._peer_node(context)
        if node is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no node certificate")
        if node.active is not None:
            node.active.put_nowait(None)  # the newest session wins
        queue: asyncio.Queue = asyncio.Queue()
        node.active = queue
        node.sessions += 1
        queue.put_nowait(pb.GatewayMessage(desired_state=node.desired))

        async def read() -> None:
            try:
                async for message in request_iterator:
                    self._receive(node, message)
                    if message.WhichOneof("msg") == "report":  # every report is acknowledged
                        queue.put_nowait(pb.GatewayMessage(report_ack=self._ack(node.reports[-1])))
            finally:
                queue.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                await context.write(item)
        finally:
            reader.cancel()
            if node.active is queue:
                node.active = None
            node.session_ends += 1

    def _receive(self, node: PeerNode, message: pb.NodeMessage) -> None:
        kind = message.WhichOneof("msg")
        if kind == "hello":
            node.hellos.append(message.hello)
        elif kind == "heartbeat":
            node.heartbeats.append(message.heartbeat)
        elif kind == "report":
            node.reports.append(self._judge(node, message.report))

    @staticmethod
    def _ack(received: Received) -> pb.ReportAck:
        sequence = received.report.sequence if received.report is not None else 0
        return pb.ReportAck(sequence=sequence, key_id=received.attested.key_id, outcome=pb.REPORT_STORED)

    def _judge(self, node: PeerNode, attested: pb.AttestedReport) -> Received:
        try:
            report = pb.Report.FromString(attested.body)
        except Exception:  # noqa: BLE001 - a garbled body is a verdict, not an error
            return Received(attested, None, "unparseable body")
        if not attested.signature:
            return Received(attested, report, "unsigned")
        cert = node.signing_certs.get(attested.key_id)
        if cert is None:
            return Received(attested, report, "unknown key id")
        try:
            cert.public_key().verify(attested.signature, PURPOSE + attested.body)  # type: ignore[union-attr]
        except InvalidSignature:
            return Received(attested, report, "bad signature")
        if report.node_id != node.node_id:
            return Received(attested, report, "names another node")
        return Received(attested, report, "ok")


def assignment(
    allocation_id: str,
    devices: list[str],
    until_ms: int | None = None,
    device_class: str = "gpu",
    binding: int = pb.BINDING_HOLD,
    limits: pb.Limits | None = None,
) -> pb.DeviceAssignment:
    until = until_ms if until_ms is not None else int(time.time() * 1000) + 3_600_000
    a = pb.DeviceAssignment(
        allocation_id=allocation_id, device_ids=devices, until=until, binding=binding, device_class=device_class
    )
    if limits is not None:
        a.limits.CopyFrom(limits)
    return a


async def eventually(predicate: Callable[[], object], timeout: float = 30.0, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout}s: {predicate}")
        await asyncio.sleep(every)


async def _serve(directory: Path, nodes: int, prefix: str) -> None:
    peer = Peer()
    await peer.start()
    names = [f"{prefix}-{i:03d}" for i in range(nodes)]
    tokens, ca = peer.write_files(directory, names)
    print(
        json.dumps(
            {"session": peer.session_endpoint, "enrol": peer.enrol_endpoint, "tokens": str(tokens), "ca": str(ca)}
        ),
        flush=True,
    )
    start = time.monotonic()
    last_beats = 0
    try:
        while True:
            await asyncio.sleep(5)
            beats = sum(len(n.heartbeats) for n in peer.nodes.values())
            print(
                json.dumps(
                    {
                        "t": round(time.monotonic() - start, 1),
                        "enrolled": len(peer.nodes),
                        "connected": peer.connected(),
                        "heartbeats_per_s": round((beats - last_beats) / 5, 1),
                    }
                ),
                flush=True,
            )
            last_beats = beats
    finally:
        await peer.stop()


def main() -> None:
    p = argparse.ArgumentParser(description="serve the nodesim test peer")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--prefix", default="sim")
    a = p.parse_args()
    asyncio.run(_serve(a.dir, a.nodes, a.prefix))


if __name__ == "__main__":
    main()
