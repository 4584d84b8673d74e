"""A hostile tenant against shared GPUs, host resources and the kubernetes and node bindings,
through the real API (real servers on loopback, real TLS; a real gateway session where a node must
say something): one physical GPU is never sold twice, no node's host resources are overbooked at
any instant, and bad input is INVALID_INPUT naming its field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bettercompute.node.v1 import node_pb2 as npb
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.invariants import check_invariants, snapshot
from tests.nodes_support import ControlPlane
from tests.support import World, invalid, make_world, rpc_error
from tests.test_gateway import connected, cp, eventually, gateway, hello, node_row  # noqa: F401 (fixtures)
from tests.test_host_resources import host_world, peak_over_capacity, resources
from tests.test_node_profiles import register
from tests.test_shared_gpus import shared_pool

HOUR = 3_600_000


def storm(world: World, requests: list[pb.CreateReservationRequest]) -> list[pb.Reservation | grpc.RpcError]:
    """The requests sent at once, each its own call."""
    def one(req: pb.CreateReservationRequest) -> pb.Reservation | grpc.RpcError:
        try:
            return world.user.res("Create", req)
        except grpc.RpcError as exc:
            return exc
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def parts_beside_whole(world: World) -> list[tuple]:
    """A GPU booked whole while one of its parts (MIG instance, slot) is booked for an overlapping
    window, or parts of one GPU booked by two tenants in a pool in exclusive mode: never."""
    return world.sql(
        "SELECT g.device_uuid, b1.allocation_id, b2.allocation_id FROM atoms g"
        " JOIN bookings b1 ON b1.atom_id = g.id"
        " JOIN atoms c ON c.node_id = g.node_id AND c.kind <> 'gpu' AND split_part(c.device_uuid, ':', 1) = g.device_uuid"
        " JOIN bookings b2 ON b2.atom_id = c.id AND b2.during && b1.during"
        " JOIN nodes n ON n.id = g.node_id WHERE g.kind = 'gpu' AND n.pool_id = %s", (world.pool_id,))


# -- MIG profiles and slot counts ---------------------------------------------------------------


@pytest.mark.parametrize("profile", ["1G.5GB", " 1g.5gb", "1g.5gb ", "1g.5gb\n", "1g.5gb\x00", "1g 5gb",
                                     "１g.5gb", "1g.5gb" * 10])
def test_a_mig_profile_in_another_case_or_with_spaces_is_invalid_input(world: World, profile: str) -> None:
    shared_pool(world, "mig")
    invalid("devices[0].profile", world.create, device_class="gpu.mig", profile=profile)


def test_a_profile_on_a_slot_or_whole_gpu_request_is_invalid_input(world: World) -> None:
    shared_pool(world, "time-slice")
    invalid("devices[0].profile", world.create, device_class="gpu.slot", profile="1g.5gb")


def test_more_slots_than_the_pool_has_wait_pending_and_twenty_at_once_never_share_a_slot(world: World) -> None:
    shared_pool(world, "time-slice")  # one node: 8 GPUs of 4 slots
    world.quota(64)
    assert world.create(device_class="gpu.slot", count=33).state == "pending"
    got = storm(world, [world.create_request(device_class="gpu.slot", count=3) for _ in range(20)])
    placed = [r for r in got if isinstance(r, pb.Reservation) and r.state == "placed"]
    assert not [r for r in got if isinstance(r, grpc.RpcError)]
    assert 1 <= len(placed) <= 10  # 30 of the 32 slots at most (a lost race may leave one pending)
    devices = [d for r in placed for d in r.allocations[0].device_ids]
    assert len(devices) == len(set(devices)) == 3 * len(placed)
    assert snapshot(world.conninfo, world.tenant)["double_booked"] == []
    assert parts_beside_whole(world) == []


# -- host resources ------------------------------------------------------------------------------


def test_twenty_creates_at_once_never_overbook_a_nodes_cpus_or_memory(world: World, server) -> None:  # noqa: F811
    host_world(world, server, nodes=2, vcpu=66, memory=512)  # 64 bookable vCPUs per node
    world.quota(10_000, "vcpu")
    world.quota(10_000, "memoryGiB")
    start = world.later(2)
    got = storm(world, [world.create_request(count=1, start=start, duration="2h",
                                             resources=resources(vcpu=20, memory_gib=100)) for _ in range(20)])
    assert not [r for r in got if isinstance(r, grpc.RpcError)]
    placed = [r for r in got if r.state == "placed"]
    assert 1 <= len(placed) <= 6  # three per node fit beside each other (60 of 64 vCPUs)
    assert peak_over_capacity(world) == []
    check_invariants(world.conninfo, world.tenant)
    assert snapshot(world.conninfo, world.tenant)["double_booked"] == []


@pytest.mark.parametrize("kw,field", [({"vcpu": 2**31 - 1}, "resources.vcpu"),
                                      ({"memory_gib": -2**31}, "resources.memoryGiB"),
                                      ({"hugepages_1gi": 2**31 - 1}, "resources.hugepages1Gi")])
def test_host_resources_beyond_any_node_are_invalid_input(world: World, kw: dict, field: str) -> None:
    invalid(field, world.create, resources=resources(**kw))


# -- the node binding: a whole machine is never leased beside another booking -------------------


def test_a_machine_is_never_leased_while_a_gpu_it_no_longer_offers_is_still_booked(
        gateway, cp: ControlPlane) -> None:  # noqa: F811
    """A GPU booked by tenant B goes out of the bookable set (the node reports it in MIG mode, or
    not at all), its booking stays; tenant A then asked for the machine with the GPUs it still
    offers: the lease saw only the bookable GPUs free and leased the machine (root, reimaged)
    over B's booking."""
    owner = cp.world
    owner.pool_id = owner.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=owner.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(tenant_root=True))).id
    owner.quota(64, "vcpu")
    owner.quota(1024, "memoryGiB")
    node, session = connected(gateway, owner.pool_id, "m1", gpus=4, caps=("devices.limits", "binding.node"))
    held = owner.create(count=1, start=owner.later(1), duration="4h")
    assert held.state == "placed" and held.allocations[0].node_id == node.node_id
    booked_gpu = held.allocations[0].device_ids[0]
    inventory = hello(gpus=4).hello.inventory
    inventory.generation = 2
    for gpu in inventory.gpus:
        if gpu.uuid == booked_gpu:
            gpu.mig_mode = True
            gpu.mig_instances.append(npb.MigInstance(index=0, profile="7g.80gb"))
    session.send(npb.NodeMessage(inventory=inventory))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["inventory_generation"] == 2, what="inventory")
    assert owner.sql("SELECT bookable FROM atoms WHERE node_id = %s AND device_uuid = %s AND kind = 'gpu'",
                     (node.node_id, booked_gpu)) == [(False,)]
    _, other = owner.identity()
    profile = register(owner.root, 1)
    lease = owner.create(other, count=3, binding="node", node=pb.NodeLease(profile_id=profile),
                         start=held.during.start, duration="1h")
    assert lease.state == "pending", "leased beside a booking of a GPU of the machine"
    assert owner.sql("SELECT state FROM nodes WHERE id = %s", (node.node_id,)) == [("ready",)]
    owner.user.res("Release", pb.ReleaseReservationRequest(tenant_id=owner.tenant, reservation_id=held.id))
    again = owner.create(other, count=3, binding="node", node=pb.NodeLease(profile_id=profile),
                         start=held.during.start, duration="1h")
    assert again.state == "placed" and again.allocations[0].node_id == node.node_id  # once B's booking is gone
    session.close()


def test_a_gpu_that_becomes_bookable_under_a_future_lease_joins_the_lease(gateway, cp: ControlPlane) -> None:  # noqa: F811
    """Tenant A leases a machine from tomorrow; afterwards the node's inventory offers a GPU it did
    not offer then (one out of MIG mode, one new). Those GPUs were not among the lease's atoms, so
    tenant B could book them into A's window: B's workload bound on a machine A has root on. They
    now join the lease in the inventory's own transaction, and B's create is pending."""
    owner = cp.world
    owner.pool_id = owner.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=owner.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(tenant_root=True))).id
    node, session = connected(gateway, owner.pool_id, "m2", gpus=4, caps=("devices.limits", "binding.node"))
    inventory = hello(gpus=4).hello.inventory
    inventory.generation = 2
    mig = inventory.gpus[3]
    mig.mig_mode = True
    mig.mig_instances.append(npb.MigInstance(index=0, profile="7g.80gb"))
    session.send(npb.NodeMessage(inventory=inventory))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["inventory_generation"] == 2, what="inventory")
    profile = register(owner.root, 1)
    start = owner.later(24)
    lease = owner.create(count=3, binding="node", node=pb.NodeLease(profile_id=profile), start=start, duration="8h")
    assert lease.state == "placed" and lease.allocations[0].node_id == node.node_id

    gpu_bookings = ("SELECT count(*) FROM bookings b JOIN atoms a ON a.id = b.atom_id"
                    " WHERE b.allocation_id = %s AND a.kind = 'gpu'")
    inventory.generation = 3  # the same inventory again: the MIG GPU is bookable only mid-transaction
    session.send(npb.NodeMessage(inventory=inventory))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["inventory_generation"] == 3, what="inventory")
    assert owner.sql(gpu_bookings, (lease.allocations[0].id,)) == [(3,)]

    grown = hello(gpus=5).hello.inventory  # the MIG GPU whole again, and a fifth GPU
    grown.generation = 4
    session.send(npb.NodeMessage(inventory=grown))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["inventory_generation"] == 4, what="inventory")
    joined = owner.sql(
        "SELECT a.device_uuid, epoch_ms(lower(b.during)), epoch_ms(upper(b.during)) FROM bookings b"
        " JOIN atoms a ON a.id = b.atom_id WHERE b.allocation_id = %s AND a.kind = 'gpu' ORDER BY 1",
        (lease.allocations[0].id,))
    assert len(joined) == 5 and {(lo, hi) for _, lo, hi in joined} == {(lease.during.start, lease.during.end)}

    _, other = owner.identity()
    taken = owner.create(other, count=1, start=start + HOUR, duration="1h")
    assert taken.state == "pending", "a GPU of a leased machine was booked into the lease's window"
    before = owner.create(other, count=2, start=start - 2 * HOUR, duration="1h")  # outside the window: free
    assert before.state == "placed" and before.allocations[0].node_id == node.node_id
    check_invariants(owner.conninfo, owner.tenant)
    session.close()


def test_twenty_gangs_at_once_never_overbook_a_nodes_cpus(world: World, server) -> None:  # noqa: F811
    host_world(world, server, nodes=4, vcpu=66, memory=512)  # 64 bookable vCPUs per node
    world.quota(10_000, "vcpu")
    world.quota(10_000, "memoryGiB")
    start = world.later(2)
    got = storm(world, [world.create_request(count=1, start=start, duration="2h", gang=pb.Gang(size=2),
                                             resources=resources(vcpu=30)) for _ in range(20)])
    assert not [r for r in got if isinstance(r, grpc.RpcError)]
    assert 1 <= len([r for r in got if r.state == "placed"]) <= 4  # two members per node, four nodes
    assert peak_over_capacity(world) == []
    check_invariants(world.conninfo, world.tenant)
    assert snapshot(world.conninfo, world.tenant)["double_booked"] == []


def test_slots_carry_their_share_and_twenty_at_once_never_overbook_the_host(world: World, server) -> None:  # noqa: F811
    from tests.test_host_resources import host_node
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="ts", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="time-slice")))).id
    host_node(world, server, vcpu=66, memory=512)  # 64 vCPUs, 32 slots: a slot's share is 2 vCPUs
    world.quota(10_000, "vcpu")
    world.quota(10_000, "memoryGiB")
    share = world.create(device_class="gpu.slot", count=1, start=world.later(30))
    assert (share.host_share.vcpu, share.host_share.memory_gib) == (2, 16)
    start = world.later(2)
    got = storm(world, [world.create_request(device_class="gpu.slot", count=1, start=start, duration="2h",
                                             resources=resources(vcpu=5)) for _ in range(20)])
    assert not [r for r in got if isinstance(r, grpc.RpcError)]
    assert 1 <= len([r for r in got if r.state == "placed"]) <= 12  # 60 of the 64 vCPUs, 12 of 32 slots
    assert peak_over_capacity(world) == []
    assert parts_beside_whole(world) == []


def test_a_tenant_the_pool_is_offered_to_cannot_book_or_preview_a_kubernetes_binding(world: World) -> None:
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="k8s", region="eu-1", policy=apb.PoolPolicy(kubernetes=True))).id
    world.add_node()
    guest = make_world(world.endpoint, world.root, world.conninfo, nodes=0)
    try:
        world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
        req = guest.create_request(count=1, binding="kubernetes", pool_id=world.pool_id)
        with pytest.raises(grpc.RpcError) as exc:
            guest.user.res("Create", req)
        code, reason, details = rpc_error(exc)
        assert (reason, details["field"]) == ("INVALID_INPUT", "binding")
        assert guest.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (guest.tenant,)) == [(0,)]
    finally:
        guest.close()


def test_extends_at_once_never_overbook_a_nodes_cpus_later(world: World, server) -> None:  # noqa: F811
    host_world(world, server, nodes=1, vcpu=66, memory=512)  # 64 bookable vCPUs, 8 GPUs
    world.quota(10_000, "vcpu")
    world.quota(10_000, "memoryGiB")
    start = world.later(2)
    first = [world.create(count=1, start=start, duration="1h", resources=resources(vcpu=10)) for _ in range(6)]
    later = [world.create(count=1, start=start + HOUR, duration="1h", resources=resources(vcpu=10)) for _ in range(2)]
    assert all(r.state == "placed" for r in first + later)

    def extend(r: pb.Reservation) -> bool:
        return world.user.res("Extend", pb.ExtendReservationRequest(
            tenant_id=world.tenant, reservation_id=r.id, by="1h", idempotency_key=f"x-{r.id[-8:]}")).extended
    with ThreadPoolExecutor(len(first)) as pool:
        extended = list(pool.map(extend, first))
    assert extended.count(True) == 4  # 20 vCPUs booked later: four of the six fit beside them (60 of 64)
    assert peak_over_capacity(world) == []
    check_invariants(world.conninfo, world.tenant)


def test_the_pools_owner_never_reads_a_guests_booking_on_it(world: World) -> None:
    """The owner of a pool offered to a guest sees the guest's use only in aggregate: the guest's
    reservation (its node, devices, binding) is NOT_FOUND to the owner and absent from its lists."""
    guest = make_world(world.endpoint, world.root, world.conninfo, nodes=0)
    try:
        world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
        theirs = guest.create(count=2, pool_id=world.pool_id, start=world.later(1))
        assert theirs.state == "placed" and theirs.allocations[0].device_ids
        for tenant in (world.tenant, guest.tenant):
            with pytest.raises(grpc.RpcError) as exc:
                world.user.res("Get", pb.GetReservationRequest(tenant_id=tenant, reservation_id=theirs.id))
            assert rpc_error(exc)[1] in ("NOT_FOUND", "ACCESS_DENIED")
        listed = world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, scope="all"))
        assert theirs.id not in [r.id for r in listed.items]
    finally:
        guest.close()


def test_a_lease_and_holds_at_once_never_share_the_machine(gateway, cp: ControlPlane) -> None:  # noqa: F811
    owner = cp.world
    owner.pool_id = owner.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=owner.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(
            tenant_root=True, per_gpu=apb.PerGpuShare(vcpu=1, memory_gib=1)))).id
    owner.quota(64, "vcpu")
    owner.quota(1024, "memoryGiB")
    node, session = connected(gateway, owner.pool_id, "m1", gpus=4, caps=("devices.limits", "binding.node"))
    profile = register(owner.root, 1)
    start = owner.later(1)
    requests = [owner.create_request(count=4, binding="node", node=pb.NodeLease(profile_id=profile), start=start,
                                     duration="2h")]
    requests += [owner.create_request(count=1, start=start + HOUR, duration="2h") for _ in range(10)]
    got = storm(owner, requests)
    assert not [r for r in got if isinstance(r, grpc.RpcError)]
    placed = [r for r in got if r.state == "placed"]
    assert placed and (placed == [got[0]] or got[0] not in placed), [r.state for r in got]
    assert snapshot(owner.conninfo, owner.tenant)["double_booked"] == []
    session.close()


@pytest.mark.parametrize("kw,field", [
    ({"resources": resources(vcpu=1)}, "resources"),
    ({"spot": True}, "spot"),
    ({"topology": "numa"}, "devices[0].topology"),
    ({"device_class": "gpu.slot"}, "devices[0].class"),
    ({"device_class": "gpu.mig", "profile": "1g.10gb"}, "devices[0].class"),
])
def test_a_node_lease_with_what_it_cannot_book_is_invalid_input_naming_it(world: World, kw: dict, field: str) -> None:
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(tenant_root=True))).id
    profile = register(world.root, 1)
    details = invalid(field, world.create, count=8, binding="node", node=pb.NodeLease(profile_id=profile), **kw)
    assert details["field"] == field
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,)) == [(0,)]
