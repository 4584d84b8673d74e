"""Bad input never becomes INTERNAL and never leaves a row nobody can read; drafts are bounded.

Every case here was reproduced against the running system before its fix (DESIGN.md 7a).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import structlog

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.common.status import error_info
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, invalid, make_world, refused

INT64_MAX = 2**63 - 1
DAY_MS = 86_400_000


def lists_work(world: World) -> None:
    for scope in ("mine", "all"):
        world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, scope=scope))


def stored(world: World) -> int:
    return world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,))[0][0]


# Times ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [int(7.9e15), INT64_MAX, 10**16])
def test_a_start_after_the_year_9999_is_invalid_input_and_stores_nothing(world: World, start: int) -> None:
    invalid("start", world.create, start=start)
    assert stored(world) == 0
    lists_work(world)


def test_a_start_is_at_most_a_year_ahead(world: World) -> None:
    details = invalid("start", world.create, start=world.later(24 * 366))
    assert int(details["maxMs"]) < world.later(24 * 366)
    assert world.create(start=world.later(24 * 364)).state == "placed"
    lists_work(world)


def test_duration_in_milliseconds_is_bounded_without_overflow(world: World) -> None:
    invalid("duration", world.user.res, "Create", world.create_request(duration=None, duration_ms=INT64_MAX))


def extend(world: World, rid: str, **change) -> pb.ExtendReservationResponse:
    return world.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=rid, idempotency_key=f"x-{uuid.uuid4().hex[:8]}", **change))


def test_extend_until_and_by_are_bounded_by_the_maximum_length(world: World) -> None:
    r = world.create(start=world.later(1))
    for until in (int(7.9e15), INT64_MAX, 10**16, r.during.start + 367 * DAY_MS):
        invalid("until", extend, world, r.id, until=until)
    for by in ("999999999999d", "999999999999w", "367d"):
        invalid("by", extend, world, r.id, by=by)
    invalid("by", extend, world, r.id, by="366d")  # the total would pass 366 days from the start
    assert extend(world, r.id, by="1h").extended
    lists_work(world)
    assert world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=r.id)).id == r.id


def test_timeline_from_and_to_are_bounded(world: World) -> None:
    stub = capacity_pb2_grpc.CapacityStub(world.user.channel)

    def timeline(**kw):
        return stub.Timeline(cpb.TimelineRequest(tenant_id=world.tenant, pool_id=world.pool_id, **kw),
                             metadata=world.user.metadata, timeout=30)

    for start in (INT64_MAX, 10**16, int(7.9e15), -1):
        invalid("from", timeline, **{"from": start})
    for end in (INT64_MAX, 10**16):
        invalid("to", timeline, to=end)
    assert len(timeline().buckets) == 24


# Strings ------------------------------------------------------------------------------------


def test_nul_in_any_string_is_invalid_input(world: World) -> None:
    invalid("poolId", world.create, pool_id="pool_\x00")
    invalid("idempotencyKey", world.create, key="k\x00")
    invalid("nodeSelector['rack']", world.create, node_selector={"rack": "r\x00"})
    invalid("devices[0].model", world.create, model="H100\x00")
    hooks = events_pb2_grpc.WebhooksStub(world.user.channel)
    for field, kw in (("url", {"url": "https://example.com/\x00", "secret": "s" * 32}),
                      ("secret", {"url": "https://example.com/hook", "secret": "s" * 31 + "\x00"})):
        invalid(field, hooks.Create, epb.CreateWebhookRequest(tenant_id=world.tenant, **kw),
                metadata=world.user.metadata, timeout=30)
    invalid("name", world.root.admin, "CreateTenant", apb.CreateTenantRequest(id="ok-name", name="a\x00b"))
    invalid("cedar", world.root.admin, "PutPolicy", apb.PutPolicyRequest(tenant_id=world.tenant, cedar="permit\x00"))
    assert stored(world) == 0


def test_a_trailing_newline_never_passes_an_id_pattern(world: World) -> None:
    invalid("idempotencyKey", world.create, key="k\n")
    invalid("nodeSelector['rack']", world.create, node_selector={"rack": "r7\n"})
    invalid("tenantId", world.user.res, "Get", pb.GetReservationRequest(
        tenant_id=world.tenant + "\n", reservation_id="rsv_" + "0" * 52))
    for tenant_id in ("\n", "t\n"):
        invalid("id", world.root.admin, "CreateTenant", apb.CreateTenantRequest(id=tenant_id, name="x"))
    invalid("ownerTenantId", world.root.admin, "CreatePool",
            apb.CreatePoolRequest(owner_tenant_id=world.tenant + "\n", name="p"))
    hooks = events_pb2_grpc.WebhooksStub(world.user.channel)
    invalid("webhookId", hooks.Get, epb.GetWebhookRequest(tenant_id=world.tenant, webhook_id="whk_" + "0" * 26 + "\n"),
            metadata=world.user.metadata, timeout=30)
    watch = events_pb2_grpc.EventsStub(world.user.channel).Watch
    invalid("types", lambda *a, **kw: next(watch(*a, **kw)),
            epb.WatchRequest(tenant_id=world.tenant, types=["reservation.placed\n"]), metadata=world.user.metadata, timeout=30)
    assert stored(world) == 0


# Decoding -----------------------------------------------------------------------------------


BAD_BYTES = {
    "invalid UTF-8": b"\x0a\x04\xff\xfe\xfd\xfc",  # field 1 (tenant_id), a string that is not UTF-8
    "truncated": b"\x0a\x10abc",  # field 1 says 16 bytes, 3 follow
    "bad tag": b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
}


@pytest.mark.parametrize("method", ["/bettercompute.v1.Reservations/Get", "/bettercompute.v1.Admin/CreateTenant"])
@pytest.mark.parametrize("what", sorted(BAD_BYTES))
def test_malformed_protobuf_is_invalid_input_with_error_info(world: World, method: str, what: str) -> None:
    call = world.user.channel.unary_unary(method)  # no serializers: the bytes go out as they are
    invalid("request", call, BAD_BYTES[what], metadata=world.user.metadata, timeout=30)


def test_malformed_protobuf_on_a_stream_is_invalid_input(world: World) -> None:
    call = world.user.channel.unary_stream("/bettercompute.v1.Events/Watch")
    with pytest.raises(grpc.RpcError) as exc:
        list(call(BAD_BYTES["invalid UTF-8"], metadata=world.user.metadata, timeout=30))
    info = error_info(exc.value)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info is not None and info.reason == "INVALID_INPUT" and info.metadata["field"] == "request"


# Sizes --------------------------------------------------------------------------------------


def test_map_and_list_fields_are_capped(world: World) -> None:
    for n in (65, 60_000):
        selector = {f"k{i}": "v" for i in range(n)}
        invalid("nodeSelector", world.create, node_selector=selector)
    assert world.create(node_selector={f"k{i}": "v" for i in range(3)}).state == "pending"
    invalid("labels", world.root.admin, "RegisterNode", apb.RegisterNodeRequest(
        pool_id=world.pool_id, name="many-labels", labels={f"l{i}": "v" for i in range(65)}))
    invalid("capabilities", world.root.admin, "RegisterNode", apb.RegisterNodeRequest(
        pool_id=world.pool_id, name="many-caps", capabilities=["c"] * 65))
    hooks = events_pb2_grpc.WebhooksStub(world.user.channel)
    invalid("eventTypes", hooks.Create, epb.CreateWebhookRequest(
        tenant_id=world.tenant, url="https://example.com/h", secret="s" * 32, event_types=["reservation."] * 65),
        metadata=world.user.metadata, timeout=30)
    invalid("states", world.user.res, "List", pb.ListReservationsRequest(
        tenant_id=world.tenant, states=["placed"] * 65))


def test_strings_are_capped_and_a_policy_has_its_own_cap(world: World) -> None:
    invalid("idempotencyKey", world.create, key="k" * 5000)
    invalid("name", world.root.admin, "CreateTenant", apb.CreateTenantRequest(id="long-name", name="n" * 5000))
    invalid("cedar", world.root.admin, "PutPolicy", apb.PutPolicyRequest(
        tenant_id=world.tenant, cedar="// " + "x" * 70_000 + "\npermit(principal, action, resource);"))
    long_policy = "// " + "x" * 10_000 + "\npermit(principal, action, resource);"
    assert world.root.admin("PutPolicy", apb.PutPolicyRequest(tenant_id=world.tenant, cedar=long_policy)).version


def test_an_unauthenticated_huge_tenant_id_is_never_logged_whole(world: World) -> None:
    anonymous = Client(world.endpoint, "")
    anonymous.metadata = (("x-request-id", "r" * 5000),)
    try:
        with structlog.testing.capture_logs() as logs:
            code, reason, _ = refused(anonymous.res, "Get", pb.GetReservationRequest(
                tenant_id="t" * (3 << 20), reservation_id="rsv_" + "0" * 52))
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        line = next(e for e in logs if e.get("event") == "rpc")
        assert line["tenant"] == "" and len(line["request_id"]) == 32
        assert all(len(str(v)) < 1000 for e in logs for v in e.values())
    finally:
        anonymous.close()


# Drafts -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def capped(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, max_drafts_per_identity=3)


@pytest.fixture(scope="module")
def short_lived(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, draft_retention_hours=1 / 3600, draft_sweep_seconds=0.2)


def refused_world(stack: tuple[ServerThread, Client]) -> World:
    """A world whose quota (1 GPU) refuses every create of 2 GPUs: each leaves a draft."""
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=1, quota=1)
    return w


def drafts(world: World) -> int:
    return world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s AND state = 'draft'", (world.tenant,))[0][0]


def test_live_drafts_are_capped_per_identity(capped) -> None:
    w = refused_world(capped)
    for i in range(3):
        assert refused(w.create, key=f"refused-{i}", count=2)[2].get("reason") != "draft-limit"
    code, reason, details = refused(w.create, key="one-too-many", count=2)
    assert (code, reason, details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", "draft-limit")
    assert details["limit"] == "3" and int(details["retryAfterSeconds"]) > 3600
    assert drafts(w) == 3
    # A retry of a held key is still decided (the idempotency promise), and another request with
    # that key is still a conflict.
    assert refused(w.create, key="refused-0", count=2)[2].get("reason") != "draft-limit"
    assert refused(w.create, key="refused-0", count=1, duration="2h")[1] == "CONFLICT"
    # Another identity of the tenant is not held back by this one's drafts.
    _, other = w.identity()
    assert w.create(other, count=1).state == "placed"
    lists_work(w)


def test_drafts_expire_after_the_retention_window(short_lived) -> None:
    w = refused_world(short_lived)
    for i in range(3):
        refused(w.create, key=f"refused-{i}", count=2)
    deadline = time.monotonic() + 30
    while drafts(w):
        assert time.monotonic() < deadline, "drafts were not expired"
        time.sleep(0.1)
    assert w.sql("SELECT count(*) FROM authz_projection a JOIN reservations r ON r.id = a.reservation_id"
                 " WHERE r.tenant_id = %s", (w.tenant,))[0][0] == 0
    orphans = w.sql("SELECT count(*) FROM authz_projection a"
                    " WHERE NOT EXISTS (SELECT 1 FROM reservations r WHERE r.id = a.reservation_id)")
    assert orphans[0][0] == 0
    # After the window the key is free: another request with it is a new request, not a conflict.
    assert w.create(key="refused-0", count=1).state == "placed"
    assert drafts(w) == 0
