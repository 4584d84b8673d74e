"""Secrets where operators and other tenants read: the real process's JSON log, its metrics, the
error details and the webhooks read back. Each secret is a distinctive string; none may appear."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2, node_pb2_grpc
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.api.interceptor import REQUEST_ID
from controlplane.common.status import error_info
from tests.support import PERMISSIVE, Client, rpc_error
from tests.test_gateway import GatewayThread, Node, eventually, gateway, pool_id  # noqa: F401 (fixtures)

REPO = pathlib.Path(__file__).resolve().parent.parent
HOOK = "https://93.184.216.34/hook"  # a public literal: no resolver asked
GIVEN = "whsec_" + "c2VjcmV0LXNpZ25pbmcta2V5LW9mLXRoZS10ZW5hbnQtYWJj"  # 36 bytes


class Served:
    """`controlplane.cli serve` as a real process, its JSON log in a file."""

    def __init__(self, database: str, log: pathlib.Path) -> None:
        self.log = log
        self.stderr = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen",
             "127.0.0.1:0"], cwd=REPO, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env={**os.environ, "DATABASE_URL": database, "BC_LOG_FORMAT": "json"})
        lines = [self.proc.stdout.readline() for _ in range(2)]
        listening = next(line for line in lines if "listening on" in line)
        self.endpoint = "127.0.0.1:" + listening.split(" (")[0].rsplit(":", 1)[1].strip()
        self.metrics_port = int(next(line for line in lines if line.startswith("metrics on")).rsplit(":", 1)[1])

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def text(self) -> str:
        return self.log.read_text()

    def metrics(self) -> str:
        with socket.create_connection(("127.0.0.1", self.metrics_port), timeout=10) as conn:
            conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def logged(self, request_id: str) -> dict[str, Any]:
        """The canonical line of the RPC with this request id (waits for it: the log is async)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = [e for e in self.lines() if e.get("event") == "rpc" and e.get("request_id") == request_id]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no rpc line for {request_id}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.stderr.close()


@pytest.fixture
def served(database: str, tmp_path: pathlib.Path) -> Iterator[Served]:
    server = Served(database, tmp_path / "cp.log")
    try:
        yield server
    finally:
        server.stop()


def call(client: Client, stub: Any, method: str, request: Any, request_id: str) -> Any:
    return getattr(stub, method)(request, metadata=(*client.metadata, ("x-request-id", request_id)), timeout=60)


def test_bad_expired_and_revoked_tokens_never_reach_the_log_or_the_error(served: Served, database: str) -> None:
    root = Client(served.endpoint, bootstrap.ensure_root(database))
    root.admin("CreateTenant", apb.CreateTenantRequest(id="sec-a", name="a"))
    root.admin("CreateIdentity", apb.CreateIdentityRequest(id="sec-u", kind="user", name="u", tenant_ids=["sec-a"]))
    revoked = root.admin("CreateToken", apb.CreateTokenRequest(identity_id="sec-u"))
    root.admin("RevokeTokens", apb.RevokeTokensRequest(token_id=revoked.id))
    expiring = root.admin("CreateToken", apb.CreateTokenRequest(identity_id="sec-u", ttl="1s"))
    bogus = "bc_" + "Q" * 20 + "bogus-secret-never-logged"
    secrets = [bogus, revoked.secret, expiring.secret, root.metadata[0][1].split()[1]]
    for n, secret in enumerate(secrets[:3]):
        client = Client(served.endpoint, secret)
        deadline, attempt = time.monotonic() + 30, 0
        while True:  # the expiring one: until it has expired
            request_id = f"sec-tok-{n}-{attempt}"
            try:
                call(client, client._r, "List", pb.ListReservationsRequest(tenant_id="sec-a"), request_id)
            except grpc.RpcError as exc:  # the live one is denied (no policy) until it expires
                err = exc
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    break
            assert secret == expiring.secret and time.monotonic() < deadline
            attempt += 1
            time.sleep(0.1)
        info = error_info(err)
        assert (err.code(), info.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        details = dict(info.metadata)
        assert not any(s in str(err) or s in json.dumps(details) for s in secrets)
        assert served.logged(request_id)["code"] == "UNAUTHENTICATED"
        client.close()
    assert "tokenId" in details  # the expired one is named by its id, never its secret
    # A secret sent as the tenant id (a pasted token) is not shown whole either.
    client = Client(served.endpoint, bogus)
    with pytest.raises(grpc.RpcError):
        call(client, client._r, "List", pb.ListReservationsRequest(tenant_id=root.metadata[0][1].split()[1]), "sec-tid")
    served.logged("sec-tid")
    client.close()
    text = served.text()
    leaked = [s for s in secrets if s in text]
    root.close()
    assert not leaked, [line for line in text.splitlines() if any(s in line for s in leaked)]


def test_a_webhook_secret_is_never_read_back_nor_logged(served: Served, database: str) -> None:
    root = Client(served.endpoint, bootstrap.ensure_root(database))
    root.admin("CreateTenant", apb.CreateTenantRequest(id="sec-h", name="h"))
    root.admin("PutPolicy", apb.PutPolicyRequest(tenant_id="sec-h", cedar=PERMISSIVE))
    root.admin("CreateIdentity", apb.CreateIdentityRequest(id="sec-hu", kind="user", name="u", tenant_ids=["sec-h"]))
    user = Client(served.endpoint, root.admin("CreateToken", apb.CreateTokenRequest(identity_id="sec-hu")).secret)
    root.close()
    root = user
    stub = events_pb2_grpc.WebhooksStub(root.channel)
    given = call(root, stub, "Create", epb.CreateWebhookRequest(tenant_id="sec-h", url=HOOK, secret=GIVEN), "sec-h1")
    generated = call(root, stub, "Create", epb.CreateWebhookRequest(tenant_id="sec-h", url=HOOK), "sec-h2")
    assert given.secret == "" and generated.secret.startswith("whsec_")
    read = [call(root, stub, "Get", epb.GetWebhookRequest(tenant_id="sec-h", webhook_id=w.id), f"sec-g{n}")
            for n, w in enumerate((given, generated))]
    listed = call(root, stub, "List", epb.ListWebhooksRequest(tenant_id="sec-h"), "sec-l").items
    assert all(w.secret == "" for w in (*read, *listed))
    # A wrong secret's error does not echo it.
    wrong = GIVEN[:-4] + "!!!!"
    with pytest.raises(grpc.RpcError) as err:
        call(root, stub, "Create", epb.CreateWebhookRequest(tenant_id="sec-h", url=HOOK, secret=wrong), "sec-h3")
    assert rpc_error(err)[2].get("field") == "secret" and wrong not in str(err.value)
    served.logged("sec-h3")
    text = served.text()
    root.close()
    assert GIVEN not in text and generated.secret not in text and wrong not in text


def test_metrics_labels_are_not_tenant_strings(served: Served, database: str) -> None:
    root = Client(served.endpoint, bootstrap.ensure_root(database))
    marker = "sec-metric-label-marker"
    # Unknown methods, odd request ids and tenant ids: none becomes a label value.
    channel = grpc.insecure_channel(served.endpoint)
    for n in range(3):
        unknown = channel.unary_unary(f"/bettercompute.v1.Reservations/{marker}{n}")
        with pytest.raises(grpc.RpcError):
            unknown(b"", metadata=root.metadata, timeout=30)
    channel.close()
    with pytest.raises(grpc.RpcError):
        call(root, root._r, "List", pb.ListReservationsRequest(tenant_id=marker), marker)
    served.logged(marker)
    text = served.metrics()
    root.close()
    assert "bc_rpcs_total" in text and marker not in text


# The gateway's enrolment: unauthenticated callers ------------------------------------------

def test_a_wrong_join_token_and_a_hostile_request_id_stay_out_of_the_gateway_log(gateway: GatewayThread,
                                                                                   pool_id: str) -> None:
    wrong = "jt-wrong-" + "Z" * 30
    forged = "x" * 2000 + ' {"event": "forged"}'
    node = Node(gateway)
    with capture_logs() as logs:
        with grpc.secure_channel(gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
            with pytest.raises(grpc.RpcError) as err:
                node_pb2_grpc.NodeGatewayStub(ch).Enrol(node_pb2.EnrolRequest(join_token=wrong, csr_pem=node.keys.csr()),
                                                        metadata=(("x-request-id", forged),), timeout=10)
        eventually(lambda: any(e["event"] == "rpc" for e in logs), what="the rpc line")
    assert rpc_error(err)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert wrong not in str(err.value) and wrong not in repr(logs)
    line = next(e for e in logs if e["event"] == "rpc")
    assert REQUEST_ID.fullmatch(line["request_id"]) and "forged" not in repr(logs), line["request_id"][-40:]
    # A request id the API would accept is kept, so an operator can follow a call.
    with capture_logs() as logs:
        with grpc.secure_channel(gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
            with pytest.raises(grpc.RpcError):
                node_pb2_grpc.NodeGatewayStub(ch).Enrol(node_pb2.EnrolRequest(join_token=wrong, csr_pem=node.keys.csr()),
                                                        metadata=(("x-request-id", "req-42"),), timeout=10)
        eventually(lambda: any(e["event"] == "rpc" for e in logs), what="the rpc line")
    assert next(e for e in logs if e["event"] == "rpc")["request_id"] == "req-42"


def test_printed_settings_carry_neither_the_database_password_nor_the_ca_passphrase() -> None:
    """A Settings or PkiSettings printed (a debug line, a traceback's locals) shows neither secret."""
    from controlplane.config import Settings
    from controlplane.pki.config import PkiSettings
    from gateway.config import GatewaySettings

    settings = Settings(database_url="postgresql://bc:s3cret-db-pass@db.internal/bc")
    pki = PkiSettings(ca_passphrase="s3cret-ca-pass")
    assert "s3cret-db-pass" not in repr(settings) and "s3cret-db-pass" not in str(settings)
    assert "s3cret-ca-pass" not in repr(pki) and "s3cret-ca-pass" not in repr(GatewaySettings(pki=pki))
    assert settings.database_url.endswith("@db.internal/bc")  # still there to use
