"""Cross-cutting concerns of every RPC, in one interceptor: a request id, size limits, decoding,
authentication, the unknown-field and generic input checks, error mapping and one canonical log
line per RPC."""

from __future__ import annotations

import asyncio
import contextvars
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from psycopg_pool import AsyncConnectionPool

from controlplane import auth, db, errors, tokens
from controlplane.common import inputs
from controlplane.common.names import TENANT_ID
from controlplane.common.status import failure, to_status
from controlplane.config import Settings
from controlplane.metrics import RpcMetrics

log = structlog.get_logger("rpc")

_caller: contextvars.ContextVar[auth.Caller] = contextvars.ContextVar("caller")
_unverified: contextvars.ContextVar[auth.Unverified | None] = contextvars.ContextVar("unverified", default=None)

# Methods whose handler verifies a known token in its first statement (auth.Unverified) instead
# of the interceptor's own read before it: one round trip less for the busiest call. Any error
# such a call answers before its handler verified the token is answered UNAUTHENTICATED instead
# when the token no longer authenticates, so the order of answers is the same as everywhere else.
VERIFIED_BY_HANDLER = frozenset({"/bettercompute.v1.Reservations/Create"})  # unary calls only

PUBLIC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_SHOWN = 64  # characters of an invalid tenant id that reach the log
CEILING = 16  # gRPC receives up to this many times an API limit, so that the API refuses with ErrorInfo
_GRPC_MAX = 2**31 - 1  # grpc's channel arguments are C ints


def caller() -> auth.Caller:
    """The authenticated caller of the RPC being served."""
    return _caller.get()


def caller_or_unverified() -> auth.Caller | auth.Unverified:
    """For a method in VERIFIED_BY_HANDLER: the caller, or a known token its handler must verify
    (auth.verify) in its first statement, before it acts on anything."""
    return _unverified.get() or _caller.get()


def unknown_field_path(message: Message, prefix: str = "") -> str | None:
    """The path of the first unknown field in `message` or its nested messages, if any. A message
    is read field by field only when a copy without unknown fields (made at C speed) is smaller,
    and its own first unknown field is found on its wire bytes: a request of a million unknown
    fields costs what one of a few does (UnknownFieldSet made a Python object of each, stalling
    the event loop for a second and taking 40 MB for a 1 MiB request)."""
    if not _has_unknown(message):
        return None
    found = _first_unknown(message)
    if found is not None:
        return f"{prefix}.{found}" if prefix and not found.startswith("#") else f"{prefix}{found}"
    for fd, value in message.ListFields():
        if fd.message_type is None:
            continue
        name = f"{prefix}.{fd.json_name}" if prefix else fd.json_name
        if fd.message_type.GetOptions().map_entry:
            values = value.values() if fd.message_type.fields_by_name["value"].message_type else []
            items = [(f"{name}[{k!r}]", v) for k, v in zip(value.keys(), values)]
        elif fd.is_repeated:
            items = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(name, value)]
        for path, nested in items:
            found = unknown_field_path(nested, path)
            if found:
                return found
    return None


def _has_unknown(message: Message) -> bool:
    """Whether `message` or a message nested in it holds an unknown field."""
    known = type(message)()
    known.CopyFrom(message)
    known.DiscardUnknownFields()
    return known.ByteSize() != message.ByteSize()


def _first_unknown(message: Message) -> str | None:
    """Where the first unknown field of `message` itself (not of a nested message) is, read from
    its wire bytes: `#N` for field number N, or `map[]#N` for a map entry holding field N unknown
    to the entry (or its key or value sent as another wire type), which the parser keeps whole as
    an unknown field under the map's own number, so the map would lose the entry silently. Its
    known fields before it are skipped (a few, since the count caps)."""
    return _first_unknown_in(message.SerializeToString(), message.DESCRIPTOR)


def _first_unknown_in(raw: bytes, descriptor: Any, *, entries: bool = True) -> str | None:
    pos, known = 0, descriptor.fields_by_number
    while pos < len(raw):
        tag, pos = _varint(raw, pos)
        fd = known.get(tag >> 3)
        if fd is None or tag & 7 != _wire_type(fd):  # a known number sent as another type is unknown too
            return f"#{tag >> 3}"
        if tag & 7 == 0:
            pos = _varint(raw, pos)[1]
        elif tag & 7 == 2:
            size, pos = _varint(raw, pos)
            entry = fd.message_type
            if entries and entry is not None and entry.GetOptions().map_entry:
                inner = _first_unknown_in(raw[pos:pos + size], entry, entries=False)
                if inner is not None:
                    return f"{fd.json_name}[]{inner}"
            pos += size
        else:
            pos += 8 if tag & 7 == 1 else 4
    return None


def _wire_type(fd: FieldDescriptor) -> int:
    """The wire type a known field is serialized with."""
    if fd.type in _DELIMITED or fd.is_packed:
        return 2
    return 1 if fd.type in _FIXED64 else 5 if fd.type in _FIXED32 else 0


_DELIMITED = {FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE}
_FIXED64 = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
_FIXED32 = {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32}


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """gRPC receives a request message up to a ceiling (CEILING times the API's own limit,
    max_request_bytes), so a request between the two reaches the interceptor, which refuses it as
    INVALID_INPUT with ErrorInfo; only one beyond the ceiling meets grpc's bare RESOURCE_EXHAUSTED,
    and no request holds more than the ceiling in memory."""
    metadata = _ceiling(settings.max_metadata_bytes)  # soft and hard alike: no refusal by chance below it
    return [("grpc.max_receive_message_length", _ceiling(settings.max_request_bytes)),
            ("grpc.max_metadata_size", metadata), ("grpc.absolute_max_metadata_size", metadata)]


def _ceiling(limit: int) -> int:
    return max(1, min(limit * CEILING, _GRPC_MAX))


def _over(what: str, size: int, limit: int) -> errors.InvalidInput | None:
    """The INVALID_INPUT naming `what` (the request or its metadata) when it is over its limit in bytes."""
    if size <= limit:
        return None
    return errors.InvalidInput(what, f"is {size} bytes, larger than the limit of {limit}",
                               reason=f"{what}-too-large", limitBytes=limit, sizeBytes=size)


class ApiInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, pool: AsyncConnectionPool, settings: Settings | None = None,
                 metrics: RpcMetrics | None = None) -> None:
        self._pool = pool
        self._metrics = metrics or RpcMetrics()
        settings = settings or Settings()
        self._limits = inputs.InputLimits.of(settings)
        self._max_request_bytes = settings.max_request_bytes
        self._max_metadata_bytes = settings.max_metadata_bytes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(PUBLIC_PREFIXES):
            return handler
        metadata = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        size = sum(len(k) + len(v) for k, v in (details.invocation_metadata or ()))  # names and values, as sent
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap(method, metadata, size, handler.unary_unary, handler.request_deserializer),
                request_deserializer=None,  # decoded in the wrapper: bad bytes are INVALID_INPUT
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, metadata, size, handler.unary_stream, handler.request_deserializer),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        # Client-streaming and bidirectional calls (none is served yet) would reach their handler
        # unauthenticated: refuse them, so adding one fails closed until it is wrapped here too.
        return _refused(method, handler)

    async def _prologue(self, method: str, metadata: dict[str, str], metadata_bytes: int, raw: Any,
                        deserializer: Any) -> Any:
        """The decoded, checked request. Only validated or bounded values are bound for the log,
        before the caller is known."""
        given = metadata.get("x-request-id") or ""
        # A bearer secret sent as the request id (a misconfigured proxy or SDK) is not kept: the id
        # is bound to every log line of the call and echoed back. The log shows its public prefix
        # only, as for a secret pasted as the tenant id.
        pasted = given.find(tokens.SECRET_PREFIX)
        request_id = given if pasted < 0 and REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id, method=method, tenant="")
        if pasted >= 0:
            structlog.contextvars.bind_contextvars(
                request_id_refused=repr(given[pasted:pasted + tokens.PREFIX_LENGTH]))
        # The metadata is bounded before authentication reads it; a request over its limit is not
        # decoded, and is refused after authentication like every other input check.
        over = _over("metadata", metadata_bytes, self._max_metadata_bytes)
        if over:
            raise over
        if isinstance(raw, bytes | bytearray | memoryview):
            over = _over("request", len(raw), self._max_request_bytes)
        request = None if over else inputs.decode(deserializer, raw)
        tenant = getattr(request, "tenant_id", "")
        if isinstance(tenant, str) and tenant:
            if tenant.startswith(tokens.SECRET_PREFIX):  # a bearer secret pasted as the tenant: its public prefix
                structlog.contextvars.bind_contextvars(tenant_invalid=repr(tenant[:tokens.PREFIX_LENGTH]),
                                                       tenant_len=len(tenant))
            elif TENANT_ID.fullmatch(tenant):
                structlog.contextvars.bind_contextvars(tenant=tenant)
            else:
                structlog.contextvars.bind_contextvars(tenant_invalid=repr(tenant[:_SHOWN]), tenant_len=len(tenant))
        secret = auth.bearer_secret(metadata)
        unverified = auth.KNOWN.unverified(secret) if method in VERIFIED_BY_HANDLER else None
        if unverified is None:
            _caller.set(await auth.authenticate(self._pool, secret))
        else:
            _unverified.set(unverified)
        if over:
            raise over
        inputs.check(request, self._limits)  # first: the counts it caps bound the walk for unknown fields
        bad = unknown_field_path(request)
        if bad:
            raise errors.InvalidInput(bad, "unknown field")
        return request

    async def _unauthenticated_first(self, exc: errors.DomainError) -> errors.DomainError:
        """`exc`, or UNAUTHENTICATED when the call's token was not verified yet and no longer
        authenticates (VERIFIED_BY_HANDLER): a bad token is answered before anything else."""
        unverified = _unverified.get()
        if unverified is None or unverified.caller is not None or isinstance(exc, errors.Unauthenticated):
            return exc
        try:
            _caller.set(await auth.verify_now(self._pool, unverified))
        except errors.Unauthenticated as refused:
            return refused
        except Exception:  # the database failed meanwhile: the handler's error stands
            log.warning("could not verify the token of a refused call", exc_info=True)
        return exc

    async def _verified_before_answer(self) -> None:
        """No answer leaves for a token nobody verified: a handler in VERIFIED_BY_HANDLER that
        returned without verifying is a bug, logged, and the token is verified now."""
        unverified = _unverified.get()
        if unverified is not None and unverified.caller is None:
            log.error("a handler answered without verifying its caller's token")
            _caller.set(await auth.verify_now(self._pool, unverified))

    def _wrap(self, method: str, metadata: dict[str, str], metadata_bytes: int, behavior: Any,
              deserializer: Any) -> Any:
        async def handle(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            db.spent_here()
            try:
                request = await self._prologue(method, metadata, metadata_bytes, raw, deserializer)
                context.set_trailing_metadata((("x-request-id", _request_id()),))
                response = await behavior(request, context)
                await self._verified_before_answer()
            except errors.DomainError as exc:
                exc = await self._unauthenticated_first(exc)
                status = to_status(exc.code, exc.message, exc.details)
                _log_rpc(exc.code, started, self._metrics)
            except asyncio.CancelledError:
                _log_rpc("CANCELLED", started, self._metrics)  # the client went away: the task (and any wait) stops
                raise
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                status = _failed(exc, started, self._metrics)
            else:
                _log_rpc("OK", started, self._metrics)
                return response
            await context.abort_with_status(status)

        return handle

    def _wrap_stream(self, method: str, metadata: dict[str, str], metadata_bytes: int, behavior: Any,
                     deserializer: Any) -> Any:
        async def handle(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                request = await self._prologue(method, metadata, metadata_bytes, raw, deserializer)
                context.set_trailing_metadata((("x-request-id", _request_id()),))
                async for item in behavior(request, context):
                    yield item
            except errors.DomainError as exc:
                status = to_status(exc.code, exc.message, exc.details)
                _log_rpc(exc.code, started, self._metrics)
            except asyncio.CancelledError:
                _log_rpc("CANCELLED", started, self._metrics)
                raise
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                status = _failed(exc, started, self._metrics)
            else:
                _log_rpc("OK", started, self._metrics)
                return
            await context.abort_with_status(status)

        return handle


def _failed(exc: Exception, started: float, metrics: RpcMetrics) -> grpc.Status:
    """The status of an unexpected failure (status.failure), with the RPC's log line."""
    code, status = failure(exc, "rpc", requestId=_request_id())
    _log_rpc(code, started, metrics)
    return status


def _refused(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNSUPPORTED before reading a message."""
    status = to_status(errors.UNSUPPORTED, "this server does not serve request-streaming calls",
                       {"method": method})

    async def refuse(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        log.warning("request-streaming call refused", method=method)
        await context.abort_with_status(status)

    async def refuse_stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(request_iterator, context)
        yield  # pragma: no cover - abort raises; this only makes it an async generator

    kind = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return kind(refuse_stream if handler.response_streaming else refuse,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _log_rpc(code: str, started: float, metrics: RpcMetrics) -> None:
    """The one canonical line per RPC, and its metrics; the request id, method and tenant come
    from contextvars. A unary RPC that used the database says where that time went (db.Spent):
    `db_wait_ms` waiting for a pooled connection, `db_ms` holding one, `db_lent` how many times;
    the rest of `duration_ms` was this process's own (its CPU, or its event loop busy elsewhere)."""
    bound = structlog.contextvars.get_contextvars()
    seconds = time.perf_counter() - started
    metrics.rpc(bound.get("method", ""), code, seconds)
    spent = db.spent()
    database = ({"db_wait_ms": round(spent.waited * 1000, 2), "db_ms": round(spent.held * 1000, 2),
                 "db_lent": spent.lent} if spent is not None and spent.lent else {})
    log.info("rpc", request_id=bound.get("request_id", ""), method=bound.get("method", ""),
             tenant=bound.get("tenant", ""), identity=_identity(), code=code, duration_ms=round(seconds * 1000, 2),
             **database)


def _request_id() -> str:
    return str(structlog.contextvars.get_contextvars().get("request_id", ""))


def _identity() -> str:
    found = _caller.get(None) or _unverified.get()
    return found.identity_id if found else ""
