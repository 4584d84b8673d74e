"""Fuzzing every RPC the API serves: arbitrary field values and raw bytes answer only the spec's
codes (DESIGN.md section 6), never INTERNAL or UNKNOWN, and the tenant's List still works after.

The methods are found by reflection over the descriptors of the services the server registers
(controlplane.app.SERVICES), so a new RPC is fuzzed without touching this file. Requests go out as
bytes through generic stubs; the counts per RPC and the codes seen are printed at the end
(`pytest -s tests/test_fuzz.py`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import errors
from controlplane.common.status import error_info
from controlplane.app import SERVICES
from tests.conftest import module_stack
from tests.support import PERMISSIVE, Client, World, make_world

EXAMPLES = 50
RAW_EXAMPLES = 15

# The spec's codes and the gRPC code each maps to (DESIGN.md section 6).
SPEC = {
    errors.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    errors.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    errors.ACCESS_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    errors.CONFIRMATION_REQUIRED: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    errors.CONFLICT: grpc.StatusCode.ABORTED,
    errors.INVALID_STATE: grpc.StatusCode.FAILED_PRECONDITION,
    errors.QUOTA_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.CAPACITY_UNAVAILABLE: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

POOL = descriptor_pool.Default()
METHODS: list[MethodDescriptor] = [
    m for name in SERVICES for m in POOL.FindServiceByName(name).methods if not m.client_streaming
]
# Served to root only: fuzzed with the tenant's token like every service, and with root's too.
ROOT_ONLY = {"bettercompute.v1.Admin", "bettercompute.v1.NodeAdmin"}
ROOT_METHODS = [m for m in METHODS if m.containing_service.full_name in ROOT_ONLY]
SEEN: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


@pytest.fixture(scope="module")
def fuzz_world(pg_uri: str) -> Iterator[tuple[World, pb.Reservation]]:
    stack = module_stack(pg_uri)
    server, root = next(stack)
    world = make_world(server.endpoint, root, server.conninfo)
    placed = world.create(count=2, start=world.later(2))
    yield world, placed
    print_report()
    world.user.close()
    next(stack, None)


def print_report() -> None:
    print("\nfuzz: requests per RPC and the codes seen")
    for name in sorted(SEEN):
        counts = SEEN[name]
        print(f"  {name:55} {sum(counts.values()):4}  " + ", ".join(f"{c}={n}" for c, n in sorted(counts.items())))
    print(f"  total {sum(sum(c.values()) for c in SEEN.values())}")


# Values -------------------------------------------------------------------------------------

INT32 = [0, 1, -1, 5, 60, 1440, 2**31 - 1, -(2**31)]
INT64 = [0, 1, -1, 2**63 - 1, -(2**63), int(7.9e15), 10**16, 253402300800000, 30_000, 3_600_000]


def known_strings(world: World, placed: pb.Reservation) -> list[str]:
    return [world.tenant, world.pool_id, placed.id, world.user_id, "gpu", "gpu.mig", "hold", "instance", "nvlink-all",
            "mine", "all", "placed", "8h", "366d", "999999999999w", "reservation.", "reservation.placed",
            "https://example.com/hook", "s" * 32, "rsv_" + "0" * 52, "conf_" + "0" * 26, "wh_" + "0" * 26,
            "", "\n", "\x00", "k\n", world.tenant + "\n", "x" * 5000, "é" * 10]


def templates(world: World, placed: pb.Reservation, now_ms: int) -> dict[str, dict[str, Any]]:
    """Valid requests to mutate, so the fuzz also reaches past validation. Methods without one
    are fuzzed from empty messages only."""
    tenant = {"tenant_id": world.tenant}
    return {
        "Reservations.Create": {**tenant, "pool_id": world.pool_id, "devices": [{"device_class": "gpu", "count": 1}],
                                "duration": "1h", "idempotency_key": "fuzz-k", "start": now_ms + 3_600_000},
        "Reservations.List": {**tenant, "scope": "all"},
        "Reservations.Extend": {**tenant, "reservation_id": placed.id, "by": "1m", "idempotency_key": "fuzz-x"},
        "Reservations.Get": {**tenant, "reservation_id": placed.id},
        "Reservations.Renew": {**tenant, "reservation_id": placed.id},
        "Capacity.Timeline": {**tenant, "pool_id": world.pool_id},
        "Webhooks.Create": {**tenant, "url": "https://example.com/hook", "secret": "s" * 32},
        "Webhooks.List": tenant,
        "Events.Watch": {**tenant, "from_now": True},
    }


def template(method: MethodDescriptor, world: World, placed: pb.Reservation, now_ms: int) -> Any:
    cls = message_factory.GetMessageClass(method.input_type)
    found = templates(world, placed, now_ms).get(f"{method.containing_service.name}.{method.name}")
    if found is None:
        fields = method.input_type.fields_by_name
        found = {"tenant_id": world.tenant} if "tenant_id" in fields else {}
    return cls(**found)


@st.composite
def mutated(draw: st.DrawFn, base: Any, strings: list[str], now_ms: int) -> Any:
    """`base` with one or two of its fields replaced by arbitrary values."""
    out = type(base)()
    out.CopyFrom(base)
    fields = list(base.DESCRIPTOR.fields)
    if not fields:
        return out
    for fd in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique_by=lambda f: f.name)):
        out.ClearField(fd.name)
        one = draw(message(base.DESCRIPTOR, strings, now_ms, only=fd.name))
        out.MergeFrom(one)
    return out


def scalar(fd: FieldDescriptor, strings: list[str], now_ms: int) -> st.SearchStrategy[Any]:
    t = fd.type
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(strings), st.text(max_size=24),
                         st.text(alphabet=st.sampled_from("ab:._-/\n\x00é"), max_size=8))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return st.one_of(st.sampled_from(INT32), st.integers(-(2**31), 2**31 - 1))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return st.one_of(st.sampled_from(INT64), st.integers(now_ms - 86_400_000, now_ms + 86_400_000 * 400),
                         st.integers(-(2**63), 2**63 - 1))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(width=32 if t == FieldDescriptor.TYPE_FLOAT else 64)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in fd.enum_type.values])
    raise AssertionError(f"no strategy for {fd.full_name}")


@st.composite
def message(draw: st.DrawFn, desc: Descriptor, strings: list[str], now_ms: int, depth: int = 0,
            only: str | None = None) -> Any:
    """Any message of type `desc` (or, with `only`, one whose only set field is that one)."""
    out = message_factory.GetMessageClass(desc)()
    if depth > 3 or desc.full_name.startswith("google.protobuf."):
        return out
    sizes = st.sampled_from([0, 1, 1, 2, 3, 65])
    for fd in desc.fields:
        if (only is not None and fd.name != only) or (only is None and not draw(st.booleans())):
            continue
        target = getattr(out, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            for _ in range(draw(sizes)):
                key = draw(scalar(key_fd, strings, now_ms))
                if value_fd.message_type is not None:
                    target[key].CopyFrom(draw(message(value_fd.message_type, strings, now_ms, depth + 1)))
                else:
                    target[key] = draw(scalar(value_fd, strings, now_ms))
        elif fd.is_repeated:
            for _ in range(draw(sizes)):
                if fd.message_type is not None:
                    target.add().CopyFrom(draw(message(fd.message_type, strings, now_ms, depth + 1)))
                else:
                    target.append(draw(scalar(fd, strings, now_ms)))
        elif fd.message_type is not None:
            target.CopyFrom(draw(message(fd.message_type, strings, now_ms, depth + 1)))
        else:
            setattr(out, fd.name, draw(scalar(fd, strings, now_ms)))
    return out


# Calls --------------------------------------------------------------------------------------


def call(world: World, method: MethodDescriptor, body: bytes, client: Client | None = None) -> str:
    """Send `body` as the request; the outcome's spec code, or OK. Fails on anything off the table."""
    name = path(method)
    client = client or world.user
    try:
        if method.server_streaming:
            stream = client.channel.unary_stream(name)(body, metadata=client.metadata, timeout=1.5)
            for _ in stream:
                stream.cancel()  # it serves: one event is enough
                return "OK"
            return "OK"
        client.channel.unary_unary(name)(body, metadata=client.metadata, timeout=30)
        return "OK"
    except grpc.RpcError as exc:
        code = exc.code()
        if method.server_streaming and code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return "OK"  # an open stream with nothing (more) to send
        info = error_info(exc)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), f"{name}: {code} {exc.details()}"
        assert info is not None, f"{name}: {code} without ErrorInfo: {exc.details()}"
        assert SPEC.get(info.reason) == code, f"{name}: {info.reason} as {code}"
        if info.reason == errors.INVALID_INPUT:
            assert info.metadata.get("field"), f"{name}: INVALID_INPUT names no field"
        return info.reason


def record(method: MethodDescriptor, outcome: str, who: str = "") -> None:
    SEEN[path(method) + who][outcome] += 1


def tenant_still_reads(world: World, placed: pb.Reservation) -> None:
    for scope in ("mine", "all"):
        listed = world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, scope=scope, limit=200))
        for r in listed.items:
            world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    assert world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=placed.id)).id


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("method", METHODS, ids=path)
def test_fields_of_every_rpc_answer_only_spec_codes(fuzz_world, method: MethodDescriptor) -> None:
    world, placed = fuzz_world
    strings = known_strings(world, placed)
    now_ms = world.later(0)
    base = template(method, world, placed, now_ms)

    @FUZZ
    @given(st.one_of(st.just(base), message(method.input_type, strings, now_ms), mutated(base, strings, now_ms)))
    def fuzz(request: Any) -> None:
        record(method, call(world, method, request.SerializeToString()))

    fuzz()
    tenant_still_reads(world, placed)


@pytest.mark.parametrize("method", METHODS, ids=path)
def test_raw_bytes_to_every_rpc_answer_only_spec_codes(fuzz_world, method: MethodDescriptor) -> None:
    world, placed = fuzz_world
    valid = message_factory.GetMessageClass(method.input_type)(tenant_id=world.tenant).SerializeToString() \
        if "tenant_id" in method.input_type.fields_by_name else b""

    @settings(FUZZ, max_examples=RAW_EXAMPLES)
    @given(st.one_of(st.binary(max_size=64),
                     st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n] + b"\xff"),
                     st.binary(max_size=8).map(lambda tail: valid + b"\x0a" + tail)))
    def fuzz(body: bytes) -> None:
        record(method, call(world, method, body))

    fuzz()
    tenant_still_reads(world, placed)


@pytest.mark.parametrize("method", ROOT_METHODS, ids=path)
def test_fields_of_every_root_rpc_answer_only_spec_codes(fuzz_world, method: MethodDescriptor) -> None:
    world, placed = fuzz_world
    strings = known_strings(world, placed) + [n.id for n in world.nodes] + ["GPU-" + world.nodes[0].name + "-0"]
    now_ms = world.later(0)
    base = template(method, world, placed, now_ms)

    @FUZZ
    @given(st.one_of(message(method.input_type, strings, now_ms), mutated(base, strings, now_ms)))
    def fuzz(request: Any) -> None:
        record(method, call(world, method, request.SerializeToString(), world.root), " (root)")

    fuzz()
    world.policy(PERMISSIVE)  # PutPolicy may have replaced it with one that refuses reads
    if method.name == "RevokeTokens":  # it may have revoked the user's tokens (identityId is a known string)
        token = world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=world.user_id)).secret
        world.user.metadata = (("authorization", f"Bearer {token}"),)
    tenant_still_reads(world, placed)
