"""capacity.preview and the pool's rollup (issue 11): a preview books nothing and answers where a
create would place, or why nothing fits filter by filter; decided as compute:capacity:read; the
rollup counts allocatable, in use, reserved and free GPUs, and shows an offered pool's other
tenants only in aggregate."""

from __future__ import annotations

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import PERMISSIVE, Client, World, gpus, offered_guest, rpc_error


def preview(world: World, client: Client | None = None, **kw) -> cpb.PreviewResponse:
    client = client or world.user
    req = world.create_request(**kw)
    return capacity_pb2_grpc.CapacityStub(client.channel).Preview(req, metadata=client.metadata, timeout=30)


def rollup(world: World, client: Client | None = None, tenant: str | None = None,
           pool_id: str | None = None) -> cpb.RollupResponse:
    client = client or world.user
    return capacity_pb2_grpc.CapacityStub(client.channel).Rollup(
        cpb.RollupRequest(tenant_id=tenant or world.tenant, pool_id=pool_id or world.pool_id),
        metadata=client.metadata, timeout=30)


def bookings(world: World) -> int:
    return world.sql("SELECT count(*) FROM bookings b JOIN atoms a ON a.id = b.atom_id "
                     "JOIN nodes n ON n.id = a.node_id WHERE n.pool_id = %s", (world.pool_id,))[0][0]


def test_preview_books_nothing_and_answers_where_create_places(world: World) -> None:
    world.create(count=8)  # one node full: only the other can take the request
    before = bookings(world)
    out = preview(world, count=2)
    assert out.fits and len(out.members) == 1 and len(out.members[0].atom_ids) == 2
    assert len(out.members[0].device_ids) == 2 and out.members[0].node_name
    assert out.end - out.start == 3_600_000 and not out.reason
    assert bookings(world) == before  # nothing booked, no reservation written
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,))[0][0] == 1
    placed = world.create(count=2)
    assert placed.state == "placed"
    node = world.sql("SELECT node_id FROM allocations WHERE reservation_id = %s", (placed.id,))[0][0]
    assert node == out.members[0].node_id  # the only node that fits


def test_preview_says_why_nothing_fits_filter_by_filter(world: World) -> None:
    out = preview(world, count=4, node_selector={"zone": "a"})
    assert not out.fits and not out.members
    assert "no node has 4 free healthy GPUs" in out.reason
    assert [(f.filter, f.nodes, f.reason) for f in out.filters] == [("labels", 2, "needs label zone=a")]
    # Host resources need the devices.limits capability: the spec's words, each node counted.
    out = preview(world, count=1, resources=pb.HostResources(vcpu=4))
    assert not out.fits and out.resources.vcpu == 4
    assert [(f.nodes, f.reason) for f in out.filters] == [(2, "needs label bc.dev/cap.devices.limits=*")]
    world.create(count=8)
    world.create(count=2)
    out = preview(world, count=8, topology="nvlink-all")
    assert not out.fits and [(f.filter, f.nodes) for f in out.filters] == [("free", 2)]
    assert out.filters[0].reason == "has fewer than 8 healthy GPUs in one NVLink domain free for the window"


def test_preview_of_a_gang_answers_its_members(world: World) -> None:
    out = preview(world, count=8, gang=pb.Gang(size=2))
    assert out.fits and sorted(m.node_id for m in out.members) == sorted(n.id for n in world.nodes)
    out = preview(world, count=8, gang=pb.Gang(size=3))
    assert not out.fits and out.reason == "no gang of 3 nodes fits in the pool (at most 2 nodes fit together)"
    out = preview(world, count=8, gang=pb.Gang(size=2, topology_key="fabric.domain"))
    assert not out.fits and [(f.nodes, f.reason) for f in out.filters] == [(2, "needs label fabric.domain=*")]


def test_preview_is_decided_as_capacity_read_and_validated_as_create(world: World) -> None:
    world.policy(PERMISSIVE + '\nforbid(principal, action == Action::"compute:capacity:read", resource);')
    with pytest.raises(grpc.RpcError) as exc:
        preview(world)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    with pytest.raises(grpc.RpcError) as exc:
        rollup(world)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    world.policy(PERMISSIVE)
    with pytest.raises(grpc.RpcError) as exc:
        preview(world, count=65)
    assert rpc_error(exc)[1] == "INVALID_INPUT" and rpc_error(exc)[2]["field"] == "devices[0].count"
    foreign = world.root.admin("CreatePool", apb.CreatePoolRequest(owner_tenant_id="root", name="private"))
    with pytest.raises(grpc.RpcError) as exc:
        preview(world, pool_id=foreign.id)
    assert rpc_error(exc)[1] == "NOT_FOUND"


def test_rollup_counts_in_use_reserved_and_free(world: World) -> None:
    world.add_node(gpus("other", 4, model="A100-80GB"))
    h100 = "H100-SXM5-80GB"
    world.create(count=3, model=h100)
    world.create(count=2, start=world.later(2), model=h100)
    world.create(count=1, model="A100-80GB")
    out = rollup(world)
    assert (out.total.allocatable, out.total.in_use, out.total.reserved, out.total.free) == (20, 4, 2, 16)
    per = {m.model: (m.counts.allocatable, m.counts.in_use, m.counts.reserved, m.counts.free) for m in out.models}
    assert per == {"A100-80GB": (4, 1, 0, 3), "H100-SXM5-80GB": (16, 3, 2, 13)}
    assert (out.own_in_use, out.own_reserved, out.others_in_use, out.others_reserved) == (4, 2, 0, 0)
    assert [(t.tenant_id, t.in_use, t.reserved) for t in out.tenants] == [(world.tenant, 4, 2)]


def test_an_offered_pool_shows_other_tenants_only_in_aggregate(world: World) -> None:
    guest = offered_guest(world)
    try:
        world.create(count=3)
        guest.create(count=1)
        out = rollup(guest)
        assert (out.own_in_use, out.others_in_use, out.total.in_use) == (1, 3, 4)
        assert list(out.tenants) == []  # no other tenant's id
        assert world.tenant not in str(out)
        owner = rollup(world)
        assert sorted((t.tenant_id, t.in_use) for t in owner.tenants) == sorted([(world.tenant, 3), (guest.tenant, 1)])
    finally:
        guest.close()
