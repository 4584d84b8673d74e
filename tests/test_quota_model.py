"""Quota per model (DESIGN.md section 15): a `gpu:<model>` row limits that model in addition to
`gpu`; a refusal names the resource in details. The model a request charges is its own, else the
pool's single model; in a pool of several models a request without a model is refused when the
tenant limits any of them (it could land on any). Without a model row the model is not limited,
but its charge is recorded, so a limit set later counts what is already held."""

from __future__ import annotations

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World, eventually, get, gpus, rpc_error

H100 = "H100-SXM5-80GB"
A100 = "A100-SXM4-80GB"


def refused(world: World, **kw) -> dict[str, str]:
    with pytest.raises(grpc.RpcError) as exc:
        world.create(**kw)
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED"), exc.value.details()
    return details


def live_charges(world: World) -> dict[str, int]:
    return dict(world.sql("SELECT resource, sum(amount)::int FROM quota_charges WHERE tenant_id = %s "
                          "AND refunded_at IS NULL GROUP BY resource", (world.tenant,)))


def test_a_model_quota_of_zero_refuses_that_model_naming_the_resource(world: World) -> None:
    world.quota(0, f"gpu:{H100}")
    details = refused(world, model=H100, count=1)
    assert details == {"resource": f"gpu:{H100}", "limit": "0", "used": "0", "requested": "1"}
    assert world.sql("SELECT state FROM reservations WHERE tenant_id = %s", (world.tenant,)) == [("draft",)]
    assert live_charges(world) == {}  # all or nothing: the gpu charge went with it


def test_a_request_without_a_model_charges_the_pools_single_model(world: World) -> None:
    world.quota(0, f"gpu:{H100}")
    assert refused(world, count=1)["resource"] == f"gpu:{H100}"


def test_the_model_quota_is_a_limit_beside_gpu(world: World) -> None:
    world.quota(2, f"gpu:{H100}")
    first = world.create(model=H100, count=2)
    assert first.state == "placed"
    assert live_charges(world) == {"gpu": 2, f"gpu:{H100}": 2}
    assert refused(world, model=H100, count=1) == {"resource": f"gpu:{H100}", "limit": "2", "used": "2",
                                                   "requested": "1"}
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=first.id))
    assert world.create(model=H100, count=2).state == "placed"  # the release refunded the model too


def test_the_gpu_row_still_limits_whatever_the_model_row_allows(world: World) -> None:
    world.quota(1)
    world.quota(8, f"gpu:{H100}")
    assert refused(world, model=H100, count=2)["resource"] == "gpu"


def test_without_a_model_row_the_model_is_not_limited_and_its_use_is_counted(world: World) -> None:
    assert world.create(count=3).state == "placed"
    assert live_charges(world) == {"gpu": 3, f"gpu:{H100}": 3}
    usage = world.root.admin("GetQuotaUsage", apb.GetQuotaUsageRequest(tenant_id=world.tenant))
    assert [line.resource for line in usage.lines] == ["gpu"]  # an unlimited model is no quota line
    world.quota(4, f"gpu:{H100}")  # set while three are held: they count
    assert refused(world, count=2) == {"resource": f"gpu:{H100}", "limit": "4", "used": "3", "requested": "2"}
    usage = world.root.admin("GetQuotaUsage", apb.GetQuotaUsageRequest(tenant_id=world.tenant))
    assert {(line.resource, line.limit, line.used) for line in usage.lines} == {("gpu", 64, 3), (f"gpu:{H100}", 4, 3)}


def test_another_models_row_does_not_limit_this_model(world: World) -> None:
    world.quota(0, f"gpu:{A100}")
    assert world.create(model=H100, count=1).state == "placed"
    assert world.create(count=1).state == "placed"  # the pool has H100s only


def test_a_request_without_a_model_in_a_pool_of_several_models(world: World, stack) -> None:
    world.add_node(gpus("mixed-a100", model=A100), name="mixed-a100")
    # The pool's models are the capacity index's view, which hears of the new node a moment after
    # RegisterNode answers; until then a create is charged (and placed) as the H100 pool it knew.
    if stack[0].app.runtime.capacity is not None:  # the SQL path (test_shared_gpus_sql_path) reads them
        stack[0].call(stack[0].app.runtime.capacity.barrier())
    assert world.create(count=1).state == "placed"  # no model row: any model
    world.quota(100, f"gpu:{A100}")
    details = refused(world, count=1)
    assert details == {"resource": f"gpu:{A100}", "limit": "100", "reason": "model-required",
                       "field": "devices[0].model"}
    placed = world.create(count=1, model=A100)
    assert placed.state == "placed" and live_charges(world)[f"gpu:{A100}"] == 1
    assert world.create(count=1, model=H100).state == "placed"


def test_a_request_charged_as_the_pools_single_model_books_only_that_model(world: World) -> None:
    """Charged as the pool's one model (and decided by IAM as that deviceModel), a request without a
    model is stored with it: once the pool gains another model, its pending retry does not take
    the new GPUs, which its tenant's model quota and policy were never asked about."""
    start = world.later()
    for _ in range(2):  # the pool's two H100 nodes, full for the window
        assert world.create(count=8, start=start, duration="2h").state == "placed"
    waiting = world.create(count=8, start=start, duration="2h")
    assert waiting.state == "pending" and waiting.request.devices[0].model == H100
    world.quota(8, f"gpu:{A100}")
    control = world.create(count=8, start=start, duration="2h", model=A100)  # younger: retried after it
    assert control.state == "pending"
    world.add_node(gpus("late-a100", model=A100), name="late-a100")  # new inventory wakes the pool
    eventually(world, control.id, lambda r: r.state == "placed", seconds=20)
    assert get(world, waiting.id).state == "pending"
    assert live_charges(world) == {"gpu": 32, f"gpu:{H100}": 24, f"gpu:{A100}": 8}
