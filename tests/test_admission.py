"""Drafts and idempotency, validation, unknown fields: the spec's admission promises."""

from __future__ import annotations

import grpc
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from controlplane.ids import draft_id
from tests.support import PERMISSIVE, World, rpc_error

DENY_ALL = "forbid(principal, action, resource);"


def decided_at(world: World, rid: str):
    return world.sql("SELECT decided_at FROM authz_projection WHERE reservation_id = %s", (rid,))[0][0]


def test_draft_id_is_deterministic_from_tenant_identity_and_key(world: World) -> None:
    r = world.create(key="train-2026-09-24", count=4, topology="nvlink-all", duration="8h")
    assert r.id == draft_id(world.tenant, world.user_id, "train-2026-09-24")
    assert r.state == "placed"
    assert r.owner_identity_id == world.user_id and r.idempotency_key == "train-2026-09-24"
    assert r.request.duration == "28800000ms" and r.request.binding == "hold"
    assert r.during.end - r.during.start == 8 * 3600 * 1000
    assert r.operation.state == "succeeded" and r.operation.id == r.id


def test_same_key_from_another_identity_gets_its_own_row(world: World) -> None:
    other_id, other = world.identity()
    mine = world.create(key="shared-key")
    theirs = world.create(other, key="shared-key")
    assert mine.id != theirs.id
    assert theirs.owner_identity_id == other_id
    assert world.sql("SELECT count(*) FROM reservations WHERE idempotency_key = 'shared-key'")[0][0] == 2


def test_2h_and_7200000_are_the_same_request_with_or_without_binding_hold(world: World) -> None:
    first = world.create(key="same", duration="2h")
    again = world.user.res("Create", world.create_request(key="same", duration=None, duration_ms=7_200_000,
                                                          binding="hold"))
    assert again.id == first.id and again.created_at == first.created_at
    as_text = world.user.res("Create", world.create_request(key="same", duration="7200000"))
    assert as_text.id == first.id


def test_repeat_past_the_draft_returns_the_stored_reservation_without_a_second_decision(world: World) -> None:
    first = world.create(key="once")
    decided = decided_at(world, first.id)
    world.policy(DENY_ALL)  # a second decision would now refuse
    again = world.create(key="once")
    # The stored reservation (the reconciler may have moved it on to binding at its start).
    assert again.id == first.id and again.state in ("placed", "binding") and again.version >= first.version
    assert decided_at(world, first.id) == decided
    world.policy(PERMISSIVE)


def test_repeat_on_a_draft_after_quota_exceeded_decides_again(world: World) -> None:
    world.quota(2)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(key="big", count=4)
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
    assert details["resource"] == "gpu" and details["limit"] == "2" and details["requested"] == "4"
    rid = draft_id(world.tenant, world.user_id, "big")
    assert world.sql("SELECT state FROM reservations WHERE id = %s", (rid,)) == [("draft",)]
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s", (rid,))[0][0] == 0
    world.quota(8)
    placed = world.create(key="big", count=4)
    assert placed.id == rid and placed.state == "placed"
    assert decided_at(world, rid) is not None


def test_the_draft_is_decided_again_so_a_policy_change_applies(world: World) -> None:
    world.quota(0)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(key="redecide", count=1)
    assert rpc_error(exc)[1] == "QUOTA_EXCEEDED"
    world.quota(8)
    world.policy(DENY_ALL)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(key="redecide", count=1)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    world.policy(PERMISSIVE)


def test_same_key_with_another_request_is_conflict_with_the_reservation_id(world: World) -> None:
    first = world.create(key="k1", count=1)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(key="k1", count=2)
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.ABORTED, "CONFLICT")
    assert details["reservationId"] == first.id


def test_a_refused_key_stays_access_denied(world: World) -> None:
    world.policy("permit(principal, action, resource) when { resource has gpuCount && resource.gpuCount <= 2 };"
                 "permit(principal, action == Action::\"compute:reservations:list\", resource);")
    with pytest.raises(grpc.RpcError) as exc:
        world.create(key="greedy", count=4)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    world.policy(PERMISSIVE)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(key="greedy", count=4)
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    assert details["reservationId"] == draft_id(world.tenant, world.user_id, "greedy")
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s",
                     (details["reservationId"],))[0][0] == 0


def test_cedar_policy_caps_gpus_and_hours_on_the_reservation_itself(world: World) -> None:
    world.policy('permit(principal, action == Action::"compute:reservations:create", resource)'
                 " when { resource.gpuCount <= 2 && resource.durationHours <= 72 && resource.region == \"eu-1\" };")
    assert world.create(count=2, duration="72h").state == "placed"
    for kwargs in ({"count": 4}, {"count": 1, "duration": "73h"}):
        with pytest.raises(grpc.RpcError) as exc:
            world.create(**kwargs)
        assert rpc_error(exc)[1] == "ACCESS_DENIED"
    world.policy(PERMISSIVE)


def test_drafts_are_not_found_and_not_listed(world: World) -> None:
    world.quota(0)
    with pytest.raises(grpc.RpcError):
        world.create(key="draft-only")
    rid = draft_id(world.tenant, world.user_id, "draft-only")
    with pytest.raises(grpc.RpcError) as exc:
        world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=rid))
    assert rpc_error(exc)[1] == "NOT_FOUND"
    listed = world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, scope="all"))
    assert rid not in [r.id for r in listed.items]


@pytest.mark.parametrize(
    "change, field, reason",
    [
        ({"count": 0}, "devices[0].count", "INVALID_INPUT"),
        ({"count": 65}, "devices[0].count", "INVALID_INPUT"),
        ({"topology": "ring"}, "devices[0].topology", "INVALID_INPUT"),
        ({"device_class": "tpu"}, "devices[0].class", "INVALID_INPUT"),
        ({"device_class": "gpu.mig"}, "devices[0].class", "INVALID_INPUT"),  # the pool is exclusive
        ({"profile": "1g.10gb"}, "devices[0].profile", "INVALID_INPUT"),  # whole GPUs have no profile
        ({"device_class": "gpu.slot", "binding": "kubernetes"}, "binding", "INVALID_INPUT"),  # no policy.kubernetes
        ({"duration": "8 hours"}, "duration", "INVALID_INPUT"),
        ({"duration": "0h"}, "duration", "INVALID_INPUT"),
        ({"duration": None}, "duration", "INVALID_INPUT"),
        ({"binding": "instance"}, "binding", "UNSUPPORTED"),
        ({"binding": "sideways"}, "binding", "INVALID_INPUT"),
        ({"key": "has space"}, "idempotencyKey", "INVALID_INPUT"),
        ({"pool_id": "pool_NOPE"}, "poolId", "INVALID_INPUT"),
        ({"lease_seconds": 5}, "leaseSeconds", "INVALID_INPUT"),
        ({"wait": pb.Wait(timeout_ms=-1)}, "wait.timeoutMs", "INVALID_INPUT"),
    ],
)
def test_bad_input_is_refused_naming_the_field(world: World, change: dict, field: str, reason: str) -> None:
    before = world.sql("SELECT count(*) FROM reservations")[0][0]
    with pytest.raises(grpc.RpcError) as exc:
        world.user.res("Create", world.create_request(**change))
    code, got, details = rpc_error(exc)
    assert got == reason and details["field"] == field
    assert code == (grpc.StatusCode.INVALID_ARGUMENT if reason == "INVALID_INPUT" else grpc.StatusCode.UNIMPLEMENTED)
    assert world.sql("SELECT count(*) FROM reservations")[0][0] == before  # nothing half-written


def test_a_pool_that_is_not_offered_is_not_found(world: World) -> None:
    from bettercompute.v1 import admin_pb2 as apb

    foreign = world.root.admin("CreatePool", apb.CreatePoolRequest(owner_tenant_id="root", name="private"))
    with pytest.raises(grpc.RpcError) as exc:
        world.create(pool_id=foreign.id)
    assert rpc_error(exc)[1] == "NOT_FOUND"
    world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=foreign.id, tenant_id=world.tenant))
    world.root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=foreign.id, name="offered-0",
                                                             gpus=[apb.Gpu(uuid="GPU-offered-0", model="A100")]))
    assert world.create(pool_id=foreign.id).state == "placed"


def _with_unknown_field(message: bytes, number: int = 99) -> bytes:
    tag = (number << 3) | 0  # varint wire type
    return message + bytes([tag & 0x7F | 0x80, tag >> 7]) + b"\x01"


def _raw_create(world: World, payload: bytes) -> bytes:
    call = world.user.channel.unary_unary("/bettercompute.v1.Reservations/Create")
    return call(payload, metadata=world.user.metadata, timeout=30)


def test_unknown_top_level_field_is_invalid_input(world: World) -> None:
    payload = _with_unknown_field(world.create_request(key="unknown").SerializeToString())
    with pytest.raises(grpc.RpcError) as exc:
        _raw_create(world, payload)
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "#99")


def test_unknown_nested_field_is_invalid_input_naming_its_path(world: World) -> None:
    req = world.create_request(key="unknown-nested")
    device = _with_unknown_field(req.devices[0].SerializeToString(), 42)
    del req.devices[:]
    # devices is field 3, length-delimited
    payload = req.SerializeToString() + bytes([(3 << 3) | 2, len(device)]) + device
    with pytest.raises(grpc.RpcError) as exc:
        _raw_create(world, payload)
    assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": "devices[0]#42"})
