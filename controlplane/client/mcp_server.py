"""`better-compute mcp`: a Model Context Protocol server (stdio) so an agent can book GPUs.

It connects like the CLI (connection file, or --endpoint/--token/--tenant/--pool) with the agent's
own token. `reserve_gpus` runs the delegated-confirmation loop: when the agent's person holds the
request for confirmation, the tool answers with the confirmation id and what the person must do,
and keeps the request under its idempotency key; calling `reserve_gpus` again with that key sends
the same request again (same window, same key), which places it once the person has approved.
`extend_reservation` runs the same loop: a held extend is kept under its key and resent as it was
(a relative until is not read again), so the retry is the change the person approved.
"""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from typing import Any

import grpc
from mcp.server.mcpserver import MCPServer
from pydantic import ValidationError
from mcp.server.mcpserver.exceptions import ToolError

from bettercompute.v1 import reservations_pb2 as pb
from controlplane.client import commands
from controlplane.client.connection import Client, Connection, open_channel
from controlplane.client.errors import UsageError, error_json, require_utf8
from controlplane.client.render import as_json

INSTRUCTIONS = (
    "Book GPUs of a Better Compute pool. reserve_gpus may answer status 'confirmation-required': "
    "tell the person the confirmationId and the command in 'personMustRun', wait until they say "
    "they approved it, then call the same tool (reserve_gpus or extend_reservation) again with the "
    "same idempotencyKey."
)


class Tools:
    """The tools' behaviour, over one gRPC channel; `held` keeps requests awaiting confirmation."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.held: dict[str, pb.CreateReservationRequest] = {}
        self.held_extends: dict[str, pb.ExtendReservationRequest] = {}
        self.lock = threading.Lock()

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UsageError as exc:
            raise usage_error(exc) from None
        except grpc.RpcError as err:
            raise tool_error(err) from None

    def reserve_gpus(
        self, gpus: int, topology: str, duration: str, start: str | None, pool: str | None,
        wait_seconds: float, idempotency_key: str | None,
    ) -> dict[str, Any]:
        key = idempotency_key or f"mcp-{uuid.uuid4().hex}"
        with self.lock:
            held = self.held.get(key)
        if held is not None:
            request = pb.CreateReservationRequest()
            request.CopyFrom(held)  # the very request that was held, so the retry matches it
        else:
            request = self._call(
                commands.reserve_request, self.client, gpus=gpus, topology=topology, duration=duration,
                start=start, key=key, pool=pool,
            )
        try:
            reservation = commands.create_and_wait(self.client, request, max(0.0, wait_seconds))
        except grpc.RpcError as err:
            error = error_json(err)["error"]
            if error["code"] != "CONFIRMATION_REQUIRED":
                with self.lock:
                    self.held.pop(key, None)  # decided (e.g. rejected): nothing left to resend
                raise tool_error(err) from None
            with self.lock:
                self.held[key] = request
            return confirmation_required(key, error.get("details", {}), "reserve_gpus")
        except UsageError as exc:
            raise usage_error(exc) from None
        with self.lock:
            self.held.pop(key, None)
        answer: dict[str, Any] = {"status": reservation.state, "idempotencyKey": key, "reservation": as_json(reservation)}
        if reservation.operation.state == "running":
            answer["note"] = "still queued: read it again later with get_reservation"
        return answer

    def preview_capacity(
        self, gpus: int, topology: str, duration: str, start: str | None, pool: str | None, gang: int | None,
        topology_key: str, earliest: bool, horizon: str | None,
    ) -> dict[str, Any]:
        request = self._call(commands.reserve_request, self.client, gpus=gpus, topology=topology, duration=duration,
                             start=start, pool=pool, gang=gang, topology_key=topology_key, earliest=earliest,
                             horizon=horizon)
        return as_json(self._call(self.client.call, "capacity", "Preview", request))

    def get_reservation(self, reservation_id: str) -> dict[str, Any]:
        request = pb.GetReservationRequest(tenant_id=self.client.conn.tenant_id, reservation_id=reservation_id)
        return as_json(self._call(self.client.call, "reservations", "Get", request))

    def list_reservations(self, all_: bool, states: list[str] | None, pool: str | None, cursor: str | None) -> dict[str, Any]:
        request = pb.ListReservationsRequest(
            tenant_id=self.client.conn.tenant_id, scope="all" if all_ else "mine", states=states or [],
            pool_id=pool or "", cursor=cursor or "",
        )
        return as_json(self._call(self.client.call, "reservations", "List", request))

    def extend_reservation(self, reservation_id: str, until: str | None, by: str | None, key: str | None) -> dict[str, Any]:
        with self.lock:
            held = self.held_extends.get(key) if key else None
        if held is not None and held.reservation_id == reservation_id:
            request = pb.ExtendReservationRequest()
            request.CopyFrom(held)  # the very change that was held, so the retry matches it
        else:
            request = self._call(commands.extend_request, self.client, reservation_id, until=until, by=by, key=key)
        key = request.idempotency_key
        try:
            answer = as_json(self.client.call("reservations", "Extend", request))
        except grpc.RpcError as err:
            error = error_json(err)["error"]
            with self.lock:
                if error["code"] == "CONFIRMATION_REQUIRED":
                    self.held_extends[key] = request
                else:
                    self.held_extends.pop(key, None)
            if error["code"] == "CONFIRMATION_REQUIRED":
                return confirmation_required(key, error.get("details", {}), "extend_reservation")
            raise tool_error(err) from None
        except UsageError as exc:
            raise usage_error(exc) from None
        with self.lock:
            self.held_extends.pop(key, None)
        answer["idempotencyKey"] = key
        return answer

    def release_reservation(self, reservation_id: str) -> dict[str, Any]:
        request = pb.ReleaseReservationRequest(tenant_id=self.client.conn.tenant_id, reservation_id=reservation_id)
        return as_json(self._call(self.client.call, "reservations", "Release", request))


def tool_error(err: grpc.RpcError) -> ToolError:
    """The spec's code, message and details, as the JSON the model reads."""
    return ToolError(json.dumps(error_json(err)["error"]))


# The CLI's options the shared request builders name, as the tools' arguments are called.
TOOL_ARGUMENTS = {"--for": "duration", "--start": "start", "--horizon": "horizon", "--by": "by", "--until": "until",
                  "--gpus": "gpus", "--gang": "gang"}


def usage_error(exc: UsageError) -> ToolError:
    """Arguments the client refuses before any call, with the API's code for bad input, naming the
    tool's argument (`duration`, not the CLI's `--for`) in the message and as details.field."""
    message = str(exc)
    option = message.split(" ", 1)[0]
    error: dict[str, Any] = {"code": "INVALID_INPUT", "message": message}
    if option in TOOL_ARGUMENTS:
        error["message"] = TOOL_ARGUMENTS[option] + message[len(option):]
        error["details"] = {"field": TOOL_ARGUMENTS[option]}
    return ToolError(json.dumps(error))


def confirmation_required(key: str, details: dict[str, str], tool: str) -> dict[str, Any]:
    confirmation_id = details.get("confirmationId", "")
    return {
        "status": "confirmation-required",
        "idempotencyKey": key,
        "confirmationId": confirmation_id,
        "reservationId": details.get("reservationId", ""),
        "expiresAt": details.get("expiresAt", ""),
        "personMustRun": f"better-compute confirmations approve {confirmation_id}",
        "next": "Ask your person to approve it (or reject it with `better-compute confirmations reject "
        f"{confirmation_id}`); once they have, call {tool} again with idempotencyKey {key!r}.",
    }


class Server(MCPServer):
    """Arguments that fail the tools' schema (a string for gpus, a missing reservationId) are
    INVALID_INPUT naming the field, as JSON like every other tool failure, not pydantic's text."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            if not isinstance(exc.__cause__, ValidationError):
                raise
            problems = exc.__cause__.errors()
            field = ".".join(str(part) for part in problems[0]["loc"]) if problems else ""
            error = {"code": "INVALID_INPUT", "message": f"{field}: {problems[0]['msg']}" if problems else str(exc),
                     "details": {"field": field}}
            raise ToolError(f"Error executing tool {name}: {json.dumps(error)}") from exc.__cause__


def build(tools: Tools) -> MCPServer:
    server = Server("better-compute", instructions=INSTRUCTIONS)

    @server.tool()
    def reserve_gpus(
        gpus: int,
        topology: str = "",
        duration: str = "1h",
        start: str | None = None,
        pool: str | None = None,
        waitSeconds: float = 20.0,  # noqa: N803 - the spec's name
        idempotencyKey: str | None = None,  # noqa: N803
    ) -> dict[str, Any]:
        """Reserve whole GPUs of a pool. topology: '', 'nvlink-all' or 'numa'; duration such as '8h';
        start: '+2h', ISO 8601 or omitted for now; waitSeconds: how long to wait for placement.
        Pass idempotencyKey to retry safely; one is generated and returned otherwise. The answer's
        status is the reservation's state, or 'confirmation-required' (see 'next')."""
        return tools.reserve_gpus(gpus, topology, duration, start, pool, waitSeconds, idempotencyKey)

    @server.tool()
    def preview_capacity(
        gpus: int,
        topology: str = "",
        duration: str = "1h",
        start: str | None = None,
        pool: str | None = None,
        gang: int | None = None,
        topologyKey: str = "",  # noqa: N803
        earliest: bool = False,
        horizon: str | None = None,
    ) -> dict[str, Any]:
        """Where reserve_gpus with these arguments would place now, booking nothing: fits, the
        nodes (a gang's members: gang nodes of `gpus` each, sharing topologyKey) and their devices,
        or the reason with each filter's count. earliest=true: the earliest start within horizon
        ('14d' by default, at most '60d') at which it fits."""
        return tools.preview_capacity(gpus, topology, duration, start, pool, gang, topologyKey, earliest, horizon)

    @server.tool()
    def get_reservation(reservationId: str) -> dict[str, Any]:  # noqa: N803
        """A reservation: state, window (epoch ms), allocations, binding, conditions."""
        return tools.get_reservation(reservationId)

    @server.tool()
    def list_reservations(
        all: bool = False,  # noqa: A002
        states: list[str] | None = None,
        pool: str | None = None,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """My reservations, newest first (all=true: the tenant's); filter by states and pool."""
        return tools.list_reservations(all, states, pool, cursor)

    @server.tool()
    def extend_reservation(
        reservationId: str,  # noqa: N803
        until: str | None = None,
        by: str | None = None,
        idempotencyKey: str | None = None,  # noqa: N803
    ) -> dict[str, Any]:
        """Move a reservation's end later: exactly one of until ('+12h', ISO 8601, epoch ms) or by
        ('4h'). Prefer until when you may retry. extended=false with availableUntil when another
        booking starts first; status 'confirmation-required' as for reserve_gpus (see 'next')."""
        return tools.extend_reservation(reservationId, until, by, idempotencyKey)

    @server.tool()
    def release_reservation(reservationId: str) -> dict[str, Any]:  # noqa: N803
        """End a reservation now and refund its quota."""
        return tools.release_reservation(reservationId)

    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="better-compute mcp", description="Serve the GPU tools to an agent over stdio (MCP).")
    parser.add_argument("--connection", metavar="PATH", help="the file `dev` writes (default $BC_DATA_DIR/connection.json)")
    parser.add_argument("--endpoint", help="host:port of the API")
    parser.add_argument("--token", help="the agent's bearer token (any local user sees it in `ps`: prefer $BC_TOKEN"
                        " or --token-file)")
    parser.add_argument("--token-file", metavar="PATH",
                        help="a file holding the agent's bearer token (read once; a trailing newline is ignored)")
    parser.add_argument("--tenant", help="tenant id")
    parser.add_argument("--pool", help="default pool id")
    args = parser.parse_args(argv)
    try:
        require_utf8([value for value in vars(args).values() if value], "argument")
        conn = Connection.resolve(
            connection=args.connection, endpoint=args.endpoint, token=args.token, tenant=args.tenant, pool=args.pool,
        ca=getattr(args, "ca", None), token_file=args.token_file,
        )
        channel = open_channel(conn)  # a connection file's unreadable `ca` is a usage error too
    except UsageError as exc:
        parser.error(str(exc))
    with channel:
        build(Tools(Client(channel, conn))).run("stdio")
    return 0
