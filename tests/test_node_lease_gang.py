"""A gang of whole machines (spec 004: "a `binding: 'node'` lease can be a gang of whole machines"),
end to end through the real control plane, gateway and nodesim: `size` machines sharing one
`fabric.domain`, charged and decided as the whole gang, deployed on every member, active only once
every machine is deployed, failed all together when one member's deploy fails, released all
together, and repaired member by member before its window.
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World, clock_now
from tests.test_e2e import Fleet, Stack, eventually, stack  # noqa: F401 (fixtures)
from tests.test_node_binding import (  # noqa: F401 (fixtures)
    FAST, clock_stack, disk, events_of, fleets, lease, metal_world, node_state, quota_used, until, world,
)
from tests.test_node_profiles import register

FABRIC = "fabric.domain"


def gang_lease(world: World, profile_id: str, size: int, key: str = FABRIC, **kw) -> pb.Reservation:
    return lease(world, profile_id, gang=pb.Gang(size=size, topology_key=key), **kw)


def fabric_of(world: World, node_id: str) -> str:
    return world.sql("SELECT labels->%s->>'value' FROM nodes WHERE id = %s", (FABRIC, node_id))[0][0]


def release(world: World, rid: str) -> None:
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def test_a_gang_of_machines_takes_one_fabric_deploys_every_member_and_releases_them_all(
        stack: Stack, world: World, fleets) -> None:  # noqa: F811
    profile_id = register(world.root, 1)
    fleet = fleets(4, *FAST, "--fabric-size", "2")  # two fabrics of two machines
    r = gang_lease(world, profile_id, 2)
    assert r.state == "placed" and len(r.allocations) == 2
    nodes = [a.node_id for a in r.allocations]
    assert len(set(nodes)) == 2 and len({fabric_of(world, n) for n in nodes}) == 1  # one fabric
    for alloc in r.allocations:  # each member is a whole machine: every bookable atom of it
        booked = world.sql("SELECT count(*) FROM bookings WHERE allocation_id = %s", (alloc.id,))[0][0]
        assert booked == 8 == len(alloc.device_ids)
    assert quota_used(world) == 16  # size times the per-node devices
    attributes = world.sql("SELECT attributes FROM authz_projection WHERE reservation_id = %s", (r.id,))[0][0]
    assert (attributes["gangSize"], attributes["gpuCount"], attributes["binding"]) == (2, 16, "node")
    [placed] = events_of(world, r.id, "reservation.placed")
    assert sorted(placed["nodeIds"]) == sorted(nodes)

    # Active only once every machine is deployed; every member is leased to the tenant.
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert [a.state for a in active.allocations] == ["bound", "bound"]
    assert all(node_state(world, n) == "leased" for n in nodes)
    assert {(disk(fleet, a.node_id) or {}).get("allocation_id") for a in active.allocations} == \
        {a.id for a in active.allocations}

    # The other fabric takes a second gang; a third finds no fabric with two machines free.
    second = gang_lease(world, profile_id, 2)
    assert second.state == "placed" and not {a.node_id for a in second.allocations} & set(nodes)
    third = gang_lease(world, profile_id, 2)
    assert third.state == "pending"
    assert third.conditions[0].message.startswith("no gang of 2 nodes fits in one fabric.domain")

    # Release ends every member: both machines wipe and come back; the quota is refunded.
    release(world, r.id)
    for node_id in nodes:
        until(lambda: (disk(fleet, node_id) or {}).get("state") == "wiped")
        until(lambda: node_state(world, node_id) == "ready")
    release(world, second.id)
    release(world, third.id)
    assert quota_used(world) == 0


def test_a_gang_larger_than_any_fabric_is_pending_with_the_reason_and_a_keyless_gang_takes_any_machines(
        world: World, fleets) -> None:
    profile_id = register(world.root, 1)
    fleets(3, *FAST, "--fabric-size", "2")  # fabrics of two and one
    too_big = gang_lease(world, profile_id, 3)
    assert too_big.state == "pending" and not too_big.allocations
    message = too_big.conditions[0].message
    assert message.startswith("no gang of 3 nodes fits in one fabric.domain (at most 2 nodes fit together)")
    assert "3 nodes in the pool" in message
    assert quota_used(world) == 24  # a pending reservation keeps its charge
    world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=too_big.id))

    anywhere = gang_lease(world, profile_id, 3, key="")  # without a key any machines of the pool form it
    assert anywhere.state == "placed" and len({a.node_id for a in anywhere.allocations}) == 3
    eventually(world, anywhere.id, lambda x: x.state == "active")
    release(world, anywhere.id)


def test_one_members_failed_deploy_fails_the_whole_gang_and_frees_every_machine_at_once(
        stack: Stack, world: World) -> None:  # noqa: F811
    """One machine's reimage fails; the other never acts on its deploy (so no report of its own
    would wake the worker for it). The gang fails as a whole, and the other machine is not held
    leased until its two-hour deploy deadline: it is back at once (it never ran the tenant's deploy,
    so there is nothing to wipe)."""
    profile_id = register(world.root, 1)
    failing, deaf = Fleet(stack, world, 1), Fleet(stack, world, 1)
    failing.start(*FAST, "--reimage-fail-rate", "1")
    deaf.start(*FAST, "--never-answer")
    try:
        until(lambda: len([n for n in world.root.admin("ListNodes", apb.ListNodesRequest(pool_id=world.pool_id)).items
                           if n.connectivity == "connected" and n.gpu_count == 8]) == 2)
        r = gang_lease(world, profile_id, 2, key="")
        assert r.state == "placed" and len(r.allocations) == 2, r.conditions
        failed = eventually(world, r.id, lambda x: x.state == "failed")
        assert sorted(a.state for a in failed.allocations) == ["failed", "failed"]  # no second placement
        assert events_of(world, r.id, "reservation.failed")[0]["reason"].startswith("deploy-failed")
        assert quota_used(world) == 0
        deploys = until(lambda: [s for (s,) in world.sql(
            "SELECT state FROM metal_deploys WHERE reservation_id = %s", (r.id,)) if s != "deploying"])
        assert len(deploys) == 2 and "failed" in deploys
        for alloc in failed.allocations:
            until(lambda: node_state(world, alloc.node_id) == "ready")
    finally:
        failing.stop()
        deaf.stop()


def test_capacity_preview_answers_the_machines_of_a_node_lease_gang(world: World, fleets) -> None:
    profile_id = register(world.root, 1)
    fleets(3, *FAST, "--fabric-size", "2")

    def preview(size: int) -> cpb.PreviewResponse:
        req = world.create_request(count=8, binding="node", node=pb.NodeLease(profile_id=profile_id), duration="8h",
                                   gang=pb.Gang(size=size, topology_key=FABRIC))
        return capacity_pb2_grpc.CapacityStub(world.user.channel).Preview(req, metadata=world.user.metadata, timeout=30)

    fits = preview(2)
    assert fits.fits and len(fits.members) == 2 and fits.group
    assert {fabric_of(world, m.node_id) for m in fits.members} == {fits.group}
    assert all(len(m.device_ids) == 8 for m in fits.members)
    none = preview(3)
    assert not none.fits and none.reason.startswith("no gang of 3 nodes fits in one fabric.domain")
    # A preview books nothing: the create that follows takes the same fabric's machines.
    r = gang_lease(world, profile_id, 2)
    assert {fabric_of(world, a.node_id) for a in r.allocations} == {fits.group}
    release(world, r.id)


def test_booking_repair_replaces_only_the_bad_member_of_a_machine_gang_in_its_fabric(clock_stack: Stack) -> None:  # noqa: F811
    w = metal_world(clock_stack)
    fleet = Fleet(clock_stack, w, 3)
    fleet.start(*FAST, "--fabric-size", "3")  # one fabric of three machines
    try:
        profile_id = register(w.root, 1, profile_id=f"gang-{uuid.uuid4().hex[:6]}")
        start = w.later(hours=1)
        r = gang_lease(w, profile_id, 2, start=start)
        assert r.state == "placed"
        bad, kept = r.allocations[0].node_id, r.allocations[1].node_id
        w.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=bad, state="cordoned"))
        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=start - clock_now(w) - 10 * 60_000))
        [repaired] = until(lambda: events_of(w, r.id, "reservation.repaired"))
        assert repaired["from"] == [bad] and len(repaired["nodeIds"]) == 1
        new = repaired["nodeIds"][0]
        assert new not in (bad, kept)
        moved = eventually(w, r.id, lambda x: x.state == "placed")
        live = sorted(a.node_id for a in moved.allocations if a.state == "placed")
        assert live == sorted([kept, new])  # the good member kept its machine
        assert (moved.during.start, moved.during.end) == (r.during.start, r.during.end)

        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=start - clock_now(w) + 1))
        eventually(w, r.id, lambda x: x.state == "active")
        assert node_state(w, new) == "leased" and node_state(w, kept) == "leased" and node_state(w, bad) == "cordoned"
        release(w, r.id)
    finally:
        fleet.stop()
        w.close()


@pytest.mark.parametrize("size", [1, 65])
def test_a_node_lease_gang_size_out_of_range_is_invalid_input(world: World, size: int) -> None:
    profile_id = register(world.root, 1)
    with pytest.raises(grpc.RpcError) as refused:
        gang_lease(world, profile_id, size)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gang.size" in refused.value.details()
