"""Where the client connects: the connection file `better-compute dev` writes, overridden by flags.

`open_channel` is the one place that makes the gRPC channel, so transport options (TLS) go there.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from google.protobuf.message import Message

from bettercompute.v1 import capacity_pb2_grpc, events_pb2_grpc, nodes_pb2_grpc, reservations_pb2_grpc, usage_pb2_grpc
from controlplane.client.errors import UsageError, require_utf8
from controlplane.config import data_dir_from_env, tcp_port

RPC_TIMEOUT_S = 30.0
TOKEN_ENV = "BC_TOKEN"
# gRPC refuses a metadata value longer than this (its hard limit): no bearer token is longer.
MAX_TOKEN_BYTES = 16384


@dataclass(frozen=True)
class Connection:
    endpoint: str
    token: str
    tenant_id: str
    pool_id: str
    ca: str = ""  # PEM file of the CA that signed the API's TLS certificate; empty: plaintext
    # The operator's token for `nodes` commands: --token when given, else the file's rootToken.
    root_token: str = ""

    @classmethod
    def resolve(
        cls,
        *,
        connection: str | None = None,
        endpoint: str | None = None,
        token: str | None = None,
        tenant: str | None = None,
        pool: str | None = None,
        ca: str | None = None,
        operator: bool = False,
        token_file: str | None = None,
    ) -> Connection:
        """The flags over `connection` (default `$BC_DATA_DIR/connection.json`, if it exists).
        `operator`: a `nodes` command, which needs root's token and no tenant."""
        token = chosen_token(token, token_file)
        path = pathlib.Path(connection or pathlib.Path(data_dir_from_env(), "connection.json"))
        saved: dict[str, Any] = {}
        if _exists(path, f"connection file {path}"):
            _require_trusted(path, found=not connection)
            saved = _read_saved(path)
        elif connection:
            raise UsageError(f"connection file {path} does not exist")
        conn = cls(
            endpoint=endpoint or saved.get("endpoint", ""),
            token=token or saved.get("token", ""),
            tenant_id=tenant or saved.get("tenantId", ""),
            pool_id=pool or saved.get("poolId", ""),
            ca=ca or saved.get("ca", ""),
            root_token=token or saved.get("rootToken", ""),
        )
        _require_port(conn.endpoint, "--endpoint" if endpoint else f"connection file {path}: endpoint")
        needed = ({"endpoint": conn.endpoint, "token": conn.root_token or conn.token} if operator  # no tenant
                  else {"endpoint": conn.endpoint, "token": conn.token, "tenant": conn.tenant_id})
        missing = [name for name, value in needed.items() if not value]
        if missing:
            raise UsageError(
                f"no {', '.join(missing)}: start `make dev` (it writes {path}), "
                f"or pass --connection, or --endpoint, --token-file (or ${TOKEN_ENV}) and --tenant"
            )
        return conn


def _require_port(endpoint: str, source: str) -> None:
    """A `host:port` whose port is a TCP port: gRPC reads 99999 modulo 65536 and would send the
    token to port 34463, whatever listens there."""
    port = tcp_port(endpoint)
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"{source} {endpoint!r}: the port must be 1 to 65535")


def chosen_token(token: str | None, token_file: str | None) -> str | None:
    """The bearer token: --token, else the content of --token-file, else $BC_TOKEN; None: the
    connection file's. The file and the variable keep the secret out of argv, which any local
    user reads (`ps`); --token stays for compatibility."""
    if token and token_file:
        raise UsageError("give one of --token and --token-file")
    if token_file:
        return _read_token_file(token_file)
    if token:
        return sendable_token(token, "--token")
    token = os.environ.get(TOKEN_ENV) or None
    require_utf8([token or ""], f"${TOKEN_ENV}")
    return sendable_token(token, f"${TOKEN_ENV}") if token else None


def sendable_token(token: str, source: str) -> str:
    """`token` if a request's metadata can carry it: printable ASCII (no space, no control or
    other character, which gRPC refuses as INTERNAL "Invalid metadata"), at most MAX_TOKEN_BYTES."""
    if len(token) > MAX_TOKEN_BYTES:
        raise UsageError(f"{source}: the token is longer than {MAX_TOKEN_BYTES} characters")
    if not all("!" <= c <= "~" for c in token):
        raise UsageError(f"{source}: a bearer token is printable ASCII without spaces")
    return token


def _read_token_file(name: str) -> str:
    """The token in file `name`, read once, without its trailing newline: one line of text."""
    path = pathlib.Path(name)
    _require_regular(path, f"--token-file {name}")
    try:
        with path.open("rb") as file:
            data = file.read(MAX_TOKEN_BYTES + 3)  # a token, its line end and one more: never a whole big file
        if len(data) > MAX_TOKEN_BYTES + 2:
            raise UsageError(f"--token-file {name}: larger than a token can be ({MAX_TOKEN_BYTES} characters)")
        text = data.decode()
    except OSError as exc:
        raise UsageError(f"--token-file {name}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--token-file {name} is not UTF-8 text") from None
    token = text.rstrip("\r\n")
    if not token.strip():
        raise UsageError(f"--token-file {name} is empty")
    if any(c in token for c in "\r\n"):
        raise UsageError(f"--token-file {name} holds more than one line")
    return sendable_token(token, f"--token-file {name}")


def _read_saved(path: pathlib.Path) -> dict[str, str]:
    """The connection file: a JSON object whose values are strings (a list, a number or a
    directory is a usage error, never a traceback; so is a pipe or a device, which could be read
    for ever)."""
    _require_regular(path, f"connection file {path}")
    try:
        saved = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"connection file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"connection file {path} is not JSON: {exc}") from None
    if not isinstance(saved, dict):
        raise UsageError(f"connection file {path} is not a JSON object")
    for key in ("endpoint", "token", "tenantId", "poolId", "ca", "rootToken"):
        if saved.get(key) is not None and not isinstance(saved[key], str):
            raise UsageError(f"connection file {path}: {key} is not a string")
        require_utf8([saved.get(key) or ""], f"connection file {path}: {key}")
    for key in ("token", "rootToken"):
        if saved.get(key):
            sendable_token(saved[key], f"connection file {path}: {key}")
    return saved


def _require_trusted(path: pathlib.Path, *, found: bool) -> None:
    """A connection file says where the token goes, so only its user may have written it. One the
    client finds by itself (`.dev/connection.json` is relative to the working directory, so a
    cloned repository could carry one) must be the user's and private (mode 0600, as `dev` writes
    it): a checked-out file is readable by all and is refused, and `--token` is never sent to an
    endpoint it names. One named by `--connection` must be the user's and writable by no one else."""
    try:
        info = path.stat()
    except OSError as exc:
        raise UsageError(f"connection file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        return  # refused as not a regular file where it is read
    loose = stat.S_IRWXG | stat.S_IRWXO if found else stat.S_IWGRP | stat.S_IWOTH
    if info.st_uid != os.getuid():
        raise UsageError(f"connection file {path} belongs to another user: it could send your token "
                         "anywhere (pass --connection with your own file, or --endpoint)")
    if info.st_mode & loose:
        needed = "private to you (chmod 600)" if found else "writable by you alone (chmod go-w)"
        raise UsageError(f"connection file {path} must be {needed}: it says where your token is sent")


def _require_regular(path: pathlib.Path, what: str) -> None:
    """A file the client reads must be a regular file (a directory or a missing one is refused
    where it is read, with the system's reason)."""
    if _exists(path, what) and not path.is_dir() and not path.is_file():
        raise UsageError(f"{what} is not a regular file")


def _exists(path: pathlib.Path, what: str) -> bool:
    """Whether `path` exists; a name the system refuses to look up (longer than it allows) is a
    usage error, where exists() raises instead of answering."""
    try:
        return path.exists()
    except OSError as exc:
        raise UsageError(f"{what}: {exc.strerror}") from None


def open_channel(conn: Connection) -> grpc.Channel:
    """The channel to the API: TLS checked against `conn.ca` when one is given, else plaintext."""
    if not conn.ca:
        return grpc.insecure_channel(conn.endpoint)
    _require_regular(pathlib.Path(conn.ca), f"--ca {conn.ca}")
    try:
        ca_pem = pathlib.Path(conn.ca).read_bytes()
    except OSError as exc:
        raise UsageError(f"--ca {conn.ca}: {exc.strerror}") from None
    try:  # gRPC would only log "Could not load any root certificate" and answer UNAVAILABLE
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError:
        raise UsageError(f"--ca {conn.ca} holds no PEM certificate") from None
    return grpc.secure_channel(conn.endpoint, grpc.ssl_channel_credentials(root_certificates=ca_pem))


class Client:
    """The tenant API's stubs with the connection's bearer token."""

    def __init__(self, channel: grpc.Channel, conn: Connection) -> None:
        self.conn = conn
        self.metadata = (("authorization", f"Bearer {conn.token}"),)
        self.operator_metadata = (("authorization", f"Bearer {conn.root_token or conn.token}"),)
        self.stubs = {
            "reservations": reservations_pb2_grpc.ReservationsStub(channel),
            "confirmations": reservations_pb2_grpc.ConfirmationsStub(channel),
            "capacity": capacity_pb2_grpc.CapacityStub(channel),
            "events": events_pb2_grpc.EventsStub(channel),
            "usage": usage_pb2_grpc.UsageStub(channel),
            "nodes": nodes_pb2_grpc.NodeAdminStub(channel),  # root's: the operator's token
        }

    def call(self, service: str, method: str, request: Message, timeout: float | None = RPC_TIMEOUT_S) -> Any:
        stub = self.stubs[service]
        metadata = self.operator_metadata if service == "nodes" else self.metadata
        return getattr(stub, method)(request, metadata=metadata, timeout=timeout)
