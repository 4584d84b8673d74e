"""A hostile caller on the wire: requests too big to take or that are not the request message at
all, through the real tenant API and the real node gateway. The API answers each with the spec's
code and ErrorInfo (DESIGN.md sections 6 and 7a), and no request makes a server hold more than a
bounded ceiling of memory: beyond it grpc itself refuses the call and the server serves on."""

from __future__ import annotations

import tracemalloc
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import reservations_pb2_grpc
from controlplane.api.interceptor import CEILING
from controlplane.config import Settings
from tests.support import World, invalid, refused
from tests.test_gateway import (GatewayThread, Node, eventually, gateway, hello, join_token,  # noqa: F401
                                node_row, pool_id)
from tests.test_hostile_node import _raw_session

LIMIT = Settings().max_request_bytes  # the default the test control plane runs with
METADATA_LIMIT = Settings().max_metadata_bytes
LIST = "/bettercompute.v1.Reservations/List"
CREATE = "/bettercompute.v1.Reservations/Create"
WATCH = "/bettercompute.v1.Events/Watch"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def padded(message: Message, size: int) -> bytes:
    """The message's bytes and an unknown length-delimited field (number 1000), `size` bytes in all
    (and an unknown varint field, number 1001, where a length's varint leaves a byte over)."""
    head, tag = message.SerializeToString(), _varint(1000 << 3 | 2)
    for length in range(1, 6):
        body = size - len(head) - len(tag) - length
        if len(_varint(body)) == length:
            return head + tag + _varint(body) + b"p" * body
    return padded(type(message).FromString(head + b"\xc8\x3e\x00"), size)


def raw_call(world: World, method: str, payload: bytes, metadata: Any = None) -> Any:
    """`payload` sent as it is (no serializer, no client-side size limit); a Watch's first event."""
    with grpc.insecure_channel(world.endpoint, options=[("grpc.max_send_message_length", -1)]) as channel:
        metadata = world.user.metadata if metadata is None else metadata
        if method == WATCH:
            return next(iter(channel.unary_stream(method)(payload, metadata=metadata, timeout=60)))
        return channel.unary_unary(method)(payload, metadata=metadata, timeout=60)


def too_large(what: str, call: Any, *args: Any, **kw: Any) -> dict[str, str]:
    """The details of a call refused as INVALID_INPUT for its size, naming `what` and the limit."""
    details = invalid(what, call, *args, **kw)
    assert details["reason"] == f"{what}-too-large", details
    return details


def served(world: World) -> None:
    """The control plane still answers the tenant."""
    assert world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant)).items == []


# The request message's size --------------------------------------------------------------------

@pytest.mark.parametrize("size", [LIMIT + 1, 5 << 20], ids=["one-byte-over", "over-grpcs-default"])
def test_a_request_over_the_size_limit_is_invalid_input_naming_the_limit(world: World, size: int) -> None:
    """Over grpc's default limit (4 MiB) it was grpc's bare RESOURCE_EXHAUSTED, without a spec code."""
    details = too_large("request", raw_call, world, CREATE, padded(world.create_request(), size))
    assert (details["limitBytes"], details["sizeBytes"]) == (str(LIMIT), str(size))
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,)) == [(0,)]
    served(world)


def test_a_request_at_the_size_limit_is_read(world: World) -> None:
    """Refused only for the unknown field that pads it to the limit, not for its size."""
    invalid("#1000", raw_call, world, LIST, padded(pb.ListReservationsRequest(tenant_id=world.tenant), LIMIT))


def test_a_watch_request_over_the_size_limit_is_invalid_input(world: World) -> None:
    details = too_large("request", raw_call, world, WATCH, padded(epb.WatchRequest(tenant_id=world.tenant), 5 << 20))
    assert details["limitBytes"] == str(LIMIT)


def test_a_request_beyond_the_ceiling_is_refused_by_grpc_and_the_server_serves_on(world: World) -> None:
    """The ceiling keeps one request's memory bounded: grpc refuses it before the API reads it."""
    with pytest.raises(grpc.RpcError) as exc:
        raw_call(world, LIST, padded(pb.ListReservationsRequest(tenant_id=world.tenant), LIMIT * CEILING + 1))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    served(world)


def test_a_compressed_request_is_measured_and_bounded_decompressed(world: World) -> None:
    """A gzip request of kilobytes that inflates past the limit is refused for what it inflates
    to; past the ceiling grpc stops inflating it."""
    def gzipped(size: int) -> Any:
        with grpc.insecure_channel(world.endpoint, options=[("grpc.max_send_message_length", -1)],
                                   compression=grpc.Compression.Gzip) as channel:
            payload = padded(pb.ListReservationsRequest(tenant_id=world.tenant), size)
            return channel.unary_unary(LIST)(payload, metadata=world.user.metadata, timeout=60)

    assert too_large("request", gzipped, 2 * LIMIT)["sizeBytes"] == str(2 * LIMIT)
    with pytest.raises(grpc.RpcError) as exc:
        gzipped(LIMIT * CEILING * 4)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    served(world)


# Bytes that are not the request ------------------------------------------------------------------

@pytest.mark.parametrize("method", [LIST, WATCH])
def test_bytes_claiming_a_field_of_gigabytes_are_invalid_input(world: World, method: str) -> None:
    """Field 1 (tenantId) says it is 2 GiB long, and a few bytes follow: nothing is allocated for it."""
    details = invalid("request", raw_call, world, method, b"\x0a" + _varint(2 << 30) + b"abc")
    assert "reason" not in details
    served(world)


# Unknown fields --------------------------------------------------------------------------------

def _unknown_fields(message: Message, size: int) -> bytes:
    """The message's bytes and then unknown varint fields (number 1000), at most `size` bytes."""
    head = message.SerializeToString()
    return head + b"\xc0\x3e\x01" * ((size - len(head)) // 3)


def _unknown_in_the_last_of_many(world: World, size: int) -> bytes:
    """A create whose devices are as many as fit in `size`, the last with an unknown field."""
    head = pb.CreateReservationRequest(tenant_id=world.tenant).SerializeToString()
    device = b"\x1a\x00"  # devices (field 3), an empty DeviceRequest
    last = b"\x1a\x03\xc0\x3e\x01"
    return head + device * ((size - len(head) - len(last)) // len(device)) + last


@pytest.mark.parametrize("payload, field", [
    (lambda w: _unknown_fields(pb.ListReservationsRequest(tenant_id=w.tenant), LIMIT), "#1000"),
    (lambda w: _unknown_in_the_last_of_many(w, LIMIT), "devices"),
], ids=["a-third-of-a-million-unknown-fields", "one-in-the-last-of-half-a-million-devices"])
def test_unknown_fields_within_the_size_limit_cost_the_server_little_memory(
        world: World, payload: Any, field: str) -> None:
    """The unknown-field check made a Python object of every unknown field, and walked every entry
    of a list before its count was checked: 40 MB and seconds of the event loop for a 1 MiB request."""
    raw = payload(world)
    assert len(raw) <= LIMIT
    tracemalloc.start()  # the control plane runs in this process
    try:
        invalid(field, raw_call, world, CREATE if field == "devices" else LIST, raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * LIMIT, peak
    served(world)


# Repeated fields -------------------------------------------------------------------------------

def test_half_a_million_entries_within_the_size_limit_are_invalid_input_naming_the_field(world: World) -> None:
    """Each empty string is two bytes on the wire: the count cap, not the size cap, refuses them."""
    many = pb.ListReservationsRequest(tenant_id=world.tenant, states=[""] * 500_000)
    assert many.ByteSize() <= LIMIT
    invalid("states", raw_call, world, LIST, many.SerializeToString())
    watch = epb.WatchRequest(tenant_id=world.tenant, types=[""] * 500_000)
    invalid("types", raw_call, world, WATCH, watch.SerializeToString())


# Metadata --------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [12_000, 100_000])
def test_a_huge_authorization_header_is_invalid_input_naming_the_metadata_limit(world: World, size: int) -> None:
    """grpc refused metadata over 16 KiB with a bare RESOURCE_EXHAUSTED, and between 8 and 16 KiB
    at random."""
    bearer = (("authorization", "Bearer " + "a" * size),)
    request = pb.ListReservationsRequest(tenant_id=world.tenant).SerializeToString()
    for _ in range(3):  # the same answer every time
        details = too_large("metadata", raw_call, world, LIST, request, metadata=bearer)
        assert details["limitBytes"] == str(METADATA_LIMIT)
        assert int(details["sizeBytes"]) > size


def test_a_huge_request_id_is_invalid_input_and_a_long_one_within_the_limit_is_replaced(world: World) -> None:
    request = pb.ListReservationsRequest(tenant_id=world.tenant)
    listing = reservations_pb2_grpc.ReservationsStub(world.user.channel).List
    too_large("metadata", listing, request, metadata=(*world.user.metadata, ("x-request-id", "r" * 20_000)))
    _, call = listing.with_call(request, metadata=(*world.user.metadata, ("x-request-id", "r" * 4_000)), timeout=60)
    assigned = dict(call.trailing_metadata())["x-request-id"]
    assert len(assigned) == 32 and assigned != "r" * 4_000


def test_metadata_beyond_its_ceiling_is_refused_by_grpc_and_the_server_serves_on(world: World) -> None:
    request = pb.ListReservationsRequest(tenant_id=world.tenant).SerializeToString()
    with pytest.raises(grpc.RpcError) as exc:
        raw_call(world, LIST, request, metadata=(("authorization", "B" * (METADATA_LIMIT * CEILING + 1)),))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    served(world)


def test_a_request_over_the_size_limit_is_refused_after_authentication_and_metadata_before(world: World) -> None:
    """A caller without a token learns nothing of its request (UNAUTHENTICATED, as for every other
    input check); the metadata is bounded before authentication reads it."""
    payload = padded(pb.ListReservationsRequest(tenant_id=world.tenant), LIMIT + 1)
    code, reason, _ = refused(raw_call, world, LIST, payload, metadata=())
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    too_large("metadata", raw_call, world, LIST, payload, metadata=(("x-request-id", "r" * 10_000),))


# The node gateway ------------------------------------------------------------------------------

def test_a_node_message_over_grpcs_limit_ends_only_that_session(gateway: GatewayThread, pool_id: str) -> None:
    """The node protocol keeps grpc's own limit (4 MiB): a node sending more has its session ended
    by grpc before the gateway reads it, and the gateway serves the node (and enrolment) on."""
    node = Node(gateway)
    node.enrol(join_token(gateway.conninfo, pool_id, "n1"))
    huge = node_pb2.NodeMessage(hello=node_pb2.Hello(daemon_version="v" * (5 << 20))).SerializeToString()
    assert _raw_session(node, [huge]).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with grpc.secure_channel(gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem),
                             options=[("grpc.max_send_message_length", -1)]) as channel:
        enrol = channel.unary_unary("/bettercompute.node.v1.NodeGateway/Enrol")
        with pytest.raises(grpc.RpcError) as exc:
            enrol(node_pb2.EnrolRequest(join_token="bcj_x", csr_pem=b"c" * (5 << 20)).SerializeToString(),
                  timeout=60)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    session = node.session()
    session.send(hello(version="bcd-after"))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["daemon_version"] == "bcd-after", what="hello")
    session.close()
    assert Node(gateway).enrol(join_token(gateway.conninfo, pool_id, "n2")).node_id
