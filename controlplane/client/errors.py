"""The client's two kinds of failure: usage (exit 2) and a failed call (exit 1)."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class UsageError(Exception):
    """A problem with the command line or the connection file, found before any call."""


def require_utf8(values: list[str], what: str) -> None:
    """Every value encodes as UTF-8, as a request's strings must: bytes of another encoding in
    argv arrive as lone surrogates (and a JSON file may spell one as \\udc80)."""
    for value in values:
        try:
            value.encode()
        except UnicodeEncodeError:
            raise UsageError(f"{what} {value!r} is not UTF-8 text") from None


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
