"""The one place where domain errors become gRPC status with a google.rpc.ErrorInfo, for both
servers (the control plane's API and the node gateway)."""

from __future__ import annotations

import json

import grpc
import structlog
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from controlplane import db, errors

log = structlog.get_logger(__name__)

DOMAIN = "bettercompute.dev"

_GRPC_CODE = {
    errors.INVALID_INPUT: code_pb2.INVALID_ARGUMENT,
    errors.UNSUPPORTED: code_pb2.UNIMPLEMENTED,
    errors.UNAUTHENTICATED: code_pb2.UNAUTHENTICATED,
    errors.ACCESS_DENIED: code_pb2.PERMISSION_DENIED,
    errors.CONFIRMATION_REQUIRED: code_pb2.FAILED_PRECONDITION,
    errors.NOT_FOUND: code_pb2.NOT_FOUND,
    errors.CONFLICT: code_pb2.ABORTED,
    errors.INVALID_STATE: code_pb2.FAILED_PRECONDITION,
    errors.QUOTA_EXCEEDED: code_pb2.RESOURCE_EXHAUSTED,
    errors.CAPACITY_UNAVAILABLE: code_pb2.RESOURCE_EXHAUSTED,
    errors.UNAVAILABLE: code_pb2.UNAVAILABLE,
    errors.INTERNAL: code_pb2.INTERNAL,
}


def _metadata_value(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def to_status(code: str, message: str, details: dict[str, object]) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(
        reason=code, domain=DOMAIN, metadata={k: _metadata_value(v) for k, v in details.items()}
    )
    packed = any_pb2.Any()
    packed.Pack(info)
    return rpc_status.to_status(
        status_pb2.Status(code=_GRPC_CODE[code], message=message, details=[packed])
    )


def failure(exc: Exception, what: str, **details: str) -> tuple[str, grpc.Status]:
    """An unexpected failure as the caller sees it, for every server (the API's calls, the
    gateway's unary calls and node sessions): UNAVAILABLE for a database fault a retry may cure
    (logged as a warning), else INTERNAL (a bug, logged with its traceback). Neither tells the
    caller any internals; `details` name the call (requestId, sessionId). `what` names it in the
    log line ("rpc", "session"). Returns the spec code and the status."""
    transient = db.unavailable(exc, **details)
    if transient is not None:
        log.warning(f"{what} failed on a database fault", error=type(exc).__name__,
                    sqlstate=getattr(exc, "sqlstate", None))
        return transient.code, to_status(transient.code, transient.message, transient.details)
    log.error(f"{what} failed", exc_info=exc)
    return errors.INTERNAL, to_status(errors.INTERNAL, "internal error", details)


def grpc_code_name(code: str) -> str:
    return grpc.StatusCode(_GRPC_CODE_TO_ENUM[_GRPC_CODE[code]]).name


_GRPC_CODE_TO_ENUM = {c.value[0]: c.value for c in grpc.StatusCode}


def error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo of a failed call (for clients and tests)."""
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None
