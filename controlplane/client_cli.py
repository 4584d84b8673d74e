"""`better-compute reserve|get|list|release|cancel`: the tenant API from a shell.

The connection (endpoint, token, tenant, pool) comes from the file `better-compute dev` writes,
`$BC_DATA_DIR/connection.json` (`.dev/connection.json` by default), or `--connection PATH`;
`--endpoint`, `--token`, `--tenant` and `--pool` override it; `--ca` dials TLS. Answers are printed as JSON (the
protobuf JSON mapping, camelCase). A failure prints its spec code, message and details as JSON on
stderr and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import reservations_pb2_grpc
from controlplane.config import Settings
from controlplane.durations import parse_duration_ms

MAX_SERVER_WAIT_MS = 30_000  # the server holds a create at most this long
RPC_TIMEOUT_S = 30.0


class UsageError(Exception):
    """A problem with the command line or the connection file, found before any call."""


@dataclass(frozen=True)
class Connection:
    endpoint: str
    token: str
    tenant_id: str
    pool_id: str

    @classmethod
    def resolve(cls, args: argparse.Namespace) -> Connection:
        path = pathlib.Path(args.connection or pathlib.Path(Settings().data_dir, "connection.json"))
        saved: dict[str, Any] = {}
        if path.exists():
            try:
                saved = json.loads(path.read_text())
            except ValueError as exc:
                raise UsageError(f"connection file {path} is not JSON: {exc}") from None
        elif args.connection:
            raise UsageError(f"connection file {path} does not exist")
        conn = cls(
            endpoint=args.endpoint or saved.get("endpoint", ""),
            token=args.token or saved.get("token", ""),
            tenant_id=args.tenant or saved.get("tenantId", ""),
            pool_id=getattr(args, "pool", None) or saved.get("poolId", ""),
        )
        needed = {"endpoint": conn.endpoint, "token": conn.token, "tenant": conn.tenant_id}
        missing = [name for name, value in needed.items() if not value]
        if missing:
            raise UsageError(
                f"no {', '.join(missing)}: start `make dev` (it writes {path}), "
                "or pass --connection, or --endpoint, --token and --tenant"
            )
        return conn


class Client:
    def __init__(self, channel: grpc.Channel, conn: Connection) -> None:
        self.stub = reservations_pb2_grpc.ReservationsStub(channel)
        self.conn = conn
        self.metadata = (("authorization", f"Bearer {conn.token}"),)

    def call(self, method: str, request: Message, timeout: float = RPC_TIMEOUT_S) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout)


def reserve(client: Client, args: argparse.Namespace) -> Message:
    """Create with wait; if the answer is still queued, poll get until the same deadline."""
    if not client.conn.pool_id:
        raise UsageError("no pool: pass --pool or use a connection file that names one")
    deadline = time.monotonic() + args.wait
    request = pb.CreateReservationRequest(
        tenant_id=client.conn.tenant_id,
        pool_id=client.conn.pool_id,
        devices=[pb.DeviceRequest(device_class="gpu", count=args.gpus, topology=args.topology)],
        duration=args.duration,
        idempotency_key=args.key or f"cli-{uuid.uuid4().hex}",
        wait=pb.Wait(timeout_ms=min(int(args.wait * 1000), MAX_SERVER_WAIT_MS)),
    )
    if args.start:
        request.start = parse_start(args.start)
    reservation = client.call("Create", request, timeout=args.wait + RPC_TIMEOUT_S)
    pause = 0.25
    while reservation.operation.state == "running" and time.monotonic() + pause < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
        reservation = client.call("Get", _get_request(client, reservation.id))
    return reservation


def parse_start(text: str, *, now_ms: int | None = None) -> int:
    """Epoch milliseconds for `+2h` (from now), ISO 8601 (naive means local time) or epoch ms."""
    text = text.strip()
    try:
        if text.startswith("+"):
            now = int(time.time() * 1000) if now_ms is None else now_ms
            return now + parse_duration_ms(text[1:])
        if text.isdigit():
            return int(text)
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"--start {text!r}: use +2h, ISO 8601 or epoch milliseconds") from None
    if moment.tzinfo is None:
        moment = moment.astimezone()
    return int(moment.timestamp() * 1000)


def _get_request(client: Client, reservation_id: str) -> pb.GetReservationRequest:
    return pb.GetReservationRequest(tenant_id=client.conn.tenant_id, reservation_id=reservation_id)


def get(client: Client, args: argparse.Namespace) -> Message:
    return client.call("Get", _get_request(client, args.reservation_id))


def list_(client: Client, args: argparse.Namespace) -> Message:
    request = pb.ListReservationsRequest(
        tenant_id=client.conn.tenant_id,
        scope="all" if args.all else "mine",
        states=args.state or [],
        pool_id=args.pool or "",
        limit=args.limit,
        cursor=args.cursor or "",
    )
    return client.call("List", request)


def release(client: Client, args: argparse.Namespace) -> Message:
    request = pb.ReleaseReservationRequest(
        tenant_id=client.conn.tenant_id, reservation_id=args.reservation_id
    )
    return client.call("Release", request)


def cancel(client: Client, args: argparse.Namespace) -> Message:
    request = pb.CancelReservationRequest(
        tenant_id=client.conn.tenant_id, reservation_id=args.reservation_id
    )
    return client.call("Cancel", request)


def _connection_args(parser: argparse.ArgumentParser, default: Any) -> None:
    group = parser.add_argument_group("connection (before or after the command)")
    group.add_argument(
        "--connection",
        metavar="PATH",
        default=default,
        help="the file `dev` writes (default $BC_DATA_DIR/connection.json)",
    )
    group.add_argument("--endpoint", default=default, help="host:port of the API")
    group.add_argument("--token", default=default, help="bearer token")
    group.add_argument("--tenant", default=default, help="tenant id")
    group.add_argument("--ca", metavar="PATH", default=default,
                       help="PEM of the CA that signed the API's TLS certificate: dial TLS (default plaintext)")


def _parser() -> argparse.ArgumentParser:
    # The connection options are accepted on both sides of the command: the subcommands'
    # copies leave the attribute alone unless given.
    common = argparse.ArgumentParser(add_help=False)
    _connection_args(common, argparse.SUPPRESS)

    parser = argparse.ArgumentParser(
        prog="better-compute",
        description="Reserve GPUs through the Better Compute API. Answers are JSON.",
        epilog="`better-compute dev` runs the system locally (see README.md).",
    )
    _connection_args(parser, None)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("reserve", parents=[common], help="reserve GPUs")
    p.add_argument("--gpus", type=int, required=True, help="how many whole GPUs")
    p.add_argument("--topology", default="", help="nvlink-all, numa or any (default any)")
    p.add_argument("--for", dest="duration", default="1h", help="8h, 90m, 3d... (default 1h)")
    p.add_argument("--start", help="+2h, an ISO 8601 time or epoch ms (default: now)")
    p.add_argument("--key", help="idempotency key (default: a new random key)")
    p.add_argument("--pool", help="pool id (default: the connection's)")
    p.add_argument(
        "--wait", type=float, default=20.0, help="seconds to wait while queued (default 20)"
    )
    p.set_defaults(run=reserve)

    for name, run, help_text in (
        ("get", get, "show a reservation"),
        ("release", release, "end a reservation now and refund its quota"),
        ("cancel", cancel, "withdraw a reservation that has not started"),
    ):
        p = commands.add_parser(name, parents=[common], help=help_text)
        p.add_argument("reservation_id", metavar="RSV_ID")
        p.set_defaults(run=run)

    p = commands.add_parser("list", parents=[common], help="list reservations, newest first")
    p.add_argument("--all", action="store_true", help="the tenant's, not only mine")
    p.add_argument("--state", action="append", help="only this state (repeatable)")
    p.add_argument("--pool", help="only this pool")
    p.add_argument("--limit", type=int, default=0, help="page size, 1 to 200 (default 50)")
    p.add_argument("--cursor", help="nextCursor of the previous page")
    p.set_defaults(run=list_)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        conn = Connection.resolve(args)
        with _channel(conn.endpoint, args.ca) as channel:
            answer = args.run(Client(channel, conn), args)
    except UsageError as exc:
        print(f"better-compute: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        print(json.dumps(error_json(err), indent=2), file=sys.stderr)
        return 1
    out = MessageToDict(answer, preserving_proto_field_name=False)
    if isinstance(answer, pb.ListReservationsResponse):
        out.setdefault("items", [])  # an empty page is a list, not a missing field
    print(json.dumps(out, indent=2))
    return 0


def _channel(endpoint: str, ca_path: str | None) -> grpc.Channel:
    if not ca_path:
        return grpc.insecure_channel(endpoint)
    try:
        ca_pem = pathlib.Path(ca_path).read_bytes()
    except OSError as exc:
        raise UsageError(f"--ca {ca_path}: {exc.strerror}") from None
    return grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(root_certificates=ca_pem))


def error_json(err: grpc.RpcError) -> dict[str, Any]:
    """The spec code, message and details of a failed call (the gRPC code when there is none)."""
    out: dict[str, Any] = {"code": err.code().name, "message": err.details() or ""}
    status = rpc_status.from_call(err)
    for detail in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            out["code"] = info.reason
            out["details"] = dict(info.metadata)
    return {"error": out}


if __name__ == "__main__":
    sys.exit(main())
