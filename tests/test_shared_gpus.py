"""MIG and shared GPUs (issue "What a reservation can ask for"), through the real control plane:
pools whose policy.sharing.mode is mig, time-slice or mps book MIG instances or slots, never whole
GPUs; a request of a class the pool does not book is INVALID_INPUT; gpuEquivalent counts the parts
for quota and IAM; the timeline counts whole GPUs only.

Operator-registered nodes have no MIG instances, so the slot modes are exercised here and MIG end to
end through nodesim (tests/test_shared_gpus_e2e.py)."""

from __future__ import annotations

import uuid
from fractions import Fraction

import grpc
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from controlplane.common import devices
from controlplane.nodes import inventory
from tests.support import World, gpus, rpc_error
from tests.test_pki import arun


def shared_pool(world: World, mode: str, replicas: int = 0, nodes: int = 1) -> str:
    """A pool of `world`'s tenant with this sharing mode and `nodes` registered 8-GPU nodes; the
    world books there from now on."""
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name=mode, region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode=mode, replicas=replicas)))).id
    for _ in range(nodes):
        world.add_node()
    return world.pool_id


def atoms(world: World, node_id: str) -> dict[str, list[tuple]]:
    rows = world.sql("SELECT kind, device_uuid, bookable, health, profile FROM atoms WHERE node_id = %s "
                     "ORDER BY device_uuid", (node_id,))
    out: dict[str, list[tuple]] = {}
    for kind, *rest in rows:
        out.setdefault(kind, []).append(tuple(rest))
    return out


def attributes(world: World, rid: str) -> dict:
    return world.sql("SELECT attributes FROM authz_projection WHERE reservation_id = %s", (rid,))[0][0]


# -- the one function others call --------------------------------------------------------------


def test_gpu_equivalent_is_a_seventh_per_mig_instance_and_one_over_replicas_per_slot() -> None:
    mig = {"sharing": {"mode": "mig"}}
    assert devices.gpu_equivalent("gpu.mig", 7, mig) == 1
    assert devices.gpu_equivalent("gpu.mig", 3, mig) == Fraction(3, 7)
    assert devices.gpu_equivalent("gpu.slot", 1, {"sharing": {"mode": "time-slice"}}) == Fraction(1, 4)
    assert devices.gpu_equivalent("gpu.slot", 1, {"sharing": {"mode": "time-slicing"}}) == Fraction(1, 4)
    assert devices.gpu_equivalent("gpu.slot", 1, {"sharing": {"mode": "mps"}}) == Fraction(1, 10)
    assert devices.gpu_equivalent("gpu.slot", 3, {"sharing": {"mode": "mps", "replicas": 6}}) == Fraction(1, 2)
    assert devices.gpu_equivalent("gpu", 4, None) == 4
    assert devices.gpu_equivalent("gpu", 4, {"sharing": {"mode": "exclusive"}}) == 4


# -- pools ---------------------------------------------------------------------------------------


def test_time_slicing_is_read_as_time_slice_and_replicas_are_checked(world: World) -> None:
    pool = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="ts", policy=apb.PoolPolicy(
            sharing=apb.SharingPolicy(mode="time-slicing", replicas=3))))
    assert (pool.policy.sharing.mode, pool.policy.sharing.replicas) == ("time-slice", 3)
    for sharing, field in ((apb.SharingPolicy(mode="mig", replicas=2), "policy.sharing.replicas"),
                           (apb.SharingPolicy(mode="mps", replicas=65), "policy.sharing.replicas"),
                           (apb.SharingPolicy(mode="vgpu"), "policy.sharing.mode")):
        with pytest.raises(grpc.RpcError) as exc:
            world.root.admin("CreatePool", apb.CreatePoolRequest(
                owner_tenant_id=world.tenant, name="bad", policy=apb.PoolPolicy(sharing=sharing)))
        _, reason, details = rpc_error(exc)
        assert reason == "INVALID_INPUT" and details["field"] == field


# -- atoms ---------------------------------------------------------------------------------------


def test_a_time_slice_pool_books_four_slots_per_gpu_and_no_whole_gpu(world: World) -> None:
    shared_pool(world, "time-slice")
    found = atoms(world, world.nodes[-1].id)
    assert [b for _, b, _, _ in found["gpu"]] == [False] * 8
    slots = found["gpu.slot"]
    assert len(slots) == 32 and all(bookable and health == "healthy" for _, bookable, health, _ in slots)
    assert {d for d, *_ in slots} == {f"{g.uuid}:{n}" for g in gpus(world.nodes[-1].name) for n in range(4)}


def test_an_mps_pool_has_ten_slots_per_gpu_unless_replicas_says_otherwise(world: World) -> None:
    shared_pool(world, "mps")
    assert len(atoms(world, world.nodes[-1].id)["gpu.slot"]) == 80
    shared_pool(world, "mps", replicas=2)
    assert len(atoms(world, world.nodes[-1].id)["gpu.slot"]) == 16


def test_an_unhealthy_gpu_takes_its_slots_with_it(world: World) -> None:
    shared_pool(world, "time-slice")
    node = world.nodes[-1]
    uuid = gpus(node.name)[0].uuid
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node.id, device_uuid=uuid, health="unhealthy"))
    health = {d: h for d, _, h, _ in atoms(world, node.id)["gpu.slot"]}
    assert {h for d, h in health.items() if d.startswith(uuid + ":")} == {"unhealthy"}
    assert {h for d, h in health.items() if not d.startswith(uuid + ":")} == {"healthy"}
    r = world.create(device_class="gpu.slot", count=28)  # the 28 slots of the seven healthy GPUs
    assert r.state == "placed" and not any(d.startswith(uuid + ":") for d in r.allocations[0].device_ids)
    assert world.create(device_class="gpu.slot", count=1).state == "pending"


# -- requests ------------------------------------------------------------------------------------


def test_a_slot_request_books_slots_named_uuid_colon_n(world: World) -> None:
    shared_pool(world, "time-slice")
    r = world.create(device_class="gpu.slot", count=3, topology="numa")
    assert r.state == "placed" and r.request.devices[0].device_class == "gpu.slot"
    uuids = {g.uuid for g in gpus(world.nodes[-1].name)}
    ids = list(r.allocations[0].device_ids)
    assert len(set(ids)) == 3 and all(d.rsplit(":", 1)[0] in uuids and d.rsplit(":", 1)[1].isdigit() for d in ids)
    kinds = world.sql("SELECT DISTINCT a.kind FROM bookings b JOIN atoms a ON a.id = b.atom_id "
                      "JOIN allocations al ON al.id = b.allocation_id WHERE al.reservation_id = %s", (r.id,))
    assert kinds == [("gpu.slot",)]


def test_a_whole_gpu_request_in_a_shared_pool_is_refused_naming_the_class(world: World) -> None:
    pool_id = shared_pool(world, "time-slice")
    before = world.sql("SELECT count(*) FROM reservations")[0][0]
    with pytest.raises(grpc.RpcError) as exc:
        world.create(count=1)
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT")
    assert details == {"field": "devices[0].class", "poolId": pool_id, "sharingMode": "time-slice",
                       "served": "gpu.slot"}
    assert "gpu.slot" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        world.create(device_class="gpu.mig", count=1)  # slots, not MIG instances
    assert rpc_error(exc)[2]["field"] == "devices[0].class"
    assert world.sql("SELECT count(*) FROM reservations")[0][0] == before  # refused before the draft


def test_iam_sees_the_gpu_equivalent_and_no_whole_gpus(world: World) -> None:
    shared_pool(world, "mps")
    world.policy('permit(principal, action == Action::"compute:reservations:create", resource) '
                 'when { resource.gpuEquivalent.lessThanOrEqual(decimal("0.5")) && resource.gpuCount == 0 };')
    r = world.create(device_class="gpu.slot", count=5)
    assert r.state == "placed"
    seen = attributes(world, r.id)
    assert (seen["gpuEquivalent"], seen["gpuCount"], seen["deviceClass"]) == (0.5, 0, "gpu.slot")
    with pytest.raises(grpc.RpcError) as exc:
        world.create(device_class="gpu.slot", count=6)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"


def test_gpu_quota_is_charged_in_gpu_equivalents(world: World) -> None:
    shared_pool(world, "time-slice")
    world.quota(1)
    assert world.create(device_class="gpu.slot", count=3).state == "placed"
    assert world.create(device_class="gpu.slot", count=1).state == "placed"  # 3/4 + 1/4 = the whole GPU
    with pytest.raises(grpc.RpcError) as exc:
        world.create(device_class="gpu.slot", count=1)
    code, reason, details = rpc_error(exc)
    assert reason == "QUOTA_EXCEEDED"
    assert details == {"resource": "gpu", "limit": "1", "used": "1", "requested": "0.25"}
    usage = world.root.admin("GetQuotaUsage", apb.GetQuotaUsageRequest(tenant_id=world.tenant))
    line = next(x for x in usage.lines if x.resource == "gpu")
    assert (line.limit, line.used, line.used_exact) == (1, 1, 1.0)
    stored = world.sql("SELECT amount, per FROM quota_charges WHERE tenant_id = %s AND resource = 'gpu' "
                       "AND refunded_at IS NULL ORDER BY amount", (world.tenant,))
    assert stored == [(1, 4), (3, 4)]


def test_the_used_figure_rounds_up_and_shows_the_exact_fraction(world: World) -> None:
    shared_pool(world, "mps")
    world.quota(2)
    world.create(device_class="gpu.slot", count=3)
    line = next(x for x in world.root.admin("GetQuotaUsage", apb.GetQuotaUsageRequest(tenant_id=world.tenant)).lines
                if x.resource == "gpu")
    assert (line.used, line.used_exact) == (1, pytest.approx(0.3))


def test_the_timeline_counts_whole_gpus_only(world: World) -> None:
    shared_pool(world, "time-slice")
    r = world.create(device_class="gpu.slot", count=4)
    assert r.state == "placed"
    stub = capacity_pb2_grpc.CapacityStub(world.user.channel)
    timeline = stub.Timeline(cpb.TimelineRequest(tenant_id=world.tenant, pool_id=world.pool_id),
                             metadata=world.user.metadata)
    assert timeline.allocatable == 0  # no whole GPU is bookable in a shared pool
    assert {b.booked for b in timeline.buckets} == {0}  # slot bookings are not counted


# -- inventory -----------------------------------------------------------------------------------


def _mig_inventory(generation: int, layout: dict[str, list[tuple[int, str]]]) -> node_pb2.Inventory:
    return node_pb2.Inventory(generation=generation, gpus=[
        node_pb2.Gpu(uuid=uuid, model="H100-SXM5-80GB", memory_mib=81559, numa_node=0, mig_mode=bool(instances),
                     mig_instances=[node_pb2.MigInstance(index=i, profile=p) for i, p in instances])
        for uuid, instances in layout.items()])


def test_mig_instances_follow_the_inventory_and_repartitioned_ones_stop_being_bookable(world: World) -> None:
    shared_pool(world, "mig", nodes=0)
    node = world.add_node(gpus("mig-node", count=2))
    first, second = (g.uuid for g in gpus("mig-node", count=2))
    apply = lambda inv: arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, inv))  # noqa: E731
    # GPU instance ids as NVIDIA numbers them: 1-2 for 3g.40gb, 7-13 for 1g.10gb on an H100.
    apply(_mig_inventory(2, {first: [(1, "3g.40gb"), (2, "3g.40gb")], second: []}))
    assert atoms(world, node.id)["gpu.mig"] == [(f"{first}:1", True, "healthy", "3g.40gb"),
                                                (f"{first}:2", True, "healthy", "3g.40gb")]
    held = world.create(device_class="gpu.mig", count=1, profile="3g.40gb")
    assert held.state == "placed"
    # Repartitioned: seven small instances, the big ones gone (the booked one kept, not bookable, with
    # its booking; the other deleted).
    apply(_mig_inventory(3, {first: [(k, "1g.10gb") for k in range(7, 14)], second: [(0, "7g.80gb")]}))
    found = {d: (bookable, profile) for d, bookable, _, profile in atoms(world, node.id)["gpu.mig"]}
    assert found[f"{second}:0"] == (True, "7g.80gb")
    assert [found[f"{first}:{k}"] for k in range(7, 14)] == [(True, "1g.10gb")] * 7
    assert [found[f"{first}:{k}"] for k in (1, 2) if f"{first}:{k}" in found] == [(False, "3g.40gb")]
    assert world.sql("SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id "
                     "WHERE a.reservation_id = %s", (held.id,)) == [(1,)]
    assert world.create(device_class="gpu.mig", count=1, profile="3g.40gb").state == "pending"
    assert world.create(device_class="gpu.mig", count=7, profile="1g.10gb").state == "placed"
    # A GPU taken out of MIG mode gives nothing in a mig pool.
    apply(_mig_inventory(4, {first: [], second: []}))
    assert {b for _, b, _, _ in atoms(world, node.id)["gpu.mig"]} == {False}
    assert {b for _, b, _, _ in atoms(world, node.id)["gpu"]} == {False}


# -- exact quota arithmetic ------------------------------------------------------------------------

_CHARGE = "SELECT charged FROM charge_quota(%s, %s, %s, %s, %s)"


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])  # a resource per example
@given(limit=st.integers(0, 3), parts=st.lists(st.tuples(st.integers(1, 9), st.sampled_from([1, 3, 4, 7, 10])),
                                                max_size=12))
def test_charges_are_decided_on_exact_fractions(world: World, limit: int, parts: list[tuple[int, int]]) -> None:
    """charge_quota admits a charge exactly when the exact sum of the live charges and it stays
    within the limit, whatever the denominators (a float or rounded sum would drift)."""
    resource = f"gpu:p{uuid.uuid4().hex[:12]}"  # a limit row of its own, so examples never meet
    world.quota(limit, resource)
    rids = [r for (r,) in world.sql("SELECT id FROM reservations WHERE tenant_id = %s", (world.tenant,))]
    for _ in range(len(parts) - len(rids)):
        rids.append(world.create(count=1, start=world.later()).id)
    used = Fraction(0)
    with psycopg.connect(world.conninfo, autocommit=True) as conn:
        for (amount, per), rid in zip(parts, rids, strict=False):
            charged = conn.execute(_CHARGE, (world.tenant, resource, rid, amount, per)).fetchone()[0]
            assert charged == (used + Fraction(amount, per) <= limit), (used, amount, per, limit)
            if charged:
                used += Fraction(amount, per)


def test_an_exclusive_pool_does_not_book_a_gpu_in_mig_mode_whole(world: World) -> None:
    node = world.add_node(gpus("excl-node", count=2))
    first, second = (g.uuid for g in gpus("excl-node", count=2))
    apply = lambda inv: arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, inv))  # noqa: E731
    apply(_mig_inventory(2, {first: [(7, "1g.10gb")], second: []}))
    assert dict((d, b) for d, b, _, _ in atoms(world, node.id)["gpu"]) == {first: False, second: True}
    assert "gpu.mig" not in atoms(world, node.id)
    apply(_mig_inventory(3, {first: [], second: []}))  # out of MIG mode: whole again
    assert {b for _, b, _, _ in atoms(world, node.id)["gpu"]} == {True}
