"""Promises of the reservations page's "Bindings", "Host resources" and "Attested bindings"
sections that no other test held the product to, each driven through the real API (and a real
gateway where a node's daemon says what it can do): the third AllocationFailed report failing a
reservation, a report about another node's allocation ignored, the devices.limits label on a
pending retry, a booking repair, a preview, a gang, a lease pool's batch and a kubernetes binding,
the share (every physical GPU, a MIG instance's seventh, an MPS slot's tenth, resolved at the draft,
raised to in a preview), huge pages on the memory quota, a node lease booking no host resources,
no cgroup parent for a hold without limits, and reports that fail the check (a role left out, an
unsigned AllocationFailed) never counting."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.nodes import inventory
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes, poll
from tests.support import (PERMISSIVE, Client, ServerThread, World, clock_now, eventually, get, gpus, invalid,
                           make_world, refused, rpc_error)
from tests.test_capacity_preview import preview
from tests.test_cli import cli  # noqa: F401 (fixture)
from tests.test_gateway import connected, cp, gateway, node_row  # noqa: F401 (fixtures)
from tests.test_host_resources import LIMITS_LABEL, host_bookings, host_node, host_world, resources
from tests.test_node_profiles import register
from tests.test_pki import arun

MIN = 60_000
HOUR = 3_600_000


def event_types(world: World, rid: str) -> list[str]:
    return [t for (t,) in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id",
                                    (f"reservation/{rid}",))]


def operator_label(world: World, server: ServerThread, node_id: str) -> None:
    """The capability label set by an operator, not by the node's daemon."""
    world.sql("UPDATE nodes SET labels = labels || jsonb_build_object(%s::text, "
              "jsonb_build_object('value', 'true', 'source', 'operator')) WHERE id = %s", (LIMITS_LABEL, node_id))
    server.call(server.app.runtime.capacity.barrier())


def retried(world: World) -> None:
    """Wake the pool's pending retry as freed capacity does, and wait until it has tried them."""
    with capture_logs() as logs:
        world.sql("SELECT pg_notify('bc_pool_freed', %s)", (world.pool_id,))
        # 30 s: the worker may be in the middle of a safety-net retry of every pool of the module's
        # server when the wake comes (10 s ran out once in CI on a slow machine).
        # Or none is left pending: a wake-up before this one (a node registered wakes its pool)
        # may have placed them already, and a retry with nothing to try logs nothing.
        poll(lambda: [e for e in list(logs) if e.get("event") == "pending retried"
                      and e.get("pool_id") == world.pool_id] or not _pending_in_pool(world),
             seconds=30, what="the pending retry")


def _pending_in_pool(world: World) -> int:
    return world.sql("SELECT count(*) FROM reservations WHERE pool_id = %s AND state = 'pending'",
                     (world.pool_id,))[0][0]


# "no report within 5 minutes, or an AllocationFailed report: the bookings are released and the
# reservation is placed again, at most twice; the third failure fails it" (the timeout half is
# tests/test_time.py's; one AllocationFailed is tests/test_e2e.py's).

def test_the_third_allocation_failed_report_fails_the_reservation(world: World) -> None:
    world.add_node()  # three nodes: room to place again twice
    nodes = SigningNodes(world)
    r = world.create(count=8, duration="2h")
    tried: list[str] = []
    for _ in range(3):
        current = eventually(world, r.id, lambda x: any(a.state == "binding" and a.id not in tried
                                                        for a in x.allocations))
        [alloc] = [a for a in current.allocations if a.state == "binding" and a.id not in tried]
        tried.append(alloc.id)
        assert nodes.report(alloc.node_id, alloc.id, kind="failed") == "stored"
    final = eventually(world, r.id, lambda x: x.state == "failed")
    assert world.sql("SELECT bind_failures FROM reservations WHERE id = %s", (r.id,))[0][0] == 3
    types = event_types(world, r.id)
    assert types.count("reservation.placed") == 3 and types[-1] == "reservation.failed", types
    assert final.state == "failed" and not final.HasField("binding")
    # The bookings are released and the quota refunded.
    assert world.sql("SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
                     " WHERE a.reservation_id = %s AND upper(b.during) > compute_now()", (r.id,))[0][0] == 0
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL",
                     (r.id,))[0][0] == 0
    check_invariants(world.conninfo, world.tenant)


# "a reservation that books any host resource (..., including the per-GPU share) places only on
# nodes with the system label bc.dev/cap.devices.limits ... An operator label of the same name does
# not count ... The requirement applies to create, to re-placing a pending reservation, ..."

def test_a_pending_reservation_is_placed_again_only_on_a_node_whose_daemon_enforces_limits(
        world: World, server: ServerThread) -> None:
    capable = host_world(world, server)[0]
    operator_only = host_node(world, server, label=False)
    operator_label(world, server, operator_only.id)
    blocker = world.create(count=8)
    assert blocker.state == "placed" and blocker.allocations[0].node_id == capable.id
    waiting = world.create(count=1)  # books the share: only the capable node may take it, and it is full
    assert waiting.state == "pending"
    # The pool's pending reservations are retried with the operator-labelled node free: it stays pending.
    retried(world)
    assert get(world, waiting.id).state == "pending"
    # Freed capacity on the capable node: the retry places it there.
    world.user.res("Release", pb.ReleaseReservationRequest(
        tenant_id=world.tenant, reservation_id=blocker.id))
    placed = eventually(world, waiting.id, lambda x: x.state in ("placed", "binding"))  # no start: binds at once
    assert placed.allocations[-1].node_id == capable.id
    assert host_bookings(world, waiting.id) == {"vcpu": 8, "memoryGiB": 64}
    check_invariants(world.conninfo, world.tenant)


# "... to repairing a booking ...": BookingRepair never moves host resources to a node whose
# daemon does not enforce them.

@pytest.fixture
def clock(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def test_booking_repair_moves_host_resources_only_to_a_node_whose_daemon_enforces_limits(
        clock: tuple[ServerThread, Client]) -> None:
    server, root = clock
    world = make_world(server.endpoint, root, server.conninfo)
    try:
        first = host_world(world, server)[0]
        start = clock_now(world) + HOUR
        r = world.create(count=1, start=start, duration="1h")
        assert r.state == "placed" and r.allocations[0].node_id == first.id
        operator_only = host_node(world, server, label=False)
        operator_label(world, server, operator_only.id)
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=first.id, state="cordoned"))
        world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=45 * MIN + 1000))
        failed = eventually(world, r.id, lambda x: x.state == "pending")
        assert [c.reason for c in failed.conditions] == ["BookingRepairFailed"], failed.conditions
        assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s AND node_id = %s",
                         (r.id, operator_only.id))[0][0] == 0
        # Not vacuous: a node whose daemon enforces limits takes it.
        capable = host_node(world, server)
        retried(world)
        placed = eventually(world, r.id, lambda x: x.state == "placed")
        assert placed.allocations[-1].node_id == capable.id
    finally:
        world.close()


# "capacity.preview books the same host resources as reservations.create would, the request's or
# the pool's per-GPU share, so a preview that fits is a create that fits", and "The requirement
# applies ... to capacity.preview (a node without the label is rejected with filter labels, needs
# label bc.dev/cap.devices.limits=*)": an operator label does not count there either.

def test_a_preview_books_the_pools_share_and_only_on_a_node_whose_daemon_enforces_limits(
        world: World, server: ServerThread) -> None:
    only = host_world(world, server, label=False)[0]
    operator_label(world, server, only.id)
    out = preview(world, count=3)  # no resources: the share, 8 vCPUs and 64 GiB per GPU
    assert not out.fits
    assert (out.resources.vcpu, out.resources.memory_gib) == (24, 192)
    assert [(f.filter, f.nodes, f.reason) for f in out.filters if f.filter != "state"] == [
        ("labels", 1, f"needs label {LIMITS_LABEL}=*")]  # the world's plain nodes are cordoned
    assert world.create(count=3).state == "pending"  # the create agrees
    capable = host_node(world, server)
    out = preview(world, count=3)
    assert out.fits and [m.node_id for m in out.members] == [capable.id]
    assert (out.resources.vcpu, out.resources.memory_gib) == (24, 192)
    placed = world.create(count=3)
    assert placed.state == "placed" and placed.allocations[0].node_id == capable.id
    assert host_bookings(world, placed.id) == {"vcpu": 24, "memoryGiB": 192}


# "a time-slice or MPS slot 1/policy.sharing.replicas (default 4, or 10 for mps)": an MPS slot
# carries a tenth of a GPU's share (a time-slice slot's quarter is tests/test_hostile_share.py's).

def test_an_mps_slot_carries_a_tenth_of_a_gpus_share(world: World, server: ServerThread) -> None:
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="mps", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="mps")))).id
    host_node(world, server, vcpu=162, memory=640)  # 20 vCPUs and 80 GiB per GPU
    one = world.create(device_class="gpu.slot", count=1, start=world.later(30))
    assert (one.host_share.vcpu, one.host_share.memory_gib) == (2, 8)
    five = world.create(device_class="gpu.slot", count=5, start=world.later(30))
    assert (five.host_share.vcpu, five.host_share.memory_gib) == (10, 40)
    assert host_bookings(world, five.id) == {"vcpu": 10, "memoryGiB": 40}


# "The gateway accepts a report only about an allocation placed on the reporting node's own
# session; a report naming another node's allocation is ignored like an unknown one."

def test_a_signed_report_about_another_nodes_allocation_is_ignored_like_an_unknown_one(world: World) -> None:
    nodes = SigningNodes(world)
    r = world.create(count=1, duration="2h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0]
    other = next(n.id for n in world.nodes if n.id != alloc.node_id)
    devices = [f"bcd.dev/gpu={d}" for d in alloc.device_ids]
    unknown = nodes.report(other, "alloc_06h0000000000000000000000", cdi_devices=devices)
    assert nodes.report(other, alloc.id, cdi_devices=devices) == unknown == "ignored"
    assert world.sql("SELECT count(*) FROM node_reports WHERE allocation_id = %s", (alloc.id,)) == [(0,)]
    assert get(world, r.id).state == "binding"
    # The allocation's own node is heard: the same report from it binds.
    assert nodes.report(alloc.node_id, alloc.id, cdi_devices=devices) == "stored"
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert active.binding.node_id == alloc.node_id and active.binding.attested


# "otherwise the smallest share any GPU host of the pool can give (allocatable × ratio ÷ physical
# GPUs, counting every physical GPU whether bookable or not)".

def test_the_share_divides_by_every_physical_gpu_healthy_or_not(world: World, server: ServerThread) -> None:
    node = host_world(world, server, vcpu=66, memory=512)[0]  # (66 - 2 reserved) / 8 = 8 vCPUs, 64 GiB per GPU
    sick = world.sql("SELECT device_uuid FROM atoms WHERE node_id = %s AND kind = 'gpu' ORDER BY device_uuid"
                     " LIMIT 1", (node.id,))[0][0]
    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node.id, device_uuid=sick, health="unhealthy"))
    server.call(server.app.runtime.capacity.barrier())
    assert world.sql("SELECT count(*) FROM atoms WHERE node_id = %s AND kind = 'gpu' AND health = 'healthy'",
                     (node.id,)) == [(7,)]
    r = world.create(count=1)
    assert r.state == "placed" and r.allocations[0].device_ids[0] != sick
    assert (r.host_share.vcpu, r.host_share.memory_gib) == (8, 64)  # not 64/7 and 512/7


# "a MIG instance is 1/7 of a GPU, ... so MIG and slot work also carries, and is limited to, its
# share of the host": the host's rows come from its applied inventory, as on a real node.

def test_a_mig_instance_carries_a_seventh_of_a_gpus_share(world: World, server: ServerThread) -> None:

    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="mig", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="mig")))).id
    node = world.add_node(gpus("mig-host", count=2), name="mig-host", system_labels={LIMITS_LABEL: "true"})
    first, second = (g.uuid for g in gpus("mig-host", count=2))
    inv = node_pb2.Inventory(generation=2, vcpus=30, memory_bytes=140 << 30, gpus=[
        node_pb2.Gpu(uuid=u, model="H100-SXM5-80GB", memory_mib=81559, numa_node=0, mig_mode=True,
                     mig_instances=[node_pb2.MigInstance(index=k, profile="1g.10gb") for k in range(7, 14)])
        for u in (first, second)])
    arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, inv))
    rows = poll(lambda: dict(world.sql("SELECT resource, allocatable FROM host_resources WHERE node_id = %s",
                                       (node.id,))), what="the host's rows from its inventory")
    server.call(server.app.runtime.capacity.barrier())
    per_gpu_vcpu = (int(rows["vcpu"]) - 2) / 2  # the host reserve is never booked
    per_gpu_memory = int(rows["memoryGiB"]) / 2
    assert per_gpu_vcpu >= 7 and per_gpu_memory >= 7, rows  # a share a seventh of which is not zero
    one = world.create(device_class="gpu.mig", count=1)
    assert one.state == "placed", one.conditions
    assert (one.host_share.vcpu, one.host_share.memory_gib) == (int(per_gpu_vcpu / 7), int(per_gpu_memory / 7))
    three = world.create(device_class="gpu.mig", count=3)
    assert (three.host_share.vcpu, three.host_share.memory_gib) == (
        int(per_gpu_vcpu * 3 / 7), int(per_gpu_memory * 3 / 7))
    assert host_bookings(world, three.id) == {"vcpu": three.host_share.vcpu, "memoryGiB": three.host_share.memory_gib}


# "Anything booked above it is charged to the tenant's vcpu and memoryGiB quota (1 GiB huge pages
# count as memory), and a missing quota row grants 0, so the excess is QUOTA_EXCEEDED": huge pages
# alone are refused on memoryGiB.

def test_huge_pages_without_a_memory_quota_are_quota_exceeded_on_memory(world: World, server: ServerThread) -> None:
    host_world(world, server)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(count=1, resources=resources(hugepages_1gi=2))
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["resource"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", "memoryGiB")
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s AND state NOT IN ('draft')",
                     (world.tenant,)) == [(0,)]
    world.quota(2, "memoryGiB")
    placed = world.create(count=1, resources=resources(hugepages_1gi=2))
    assert placed.state == "placed"
    assert host_bookings(world, placed.id) == {"vcpu": 8, "memoryGiB": 64, "hugepages1Gi": 2}


def test_huge_pages_beyond_the_limit_are_invalid_input_naming_them(world: World) -> None:
    invalid("resources.hugepages1Gi", world.create, resources=resources(hugepages_1gi=65537))


# "A plain GPU hold that books no host resources ... needs no capability, so it still places on
# older daemons within the N-2 skew window, as does a node binding", and "capacity.preview books the
# same host resources as reservations.create would, ...; a node binding books none". A machine
# whose daemon leases whole machines but does not enforce limits, with host rows from its inventory.

def test_a_node_lease_books_no_host_resources_and_needs_no_limits_capability(gateway, cp) -> None:  # noqa: F811

    owner = cp.world
    owner.pool_id = owner.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=owner.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(tenant_root=True))).id
    node, session = connected(gateway, owner.pool_id, "m1", gpus=4, caps=("binding.node",))
    try:
        assert LIMITS_LABEL not in node_row(gateway.conninfo, node.node_id)["labels"]
        poll(lambda: owner.sql("SELECT count(*) FROM host_resources WHERE node_id = %s", (node.node_id,))[0][0],
             what="the host's rows from its inventory")
        cp.server.call(cp.server.app.runtime.capacity.barrier())
        # A hold of this pool books the per-GPU share, so it needs the capability this daemon lacks.
        hold = owner.create(count=1, start=owner.later(48))
        assert hold.state == "pending" and hold.host_share.vcpu > 0, hold
        profile = register(owner.root, 1)
        lease_kw = dict(count=4, binding="node", node=pb.NodeLease(profile_id=profile), start=owner.later(24),
                        duration="8h")
        out = preview(owner, **lease_kw)
        assert out.fits and [m.node_id for m in out.members] == [node.node_id], out
        assert (out.resources.vcpu, out.resources.memory_gib, out.resources.hugepages_1gi) == (0, 0, 0)
        lease = owner.create(**lease_kw)
        assert lease.state == "placed" and lease.allocations[0].node_id == node.node_id
        assert host_bookings(owner, lease.id) == {}
        assert owner.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND resource IN"
                         " ('vcpu', 'memoryGiB') AND refunded_at IS NULL", (lease.id,)) == [(0,)]
    finally:
        session.close()


# "The pki check accepts a report only when: ... the certificate's role runs workloads (node or
# node-tenant by default; roles changes it)", and "each rejection publishes
# reservation.binding-rejected with allocationId, nodeId and reason".

def test_a_report_by_a_role_the_setting_leaves_out_never_binds_and_is_rejected(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = SigningNodes(world)  # its nodes enrol with the role "node"
    r = world.create(count=1, duration="2h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0]
    devices = [f"bcd.dev/gpu={d}" for d in alloc.device_ids]
    monkeypatch.setenv("BC_ATTEST_ROLES", "node-tenant")
    assert nodes.report(alloc.node_id, alloc.id, cdi_devices=devices) == "stored"
    [data] = poll(lambda: [d for (d,) in world.sql(
        "SELECT data FROM events WHERE subject = %s AND type = 'reservation.binding-rejected'",
        (f"reservation/{r.id}",))], what="binding-rejected")
    assert (data["allocationId"], data["nodeId"], data["reason"]) == (
        alloc.id, alloc.node_id, "role does not run workloads")
    assert get(world, r.id).state == "binding"
    # The default roles include "node": the node's next report binds.
    monkeypatch.delenv("BC_ATTEST_ROLES")
    assert nodes.report(alloc.node_id, alloc.id, cdi_devices=devices) == "stored"
    assert eventually(world, r.id, lambda x: x.state == "active").binding.attested


# The devices.limits rule for a gang: "resources ... per node (per gang member for a gang)", so
# every member that books host resources needs a node whose daemon enforces them.

def test_every_gang_member_booking_host_resources_needs_a_node_whose_daemon_enforces_limits(
        world: World, server: ServerThread) -> None:
    capable = {n.id for n in host_world(world, server, nodes=2)}
    operator_only = host_node(world, server, label=False)
    operator_label(world, server, operator_only.id)
    three = world.create(count=1, gang=pb.Gang(size=3), start=world.later(2))
    assert three.state == "pending" and not three.allocations, three
    two = world.create(count=1, gang=pb.Gang(size=2), start=world.later(2))
    assert two.state == "placed" and {a.node_id for a in two.allocations} == capable
    per_member = world.sql("SELECT a.node_id, h.resource, h.amount FROM host_bookings h JOIN allocations a"
                           " ON a.id = h.allocation_id WHERE a.reservation_id = %s", (two.id,))
    assert sorted((n, r, int(v)) for n, r, v in per_member) == sorted(
        (n, r, v) for n in capable for r, v in (("vcpu", 8), ("memoryGiB", 64)))  # the share on each member
    check_invariants(world.conninfo, world.tenant)


# The same rule for the lease placer's batches (a lease pool places queued creates in batches).

@pytest.fixture(scope="module")
def lease_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, default_placer="lease")


def test_a_lease_pools_batch_places_host_resources_only_on_a_node_whose_daemon_enforces_limits(
        lease_stack: tuple[ServerThread, Client]) -> None:
    server, root = lease_stack
    world = make_world(server.endpoint, root, server.conninfo)
    try:
        world.wait_ms = 20_000
        operator_only = host_world(world, server, label=False)[0]
        operator_label(world, server, operator_only.id)
        waiting = world.create(count=1, start=world.later(2))
        assert eventually(world, waiting.id, lambda x: x.state != "queued", seconds=20).state == "pending"
        capable = host_node(world, server)
        retried(world)
        placed = eventually(world, waiting.id, lambda x: x.state == "placed", seconds=20)
        assert placed.allocations[0].node_id == capable.id
    finally:
        world.close()


# kubernetes "places only on nodes whose bcd advertises the binding.kubernetes capability", and a
# reservation that books host resources (here the per-GPU share) "places only on nodes with the
# system label bc.dev/cap.devices.limits": a kubernetes binding of such a pool needs both.

def test_a_kubernetes_binding_that_books_host_resources_needs_the_limits_capability_too(gateway, cp) -> None:  # noqa: F811

    owner = cp.world
    owner.pool_id = owner.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=owner.tenant, name="k8s", region="eu-1", policy=apb.PoolPolicy(kubernetes=True))).id
    kube_only, s1 = connected(gateway, owner.pool_id, "k1", gpus=4, caps=("binding.kubernetes",), uuid="GK")
    both, s2 = connected(gateway, owner.pool_id, "k2", gpus=4, caps=("binding.kubernetes", "devices.limits"),
                         uuid="GB")
    try:
        poll(lambda: owner.sql("SELECT count(DISTINCT node_id) FROM host_resources WHERE node_id IN (%s, %s)",
                               (kube_only.node_id, both.node_id))[0][0] == 2, what="the hosts' rows")
        cp.server.call(cp.server.app.runtime.capacity.barrier())
        start = owner.later(24)
        first = owner.create(count=4, binding="kubernetes", start=start)
        assert first.state == "placed" and first.allocations[0].node_id == both.node_id
        assert first.host_share.vcpu > 0
        second = owner.create(count=4, binding="kubernetes", start=start)
        assert second.state == "pending", second.allocations  # the free node's daemon does not enforce limits
    finally:
        s1.close()
        s2.close()


# "It is resolved once, when the draft is written, and stored in the request": a pending
# reservation placed later, after a host with a smaller share joined, books the share it was
# created with.

def test_the_share_resolved_at_the_draft_is_what_a_later_placement_books(world: World, server: ServerThread) -> None:
    host_world(world, server, vcpu=66, memory=512, label=False)  # 8 vCPUs, 64 GiB per GPU; no enforcing daemon
    r = world.create(count=2)
    assert r.state == "pending" and r.host_share == resources(vcpu=16, memory_gib=128)
    smaller = host_node(world, server, vcpu=34, memory=256)  # 4 vCPUs, 32 GiB per GPU: the pool's share shrinks
    assert world.create(count=2, start=world.later(48)).host_share == resources(vcpu=8, memory_gib=64)
    retried(world)
    placed = eventually(world, r.id, lambda x: x.state in ("placed", "binding"))
    assert placed.allocations[-1].node_id == smaller.id
    assert placed.host_share == resources(vcpu=16, memory_gib=128)
    assert placed.request.resources == resources(vcpu=16, memory_gib=128, hugepages_1gi=0)
    assert host_bookings(world, r.id) == {"vcpu": 16, "memoryGiB": 128}


# "capacity.preview books the same host resources as reservations.create would, the request's or
# the pool's per-GPU share": resources below the share are raised to it in a preview as in a create.

def test_a_preview_raises_resources_below_the_share_to_it_like_a_create(world: World, server: ServerThread) -> None:
    host_world(world, server)  # 8 vCPUs, 64 GiB per GPU
    for asked in (resources(vcpu=1, memory_gib=1), resources(), resources(vcpu=20, hugepages_1gi=0)):
        out = preview(world, count=2, resources=asked)
        created = world.create(count=2, resources=asked, start=world.later(48)) if asked.vcpu <= 16 else None
        expected = (max(asked.vcpu, 16), max(asked.memory_gib, 128))
        assert out.fits and (out.resources.vcpu, out.resources.memory_gib) == expected, (asked, out.resources)
        if created is not None:
            assert (created.request.resources.vcpu, created.request.resources.memory_gib) == expected


# "It is empty for a hold without limits and for a kubernetes binding" (binding.cgroupParent): a
# hold that books no host resources shows none, even when its node names the allocation's slice.

def test_a_hold_without_limits_shows_no_cgroup_parent_even_when_the_node_names_one(world: World) -> None:
    nodes = SigningNodes(world)
    r = world.create(count=1, duration="2h")  # the world's nodes have no host rows: no limits
    assert r.request.resources == resources(vcpu=0, memory_gib=0, hugepages_1gi=0)
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0]
    assert nodes.report(alloc.node_id, alloc.id, cdi_devices=[f"bcd.dev/gpu={d}" for d in alloc.device_ids],
                        cgroup_parent=f"bcd-alloc-{alloc.id}.slice") == "stored"
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert active.binding.attested and active.binding.cgroup_parent == ""


def test_booking_repair_moves_the_host_resources_with_the_devices(clock: tuple[ServerThread, Client]) -> None:
    server, root = clock
    world = make_world(server.endpoint, root, server.conninfo)
    try:
        first = host_world(world, server)[0]
        world.quota(100, "vcpu")
        start = clock_now(world) + HOUR
        r = world.create(count=1, start=start, duration="1h", resources=resources(vcpu=20))
        assert r.state == "placed" and r.allocations[0].node_id == first.id
        second = host_node(world, server)
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=first.id, state="cordoned"))
        world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=45 * MIN + 1000))
        repaired = eventually(world, r.id, lambda x: "reservation.repaired" in event_types(world, r.id))
        assert repaired.state == "placed" and [a.node_id for a in repaired.allocations if a.state == "placed"] == [
            second.id]
        booked = world.sql("SELECT a.node_id, h.resource, h.amount, epoch_ms(lower(h.during)), epoch_ms(upper(h.during))"
                           " FROM host_bookings h JOIN allocations a ON a.id = h.allocation_id"
                           " WHERE a.reservation_id = %s AND a.state = 'placed' ORDER BY 2", (r.id,))
        assert [(n, res, int(v), lo, hi) for n, res, v, lo, hi in booked] == [
            (second.id, "memoryGiB", 64, start, start + HOUR), (second.id, "vcpu", 20, start, start + HOUR)]
        assert world.sql("SELECT count(*) FROM host_bookings WHERE node_id = %s", (first.id,)) == [(0,)]
        # The quota charge is kept as it was: 12 vCPUs above the share.
        assert dict(world.sql("SELECT resource, amount FROM quota_charges WHERE reservation_id = %s"
                              " AND refunded_at IS NULL AND resource = 'vcpu'", (r.id,))) == {"vcpu": 12}
    finally:
        world.close()


# "A report that fails the check never counts": an AllocationFailed the node never signed (a
# compromised gateway's word) neither places the reservation again nor counts as a failure.

def test_an_unsigned_allocation_failed_never_counts(world: World) -> None:

    nodes = SigningNodes(world)
    r = world.create(count=1, duration="2h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0]
    body = node_pb2.Report(node_id=alloc.node_id, sequence=1, time=int(time.time() * 1000))
    body.failed.CopyFrom(node_pb2.AllocationFailed(allocation_id=alloc.id, reason="device-missing"))
    world.sql("INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)"
              " VALUES (%s, %s, 'failed', %s, '', '')", (alloc.node_id, alloc.id, body.SerializeToString()))
    world.sql("SELECT wake_reservation(%s)", (r.id,))
    [data] = poll(lambda: [d for (d,) in world.sql(
        "SELECT data FROM events WHERE subject = %s AND type = 'reservation.binding-rejected'",
        (f"reservation/{r.id}",))], what="binding-rejected")
    assert (data["allocationId"], data["nodeId"], data["reason"]) == (alloc.id, alloc.node_id, "unsigned report")
    current = get(world, r.id)
    assert current.state == "binding" and [(a.id, a.state) for a in current.allocations] == [(alloc.id, "binding")]
    assert world.sql("SELECT bind_failures FROM reservations WHERE id = %s", (r.id,)) == [(0,)]
    assert nodes.activate(r.id).allocations[0].id == alloc.id


# "IAM sees vcpu and memoryGiB (summed over a gang) as attributes of the reservation", also when
# it decides on the reservation's extension (extend "is admitted like a create").

def test_iam_sees_vcpu_and_memory_when_it_decides_an_extend(world: World, server: ServerThread) -> None:
    host_world(world, server)
    world.quota(1000, "vcpu")
    world.quota(1000, "memoryGiB")
    world.policy("permit(principal, action, resource) when { resource.vcpu <= 20 && resource.memoryGiB <= 200 };")
    try:
        r = world.create(count=1, resources=resources(vcpu=20, memory_gib=100), start=world.later(2))
        assert r.state == "placed"
        out = world.user.res("Extend", pb.ExtendReservationRequest(
            tenant_id=world.tenant, reservation_id=r.id, by="1h", idempotency_key="more"))
        assert out.extended and out.reservation.during.end == r.during.end + HOUR
        world.policy("permit(principal, action, resource) when { resource.vcpu < 20 };")
        code, reason, _ = refused(world.user.res, "Extend", pb.ExtendReservationRequest(
            tenant_id=world.tenant, reservation_id=r.id, by="1h", idempotency_key="again"))
        assert reason == "ACCESS_DENIED"
    finally:
        world.policy(PERMISSIVE)


# "At the start the reservation moves to binding and the node's desired state gains a devices
# assignment per allocation (allocationId, deviceIds, and until, the booking's end)", and "the
# booked resources become the assignment's limits: cpu_millis from vcpu, memory_bytes from
# memoryGiB, hugepages_1gi".

def test_at_the_start_the_nodes_desired_state_gains_the_assignment_with_its_limits(
        clock: tuple[ServerThread, Client]) -> None:
    from tests.promise_support import desired_state

    server, root = clock
    world = make_world(server.endpoint, root, server.conninfo)
    try:
        node = host_world(world, server)[0]
        world.quota(100, "vcpu")
        world.quota(100, "memoryGiB")
        start = clock_now(world) + HOUR
        r = world.create(count=2, start=start, duration="2h", resources=resources(vcpu=20, hugepages_1gi=3))
        assert r.state == "placed"
        alloc = r.allocations[0]
        assert alloc.id not in [a.allocation_id for a in desired_state(world, node.id).assignments]
        world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=HOUR))
        binding = eventually(world, r.id, lambda x: x.state == "binding")
        assert "reservation.binding" in event_types(world, r.id)
        [assignment] = [a for a in desired_state(world, node.id).assignments if a.allocation_id == alloc.id]
        assert sorted(assignment.device_ids) == sorted(binding.allocations[0].device_ids)
        assert assignment.until == start + 2 * HOUR and assignment.binding == node_pb2.BINDING_HOLD
        limits = assignment.limits
        assert (limits.cpu_millis, limits.memory_bytes, limits.hugepages_1gi) == (20_000, 128 << 30, 3)
    finally:
        world.close()


# "better-compute reserve and better-compute capacity --preview take --cpus (0 to 4096) and
# --memory (GiB, 0 to 65,536), sent as resources" (reserve's flags: tests/test_host_resources.py).

def test_capacity_preview_takes_cpus_and_memory_within_their_ranges(cli, world: World, server: ServerThread) -> None:  # noqa: F811
    host_world(world, server)  # 8 vCPUs and 64 GiB per GPU
    out = cli("capacity", "--preview", "--gpus", "2", "--cpus", "20", "--memory", "200").json
    assert out["fits"] and (out["resources"]["vcpu"], out["resources"]["memoryGiB"]) == (20, 200)
    out = cli("capacity", "--preview", "--gpus", "2", "--memory", "0").json  # the share for the rest
    assert out["fits"] and (out["resources"]["vcpu"], out["resources"]["memoryGiB"]) == (16, 128)
    for flag, value in (("--cpus", "4097"), ("--memory", "65537"), ("--cpus", "-1"), ("--memory", "lots")):
        run = cli("capacity", "--preview", "--gpus", "1", flag, value)
        assert run.code == 2 and flag in run.err, (flag, value, run)
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,)) == [(0,)]


# The same host-resource rules with the capacity index off (BC_PLACEMENT_INDEX=off): the SQL
# shortlist, the SQL share and the preview's diagnostics serve them too.

@pytest.fixture(scope="module")
def sql_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, placement_index=False)


def sql_host_node(world: World, *, vcpu: int, memory: int, label: str | None) -> apb.Node:
    name = f"s{len(world.nodes):03d}-{world.tenant[-6:]}"
    node = world.add_node(gpus(name, 8), name=name)
    world.sql("INSERT INTO host_resources (node_id, resource, allocatable) VALUES"
              " (%(n)s, 'vcpu', %(v)s), (%(n)s, 'memoryGiB', %(m)s)", {"n": node.id, "v": vcpu, "m": memory})
    if label is not None:
        world.sql("UPDATE nodes SET labels = labels || jsonb_build_object(%s::text, "
                  "jsonb_build_object('value', 'true', 'source', %s::text)) WHERE id = %s", (LIMITS_LABEL, label, node.id))
    return node


def test_without_the_capacity_index_the_share_and_the_limits_label_hold_too(
        sql_stack: tuple[ServerThread, Client]) -> None:
    server, root = sql_stack
    assert server.app.runtime.capacity is None
    world = make_world(server.endpoint, root, server.conninfo)
    try:
        for plain in world.nodes:
            world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=plain.id, state="cordoned"))
        operator_only = sql_host_node(world, vcpu=66, memory=512, label="operator")
        sick = world.sql("SELECT device_uuid FROM atoms WHERE node_id = %s AND kind = 'gpu' ORDER BY 1 LIMIT 1",
                         (operator_only.id,))[0][0]
        world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=operator_only.id, device_uuid=sick,
                                                                 health="unhealthy"))
        waiting = world.create(count=3)
        assert waiting.state == "pending" and waiting.host_share == resources(vcpu=24, memory_gib=192)
        out = preview(world, count=3)
        assert not out.fits and (out.resources.vcpu, out.resources.memory_gib) == (24, 192)
        assert [(f.filter, f.nodes, f.reason) for f in out.filters if f.filter != "state"] == [
            ("labels", 1, f"needs label {LIMITS_LABEL}=*")]
        capable = sql_host_node(world, vcpu=66, memory=512, label="system")
        out = preview(world, count=3)
        assert out.fits and [m.node_id for m in out.members] == [capable.id]
        placed = world.create(count=3)
        assert placed.state == "placed" and placed.allocations[0].node_id == capable.id
        assert host_bookings(world, placed.id) == {"vcpu": 24, "memoryGiB": 192}
        retried(world)
        moved = eventually(world, waiting.id, lambda x: x.state != "pending")
        assert moved.allocations[-1].node_id == capable.id
    finally:
        world.close()
