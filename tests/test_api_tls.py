"""The API listener over TLS: a certificate and key generated here, real TLS handshakes on loopback."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import pathlib
from collections.abc import Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import admin_pb2_grpc
from controlplane import bootstrap
from controlplane.client import main as client_cli
from controlplane.app import start_app
from controlplane.config import Settings
from tests.conftest import clone_database
from tests.support import ServerThread


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_server_cert(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate) -> tuple[bytes, bytes]:
    """A key and certificate for 127.0.0.1 and localhost, signed by the CA (PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name("bc-api")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def tls(pg_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, str, bytes]]:
    ca_key, ca = make_ca("bc-test-ca")
    key_pem, cert_pem = make_server_cert(ca_key, ca)
    files = tmp_path_factory.mktemp("tls")
    (files / "api.key").write_bytes(key_pem)
    (files / "api.crt").write_bytes(cert_pem)
    conninfo = clone_database(pg_uri)
    server = ServerThread(conninfo, Settings(database_url=conninfo, tls_cert=str(files / "api.crt"),
                                             tls_key=str(files / "api.key")))
    try:
        yield server, bootstrap.ensure_root(conninfo), ca.public_bytes(serialization.Encoding.PEM)
    finally:
        server.stop()


def _get_clock(channel: grpc.Channel, token: str) -> apb.Clock:
    return admin_pb2_grpc.AdminStub(channel).GetClock(
        apb.GetClockRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=10)


def test_the_api_serves_tls_with_the_configured_certificate(tls: tuple[ServerThread, str, bytes]) -> None:
    server, token, ca_pem = tls
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    with grpc.secure_channel(server.endpoint, credentials) as channel:
        assert _get_clock(channel, token).now > 0
    # Authentication still applies over TLS.
    with grpc.secure_channel(server.endpoint, credentials) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            _get_clock(channel, "bct_not-a-token")
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_and_untrusted_clients_cannot_talk_to_a_tls_listener(tls: tuple[ServerThread, str, bytes]) -> None:
    server, token, _ = tls
    with grpc.insecure_channel(server.endpoint) as channel:
        with pytest.raises(grpc.RpcError) as plaintext:
            _get_clock(channel, token)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    _, stranger = make_ca("another-ca")
    untrusted = grpc.ssl_channel_credentials(root_certificates=stranger.public_bytes(serialization.Encoding.PEM))
    with grpc.secure_channel(server.endpoint, untrusted) as channel:
        with pytest.raises(grpc.RpcError) as handshake:
            _get_clock(channel, token)
    assert handshake.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_half_configured_or_unreadable_tls_setting_refuses_to_start(database: str, tmp_path: pathlib.Path) -> None:
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    for cert, key in (("x.crt", ""), (str(tmp_path / "missing.crt"), str(tmp_path / "missing.key")),
                      (str(tmp_path / "garbage.pem"), str(tmp_path / "garbage.pem"))):
        settings = Settings(database_url=database, tls_cert=cert, tls_key=key)
        with pytest.raises(RuntimeError, match="cannot listen"):
            asyncio.run(start_app(settings, database, listen="127.0.0.1:0", workers=False))


def test_the_client_cli_dials_tls_with_ca(tls: tuple[ServerThread, str, bytes], tmp_path: pathlib.Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    server, token, ca_pem = tls
    (tmp_path / "ca.pem").write_bytes(ca_pem)
    args = ["--endpoint", server.endpoint, "--token", token, "--tenant", "root"]
    # The server answers (IAM: the root tenant has no policy), so the TLS handshake succeeded.
    assert client_cli.main([*args, "--ca", str(tmp_path / "ca.pem"), "list"]) == 1
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "ACCESS_DENIED"
    assert client_cli.main([*args, "list"]) == 1  # plaintext to a TLS listener
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "UNAVAILABLE"
