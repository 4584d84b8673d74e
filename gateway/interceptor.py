"""One canonical log line per unary RPC of the node gateway, a request id, and domain errors
mapped to gRPC status in one place (controlplane.common.status). Sessions log their own start and end.
Requests and a session's messages are decoded here, not by grpc (controlplane.nodes.wire)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from controlplane import errors
from controlplane.common.status import failure, to_status
from controlplane.metrics import RpcMetrics
from controlplane.nodes import wire

log = structlog.get_logger("gateway.rpc")

# A caller's x-request-id is kept when it is one the API would keep; anything else (the enrol port
# answers anyone: a 8 KB header of forged text) gets a fresh one, never the caller's text in the log.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class GatewayInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self._metrics = metrics or RpcMetrics()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is not None and handler.stream_stream:  # the session: each message decoded here
            return grpc.stream_stream_rpc_method_handler(
                _decoding(handler.stream_stream, handler.request_deserializer),
                request_deserializer=None, response_serializer=handler.response_serializer)
        if handler is None or not handler.unary_unary:
            return handler
        metadata = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        return grpc.unary_unary_rpc_method_handler(
            _wrap(details.method, _request_id(metadata.get("x-request-id", "")), handler.unary_unary,
                  handler.request_deserializer, self._metrics),
            request_deserializer=None,  # decoded in the wrapper: bad bytes are INVALID_INPUT
            response_serializer=handler.response_serializer,
        )


def _request_id(given: str) -> str:
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def _decoding(behavior: Any, deserializer: Any) -> Any:
    """The stream handler, given the messages decoded: one that cannot be raises INVALID_INPUT
    where the session reads it (gateway.session ends the session with that status)."""
    async def messages(raw: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for item in raw:
            yield wire.decode(deserializer, item)

    async def handle(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(messages(request_iterator), context)

    return handle


def _wrap(method: str, request_id: str, behavior: Any, deserializer: Any, metrics: RpcMetrics) -> Any:
    async def handle(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        structlog.contextvars.bind_contextvars(request_id=request_id, method=method)
        started = time.perf_counter()
        try:
            request = wire.decode(deserializer, raw)
            response = await behavior(request, context)
        except errors.DomainError as exc:
            _log(exc.code, started, metrics)
            await context.abort_with_status(to_status(exc.code, exc.message, exc.details))
        except Exception as exc:
            code, status = failure(exc, "rpc", requestId=request_id)  # UNAVAILABLE: the node retries
            _log(code, started, metrics)
            await context.abort_with_status(status)
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
