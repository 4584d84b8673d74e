"""One canonical log line per unary RPC of the node gateway, a request id, and domain errors
mapped to gRPC status in one place (controlplane.common.status). Sessions log their own start and end."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from controlplane import errors
from controlplane.common.status import to_status
from controlplane.metrics import RpcMetrics

log = structlog.get_logger("gateway.rpc")


class GatewayInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self._metrics = metrics or RpcMetrics()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not handler.unary_unary:
            return handler
        metadata = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        return grpc.unary_unary_rpc_method_handler(
            _wrap(details.method, metadata.get("x-request-id") or uuid.uuid4().hex, handler.unary_unary,
                  self._metrics),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _wrap(method: str, request_id: str, behavior: Any, metrics: RpcMetrics) -> Any:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        structlog.contextvars.bind_contextvars(request_id=request_id, method=method)
        started = time.perf_counter()
        try:
            response = await behavior(request, context)
        except errors.DomainError as exc:
            _log(exc.code, started, metrics)
            await context.abort_with_status(to_status(exc.code, exc.message, exc.details))
        except Exception:
            log.exception("rpc failed")
            _log(errors.INTERNAL, started, metrics)
            await context.abort_with_status(to_status(errors.INTERNAL, "internal error", {"requestId": request_id}))
        else:
            _log("OK", started, metrics)
            return response

    return handle


def _log(code: str, started: float, metrics: RpcMetrics) -> None:
    bound = structlog.contextvars.get_contextvars()
    seconds = time.perf_counter() - started
    metrics.rpc(bound.get("method", ""), code, seconds)
    log.info("rpc", request_id=bound.get("request_id", ""), method=bound.get("method", ""),
             node_id=bound.get("node_id", ""), code=code, duration_ms=round(seconds * 1000, 2))
