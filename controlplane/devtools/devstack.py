"""Running the system as real processes on loopback: control plane, gateway, nodesim.

Used by `make dev`, the end-to-end tests and the benchmarks, so every one of them starts the
processes the same way. Each process prints one readiness line naming its ports; a Process
waits for it, keeps the log in a file, and is stopped with SIGTERM (then SIGKILL) or killed -9.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from bettercompute.v1 import nodes_pb2, nodes_pb2_grpc

CONTROLPLANE_READY = re.compile(r"control plane listening on (\S+)")
GATEWAY_READY = re.compile(r"gateway listening on (\S+) .* enrol on (\S+) ")
PROVIDERSIM_READY = re.compile(r"providersim listening on (\S+)")


class Process:
    """A child process that announces readiness on stdout; its stderr goes to a log file."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], log_path: pathlib.Path,
                 ready: re.Pattern[str] | None = None, timeout: float = 60) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()/kill()
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, **env}, start_new_session=True)
        self.match: re.Match[str] | None = self._wait_ready(ready, timeout) if ready else None

    def _wait_ready(self, ready: re.Pattern[str], timeout: float) -> re.Match[str]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        waiting = select.poll()  # not select(): a process with 1,024 files open already is fine too
        waiting.register(self.proc.stdout, select.POLLIN)
        while time.monotonic() < deadline:
            if waiting.poll(500):
                line = self.proc.stdout.readline().decode(errors="replace")
                found = ready.search(line)
                if found:
                    return found
            if self.proc.poll() is not None:
                break
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{self.proc.args[:4]} did not become ready; log tail:\n{tail}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()

    def stop(self, timeout: float = 15) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def controlplane(conninfo: str, log_path: pathlib.Path, *, listen: str = "127.0.0.1:0",
                 env: dict[str, str] | None = None) -> tuple[Process, str]:
    proc = Process(_python("controlplane.cli", "serve", "--listen", listen),
                   env={"DATABASE_URL": conninfo, "BC_LOG_FORMAT": "json", **(env or {})},
                   log_path=log_path, ready=CONTROLPLANE_READY)
    assert proc.match is not None
    return proc, proc.match.group(1)


def gateway(conninfo: str, log_path: pathlib.Path, ca_path: pathlib.Path, *,
            listen: str = "127.0.0.1:0", enrol_listen: str = "127.0.0.1:0",
            env: dict[str, str] | None = None) -> tuple[Process, str, str]:
    """The gateway; returns (process, session endpoint, enrol endpoint) and writes its CA file."""
    proc = Process(_python("gateway", "--listen", listen, "--enrol-listen", enrol_listen, "--write-ca", str(ca_path)),
                   env={"DATABASE_URL": conninfo, "BC_LOG_FORMAT": "json", **(env or {})},
                   log_path=log_path, ready=GATEWAY_READY)
    assert proc.match is not None
    return proc, proc.match.group(1), proc.match.group(2)


def issue_join_tokens(endpoint: str, root_token: str, pool_id: str, names: Sequence[str],
                      tokens_path: pathlib.Path, *, role: str = "node", ttl_seconds: int = 3600,
                      enrolled: Collection[str] = ()) -> int:
    """One-time join tokens through NodeAdmin, written where nodesim reads them; the count issued.

    Every name is written, in order (a node's position in the file decides its place in the
    simulated fabric); names in `enrolled` hold a valid certificate and get no token ("")."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = nodes_pb2_grpc.NodeAdminStub(channel)
        metadata = (("authorization", f"Bearer {root_token}"),)
        tokens = [
            {"name": name, "joinToken": "" if name in enrolled else stub.CreateJoinToken(
                nodes_pb2.CreateJoinTokenRequest(pool_id=pool_id, node_name=name, role=role,
                                                 ttl_seconds=ttl_seconds),
                metadata=metadata, timeout=30).secret}
            for name in names
        ]
    write_private(tokens_path, json.dumps(tokens))
    return sum(1 for t in tokens if t["joinToken"])


def write_private(path: pathlib.Path, text: str) -> None:
    """Write atomically a file only its owner can read, created with mode 0600 (never wider,
    not even for a moment): it holds secrets."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover could have other permissions: O_EXCL makes a new one
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


# A certificate that ends within this is renewed through a new enrolment rather than reused.
CERTIFICATE_MARGIN_S = 600


def has_valid_certificate(node_root: pathlib.Path, ca_pem: bytes, *, margin_s: float = CERTIFICATE_MARGIN_S) -> bool:
    """Whether the node's stored certificates (nodesim's `var/lib/bcd/`) are issued by this CA
    and stay valid for `margin_s` more; such a node needs no join token to reconnect."""
    directory = node_root / "var" / "lib" / "bcd"
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        certs = [x509.load_pem_x509_certificate((directory / name).read_bytes()) for name in ("node.crt", "tls.crt")]
        if not (directory / "node-id").read_text().strip():
            return False
    except (OSError, ValueError):
        return False
    horizon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=margin_s)
    for cert in certs:
        if cert.not_valid_after_utc <= horizon:
            return False
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            return False
    return True


def revoked_nodes(endpoint: str, root_token: str, node_roots: dict[str, pathlib.Path]) -> set[str]:
    """The names among `node_roots` whose stored certificates the control plane has revoked (or
    does not know): a node revoked, then readmitted, or wiped after a lease, needs a join token
    re-provisioned to the machine however valid its files look (see `reprovision_join_tokens`)."""
    revoked: set[str] = set()
    with grpc.insecure_channel(endpoint) as channel:
        stub = nodes_pb2_grpc.NodeAdminStub(channel)
        metadata = (("authorization", f"Bearer {root_token}"),)
        for name, root in node_roots.items():
            directory = root / "var" / "lib" / "bcd"
            node_id = (directory / "node-id").read_text().strip()
            serials = {x509.load_pem_x509_certificate((directory / f).read_bytes()).serial_number
                       for f in ("node.crt", "tls.crt")}
            try:
                known = stub.ListNodeCertificates(nodes_pb2.ListNodeCertificatesRequest(node_id=node_id),
                                                  metadata=metadata, timeout=30).items
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                known = []
            good = {int(c.serial, 16) for c in known if not c.revoked}
            if not serials <= good:
                revoked.add(name)
    return revoked


def reprovision_join_tokens(endpoint: str, root_token: str, pool_id: str, node_roots: dict[str, pathlib.Path],
                            *, ttl_seconds: int = 3600) -> None:
    """A one-time join token for each node, written to `<node root>/join-token`: where nodesim
    reads the token an out-of-band re-provisioning gives a machine whose certificates were revoked."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = nodes_pb2_grpc.NodeAdminStub(channel)
        metadata = (("authorization", f"Bearer {root_token}"),)
        for name, root in node_roots.items():
            secret = stub.CreateJoinToken(nodes_pb2.CreateJoinTokenRequest(
                pool_id=pool_id, node_name=name, role="node", ttl_seconds=ttl_seconds),
                metadata=metadata, timeout=30).secret
            write_private(root / "join-token", secret)


def nodesim(count: int, session: str, enrol: str, sandbox: pathlib.Path, tokens_path: pathlib.Path,
            ca_path: pathlib.Path, log_path: pathlib.Path, *, extra: Sequence[str] = ()) -> Process:
    return Process(
        _python("nodesim", "--sim", str(count), "--gateway", session, "--enrol-gateway", enrol,
                "--sandbox", str(sandbox), "--tokens", str(tokens_path), "--ca", str(ca_path),
                "--log-format", "json", *extra),
        env={}, log_path=log_path)


def providersim(log_path: pathlib.Path, *, listen: str = "127.0.0.1:0",
                reservations: Sequence[str] = ()) -> tuple[Process, str]:
    """The simulated provider; `reservations` are ACCOUNT/NAME/FLAVOR/REGION/TOTAL. Returns the
    process and its endpoint."""
    extra = [arg for r in reservations for arg in ("--reservation", r)]
    proc = Process(_python("providersim", "--listen", listen, "--log-format", "json", *extra),
                   env={}, log_path=log_path, ready=PROVIDERSIM_READY)
    assert proc.match is not None
    return proc, proc.match.group(1)
