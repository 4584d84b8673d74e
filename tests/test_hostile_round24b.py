"""Hostile review, round 24b: bindings, host resources, capacity preview and the MCP/CLI surfaces
(real control plane on loopback, embedded PostgreSQL; a node's Hello and inventory applied by
controlplane.nodes.inventory, the functions the gateway calls for them). The first three tests
reproduced broken promises, fixed since (BookingRepair's BAD_NODES also finds a node that no
longer carries a capability label the request needs, placing.required_labels; a node's NUMA
cpulists are read together within one list's bounds, cpulist.parse_all, and parsed once per
desired-state read, hosts.NumaFacts); the last guards what held.

- **A daemon downgraded after placement gets the booking anyway.** The capability rules ("a
  reservation that books any host resource ... places only on nodes with the system label
  bc.dev/cap.devices.limits"; kubernetes "places only on nodes whose bcd advertises the
  binding.kubernetes capability ... an older bcd drops BINDING_KUBERNETES, and its GPUs would
  never reach the kubelet") are checked when a booking is planned and committed, never again. A
  calendar reservation placed on a capable node whose daemon then says Hello without the
  capability (its system label is gone) passes BookingRepair at start - 15 min and at the start
  (repair.bad_nodes / binding_queries.BAD_NODES look only at node state, connectivity and atom health)
  and moves to binding there, while another capable node is free: a hold booking the per-GPU
  share is handed to a bcd that drops DeviceAssignment.limits and runs it unbounded ("so booked
  GPUs never run a workload without CPU and memory limits while the same CPU and memory are sold
  again"), and a kubernetes binding to a bcd whose kubelet never sees the GPUs.
- **Cpulists within their bounds still stall the gateway.** Each NUMA cpulist is read within the
  spec's bounds (CPU ids up to 8191, 32 KiB, 4096 parts) "so an oversized list cannot stall the
  control plane", and the gateway caps an inventory at 256 NUMA nodes, but nothing bounds what
  they add up to: 256 lists of 3,000 parts each (3.7 MB, inside gRPC's 4 MiB) cost about a second
  of the gateway's event loop to store (inventory_json normalises each), and nodes/hosts.cpuset
  parses every one of them again for each pinned hold whenever the node's desired state is read
  (desired.read, on every session open and every allocation change): about 0.75 s per hold,
  during which no other node's session is served.

Tried and held. Run: a tenant the pool is only offered to booking binding kubernetes through
create, capacity.preview, a gang, a spot request and start 'earliest' (INVALID_INPUT `binding`, no
row; kept as the last test, since only create was covered before). Read in the code and covered by
existing tests (test_spec_audit_bindings, test_host_resources, test_reports, test_hostile_share):
an operator label bc.dev/cap.binding.kubernetes or bc.dev/cap.devices.limits (source operator) in a
pending retry, a repair's placement, a preemption and a lease batch (the required label is matched
with its source wherever an Ask is built: placing.ask_for); a capability dropped between plan and
commit (PLACE_INLINE, INSERT_PLACEMENT and INSERT_BATCH re-read labels under the lock); a
cgroupParent naming another allocation's slice, or reported for a kubernetes binding or a hold
without limits (dropped: reports._binding); resources below the share or {} (raised), the excess
above an empty share charged (a missing quota row grants 0), gang sums in quota and IAM, resources
at and beyond 4096/65536 (limits fit their fields; beyond is INVALID_INPUT); preview against create
(the same validate_create, resolve_request and plan_for; the model pinning and quota that only
create does change no fit); what preview answers before IAM is pool policy, which create tells too;
earliest-fit and preemption searches bounded by their budgets; the MCP tools (tenant fixed by the
connection, waitSeconds NaN or negative read as 0 and infinite a usage error, a held request resent
as held under its key, a held extend only for its own reservation).

Noticed in the code, not run nor kept as a test (it is the spec's own formula): one GPU host whose inventory gives 0 vCPUs
per GPU (say 256 GPUs and 3 vCPUs, or a vcpus figure beyond the bound, read as 0) makes the
smallest share, and so every new reservation's share in the pool, 0 vCPUs: those holds get no CPU
limit on any node, while the spec's floor is meant to prevent exactly that.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from bettercompute.node.v1 import node_pb2 as npb
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.nodes import cpulist, desired, inventory
from tests.support import Client, ServerThread, World, clock_now, eventually, gpus, make_world, refused
from tests.test_host_resources import LIMITS_LABEL, host_world
from tests.test_pki import arun

MIN = 60_000
GIB = 1 << 30
KUBERNETES_LABEL = "bc.dev/cap.binding.kubernetes"
GRPC_MAX_MESSAGE = 4 * 1024 * 1024  # the gateway's sessions take gRPC's default


def downgraded(world: World, node_id: str) -> None:
    """The node's daemon says Hello again as an older bcd: no capabilities (the gateway applies a
    Hello with this very function)."""
    arun(world.conninfo, lambda pool: inventory.apply_hello(
        pool, node_id, npb.Hello(daemon_version="bcd-older")))


def live_nodes(r: pb.Reservation) -> set[str]:
    return {a.node_id for a in r.allocations if a.state in ("placed", "binding", "bound")}


def through_the_start(world: World, rid: str, start: int) -> pb.Reservation:
    """The clock to 15 minutes before the start (BookingRepair's first check), then to the start;
    the reservation once it has left `placed` (binding, or pending when nothing fits)."""
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=start - 15 * MIN + 1000 - clock_now(world)))
    time.sleep(1)  # the worker's pass at start - 15 min
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=start + 1000 - clock_now(world)))
    return eventually(world, rid, lambda x: x.state != "placed")


# -- a daemon downgraded between placement and start ------------------------------------------


def test_a_hold_booking_host_resources_never_binds_on_a_daemon_that_stopped_enforcing_limits(
        clock_world: World, clock_stack: tuple[ServerThread, Client]) -> None:
    """Placed on a node whose daemon enforces limits; that daemon is replaced by an older one
    before the start (its Hello advertises no devices.limits, so the system label goes). At the
    start the hold is handed to it anyway, with its limits, which that daemon drops: the share's
    CPUs and memory run unbounded. The other node, whose daemon enforces them, was free."""
    world, server = clock_world, clock_stack[0]
    host_world(world, server, nodes=2)
    start = clock_now(world) + 60 * MIN
    r = world.create(count=1, start=start, duration="1h")  # books the pool's per-GPU share
    assert r.state == "placed" and r.request.resources.vcpu > 0
    (old,) = live_nodes(r)
    downgraded(world, old)
    assert LIMITS_LABEL not in world.sql("SELECT labels FROM nodes WHERE id = %s", (old,))[0][0]
    spare = [n for (n,) in world.sql("SELECT id FROM nodes WHERE pool_id = %s AND state = 'ready' AND id <> %s",
                                     (world.pool_id, old))]
    assert len(spare) == 1  # the other node: ready, labelled, nothing booked

    moved = through_the_start(world, r.id, start)
    assert old not in live_nodes(moved), (
        f"{moved.state} on {old}, whose daemon no longer enforces limits (spare {spare[0]} was free)")


def test_a_kubernetes_binding_never_binds_on_a_daemon_that_stopped_advertising_it(clock_world: World) -> None:
    """The same for the kubernetes binding: placed on a node whose bcd advertised
    binding.kubernetes, then that bcd is downgraded before the start. At the start the
    BINDING_KUBERNETES assignment goes to it anyway (an older bcd drops it, and the kubelet never
    gets the GPUs), though another capable node was free."""
    world = clock_world
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="k8s", region="eu-1",
        policy=apb.PoolPolicy(kubernetes=True, per_gpu=apb.PerGpuShare(vcpu=0, memory_gib=0)))).id
    for i in range(2):
        name = f"k{i}-{world.tenant[-6:]}"
        world.add_node(gpus(name), name=name, system_labels={KUBERNETES_LABEL: "true"})
    start = clock_now(world) + 60 * MIN
    r = world.create(count=8, start=start, duration="1h", binding="kubernetes")
    assert r.state == "placed"
    (old,) = live_nodes(r)
    downgraded(world, old)
    assert KUBERNETES_LABEL not in world.sql("SELECT labels FROM nodes WHERE id = %s", (old,))[0][0]

    moved = through_the_start(world, r.id, start)
    assert old not in live_nodes(moved), f"{moved.state} on {old}, whose daemon no longer serves the binding"


# -- cpulists within bounds, many of them -------------------------------------------------------


def test_cpulists_within_their_bounds_never_stall_the_gateways_loop(world: World, server: ServerThread) -> None:
    """An inventory the gateway takes (256 NUMA nodes, each cpulist within every bound, 3.7 MB in
    all) and four holds pinned on that node: storing the inventory, and reading the node's
    desired state as a session does, each block the event loop they run on (the gateway's, shared
    by every node session) for about a second, and the read longer with every pinned hold."""
    for n in world.nodes:
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=n.id, state="cordoned"))
    name = f"numa-{world.tenant[-6:]}"
    devices = gpus(name, 8)
    node = world.add_node(devices, name=name, system_labels={LIMITS_LABEL: "true"})
    lists = ",".join(str(i) for i in range(0, 6000, 2))  # 3,000 parts, 15 KB: within every bound
    assert len(cpulist.parse(lists)) == 3000
    inv = npb.Inventory(
        generation=1, vcpus=66, memory_bytes=512 * GIB, isolated_cpus=lists,
        gpus=[npb.Gpu(uuid=g.uuid, model=g.model, memory_mib=g.memory_mib, numa_node=g.numa_node) for g in devices],
        numa_nodes=[npb.NumaNode(id=i, cpulist=lists, memory_bytes=2 * GIB) for i in range(256)])
    assert len(npb.NodeMessage(inventory=inv).SerializeToString()) < GRPC_MAX_MESSAGE

    async def longest_stall(pool, work) -> float:
        """The longest the event loop went without running a 10 ms ticker while `work` ran."""
        gaps: list[float] = []
        done = asyncio.Event()
        ticker = asyncio.create_task(_ticker(gaps, done))
        await asyncio.sleep(0.05)
        await work(pool)
        done.set()
        await ticker
        return max(gaps)

    stored = arun(world.conninfo, lambda pool: longest_stall(
        pool, lambda p: inventory.apply_inventory(p, node.id, inv)))
    server.call(server.app.runtime.capacity.barrier())
    holds = [world.create(count=1) for _ in range(4)]  # each books the share: pinned to its NUMA node
    for r in holds:
        assert r.request.resources.vcpu > 0
        eventually(world, r.id, lambda x: x.state in ("binding", "active"))
    read = arun(world.conninfo, lambda pool: longest_stall(pool, lambda p: desired.read(p, node.id)))
    assert stored < 0.5 and read < 0.5, (
        f"the event loop stalled {stored:.2f} s storing the inventory and {read:.2f} s reading the desired state")


async def _ticker(gaps: list[float], done: asyncio.Event) -> None:
    last = time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


# -- held: a tenant the pool is only offered to never books kubernetes --------------------------


def test_a_guest_books_no_kubernetes_binding_by_preview_gang_spot_or_earliest(world: World) -> None:
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="k8s", region="eu-1", policy=apb.PoolPolicy(kubernetes=True))).id
    for i in range(2):
        name = f"g{i}-{world.tenant[-6:]}"
        world.add_node(gpus(name), name=name, system_labels={KUBERNETES_LABEL: "true"})
    guest = make_world(world.endpoint, world.root, world.conninfo, nodes=0)
    try:
        world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
        preview = capacity_pb2_grpc.CapacityStub(guest.user.channel).Preview
        asks = [guest.create_request(count=1, binding="kubernetes", pool_id=world.pool_id, **kw) for kw in (
            {}, {"gang": pb.Gang(size=2)}, {"spot": True}, {"start_earliest": True})]
        for req in asks:
            for got in (refused(guest.user.res, "Create", req),
                        refused(preview, req, metadata=guest.user.metadata, timeout=30)):
                assert got[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT") and got[2]["field"] == "binding"
        assert guest.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (guest.tenant,)) == [(0,)]
        assert world.create(count=1, binding="kubernetes").state == "placed"  # not vacuous: the owner may
    finally:
        guest.close()
