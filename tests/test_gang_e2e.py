"""A gang end to end through real processes (control plane, gateway, nodesim): the fleet's NVLink
fabric gives each node its `fabric.domain` label, a gang takes one fabric, stays binding until
every member node has bound its devices, goes active, and a release frees every member's files."""

from __future__ import annotations

import time

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World
from tests.test_e2e import eventually, fleet_factory, stack, world  # noqa: F401 - the module's fixtures

FABRIC = "fabric.domain"


def files_of(fleet, alloc: pb.Allocation) -> list:
    node_dir = fleet.node_dir(alloc.node_id)
    return [node_dir / "etc" / "cdi" / f"bcd-{alloc.id}.json",
            node_dir / "run" / "bcd" / "allocations" / f"{alloc.id}.env"]


def test_a_gang_goes_active_only_once_every_member_bound_and_release_frees_every_member(
    world: World, fleet_factory  # noqa: F811
) -> None:
    # Two nodes sharing one fabric; the second never answers at first.
    fleet = fleet_factory(2, "--fabric-size", "2")
    late = fleet.names[1]
    nodes = world.root.admin("ListNodes", apb.ListNodesRequest(pool_id=world.pool_id)).items
    assert len({n.labels[FABRIC] for n in nodes}) == 1  # the inventory's label, shared
    fleet.stop()
    fleet.start("--fabric-size", "2", "--fault-nodes", late, "--never-answer")

    r = world.create(count=8, gang=pb.Gang(size=2, topology_key=FABRIC), duration="2h")
    assert r.state == "placed" and len(r.allocations) == 2
    late_id = next(n.id for n in nodes if n.name == late)
    early = next(a for a in r.allocations if a.node_id != late_id)
    # A positive signal first: the answering member bound. The gang is still binding.
    half = eventually(world, r.id, lambda x: any(a.state == "bound" for a in x.allocations))
    assert half.state == "binding"
    assert [a.id for a in half.allocations if a.state == "bound"] == [early.id]
    assert all(p.exists() for p in files_of(fleet, early))

    fleet.stop()
    fleet.start("--fabric-size", "2")  # the late node now answers
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert all(a.state == "bound" for a in active.allocations) and len(active.allocations) == 2
    first = min(active.allocations, key=lambda a: a.id)
    assert active.binding.node_id == first.node_id and active.binding.attested
    paths = [p for a in active.allocations for p in files_of(fleet, a)]
    assert all(p.exists() for p in paths)

    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    deadline = time.monotonic() + 30
    while any(p.exists() for p in paths):
        assert time.monotonic() < deadline, [p for p in paths if p.exists()]
        time.sleep(0.1)
