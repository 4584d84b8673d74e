"""Hostile review, round 25a: a node playing inventory games (its Hello and inventory applied by
controlplane.nodes.inventory, the functions the gateway calls for them, or sent through the real
gateway over mutual TLS; real control plane on loopback, embedded PostgreSQL). The first seven tests
reproduced four broken promises, fixed since; the last guards what held.

- **BookingRepair kept a booking whose shape the node's inventory changed since placement.**
  BAD_NODES (reservations/queries.py) looked at node state, connectivity, capability labels and
  the booked atoms' health and bookable, never at what an inventory changes in place on the same
  atoms (nodes/queries.py UPSERT_GPU, UPSERT_CHILDREN) or in the node's `fabric.domain` label
  (inventory.fabric_label). A calendar `nvlink-all` booking whose node then reported its GPUs in
  two cliques, a model-pinned booking whose node then called its GPUs another model, and a gang
  member whose inventory moved it into another NVLink fabric all bound at the start as placed,
  with a fitting node free: nvlink-all across two domains, A100s under an H100 charge and
  decision, a gang across two fabrics ("all on the same high-speed fabric, or none at all").
  Fixed: BAD_NODES also finds a placed allocation whose atoms fail `atoms_as_asked` (the commit's
  own check, migration 0063) and a gang member whose label no longer has its `gang_group` value,
  so BookingRepair moves it (a gang member within its label value first).
- **A tenant with root on a leased machine takes other machines' GPUs.** A GPU uuid is one
  node's: the first node to report it holds it until its inventory drops it (gpu_holders,
  inventory.held). A leased machine's inventory is its tenant's word, and a tenant knows the
  uuids of GPUs it booked elsewhere (its bindings name them). A platform node's GPU missing from
  one inventory (fallen off the bus) was taken by the leased machine at once, and the platform
  node's next inventory was refused it ("held by another node") for as long as the tenant liked,
  beyond the lease until the machine enrolled anew; the machine's own GPUs it dropped were let go
  of for anyone to claim; each inventory flipping its GPUs' MIG mode rewrote its atoms under the
  pool's lock. Fixed: while a node is `leased` its inventory changes no GPU hold, atom or
  `fabric.domain` (inventory._apply_inventory stores only the rest: its disk, which metal judges,
  and its sizes, which the host share leaves out while leased). A new GPU on a leased machine
  therefore gets no atom instead of joining the lease (docs/decisions.md;
  tests/test_hostile_metal.py and test_hostile_leftovers_node.py adjusted).
- **A wiped machine's last inventory, its tenant's word, counts once the machine is back.**
  docs/decisions.md: a leased machine is left out of the pool's per-GPU host share and "counts
  again once it is the platform's (wiped and enrolled anew)". metal.deploy._back_to_platform
  returns it to `ready` on the tenant's own "wiped" report, with the inventory the tenant wrote
  (4 GPUs on 3 vCPUs and 1 GiB): every new reservation of the pool got a share of 0 vCPUs and
  0 GiB (no limits) until the machine was enrolled anew, which may be never. Fixed: on the wipe
  the node forgets that inventory and its host rows and is unreachable until its next hello
  (nodes.tenancy.forget_tenants_word, called beside the key revocation).
- **One inventory held its pool's lock for 18 seconds.** atoms.parent_id references atoms(id)
  with no index, so each part DELETE_UNUSED_PARTS deletes (its foreign-key check) and each GPU
  DELETE_UNUSED_GPUS looks at scanned every atom. A node of a time-slice pool at 64 replicas
  reporting its 256 GPUs under fresh uuids (a 7 KB message, far within the gateway's pace of 50 a
  second) replaced 16,640 atoms in 18 s under the pool's lock: one such message every 18 s wedged
  every placement of the pool. Fixed: migration 0065 indexes atoms by parent (about 2 s now).
  Left: that 2 s (16,640 rows written, their capacity triggers, a deferred lease-join check
  each) is still one message's cost at the gateway's one-token price; pacing inventories by the
  atoms they change would bound it, and is not done here.

Tried and held. Run here: a GPU of a node that is offline (session closed, unreachable) stays its
own; another node reporting it is refused, and the node back serves it (kept as the last test).
Read in the code or covered elsewhere: the last round's lead 1, `fabric_label` and `cap_labels`
writing over an operator's label of the same key: an operator cannot set one (RegisterNode refuses
`bc.dev/` and `fabric.domain` operator labels, INVALID_INPUT, tests/test_tenancy_and_errors.py),
and capacity reads `bc.dev/` labels only with source system, so there is no operator label to
overwrite nor a capability an operator could deny; a RegisterNode `system_labels` fabric.domain is
replaced by the node's own NVLink claim once its daemon reports, as "as inventory would report
them" says. Which fabric a node says it is in is its own word (spec 004: an inventory label); it
can move itself into a fabric, and out of one under a placed gang (fixed above). Lead 2: a booked
MIG instance repartitioned away stays booked and unbookable beside up to seven new bookable ones
(tests/test_shared_gpus.py), so a GPU carries more than seven instance atoms; but the gone one is
no longer on the device (a placed booking on it is now repaired before its start, an active one
raises a condition), so no real instance is sold twice; a whole GPU and its parts are never
bookable in one pool (the pool books one class, its sharing mode fixed at creation), and slot
counts follow only the pool's fixed replicas (a GPU taken into MIG mode and back is the same slot
atoms, booked or not). GPU uuids swapped between two nodes: each takes the other's only after the
other's inventory let go of it, so no device ever has two bookable atoms (the node whose GPU left
keeps its booked atom, unbookable). The inventory generation going backwards: it is stored and
read by nothing (the order of one session's messages is the gateway's; a superseded session's
message is never applied, tests/test_hostile_node_round3.py). Host resources shrinking under
booked holds: new bookings are refused by the host_bookings guard, a placed hold binds and is
re-placed by bcd's resources-exhausted failure as the spec says. A node naming a GPU's model or
NUMA node anew in place: new placements check the atoms' shape at commit (migration 0063), placed
ones now at BookingRepair. Capabilities and labels: malformed or reserved-looking capabilities are
dropped (`[a-z0-9][a-z0-9._-]{0,62}`, 64 at most), NVLink cluster/clique only as a LABEL, an
oversized message ends the session. A 3.7 MB inventory of NUMA cpulists is stored as a 44 KB one
(cpulist.parse_all's budget), so the desired state's per-row copy of it costs nothing (8 pinned
holds read in 65 ms).

Noticed and left: a GPU a node reports under a fresh uuid is a new, healthy atom, so renaming a
quarantined GPU lifts its quarantine (the control plane cannot tell a rename from a replacement).
"""

from __future__ import annotations

import time

from bettercompute.node.v1 import node_pb2 as npb
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.nodes import inventory
from tests.nodes_support import ControlPlane
from tests.support import World, clock_now, eventually, gpus
from tests.test_gateway import (GatewayThread, connected, cp, enrolled, gateway, hello, node_row, pool_id,  # noqa: F401
                                eventually as eventually_true)
from tests.test_hostile_leftovers_node import gpu_atoms, inventory as node_inventory, say
from tests.test_hostile_round24b import live_nodes, through_the_start
from tests.test_pki import arun
from tests.test_shared_gpus import _mig_inventory, shared_pool

MIN = 60_000
MODEL = "H100-SXM5-80GB"
FABRIC = "fabric.domain"


def says(world: World, node_id: str, devices: list[apb.Gpu], *, cluster: str = "", cliques: list[str] | None = None,
         model: str = "", generation: int = 1) -> None:
    """The node's daemon reports these GPUs (the gateway applies an inventory with this very
    function): in NVLink fabric `cluster`, GPU i in clique `cliques[i]`, all of model `model`
    when given."""
    inv = npb.Inventory(generation=generation, gpus=[
        npb.Gpu(uuid=g.uuid, model=model or g.model, memory_mib=g.memory_mib, numa_node=g.numa_node,
                nvlink_cluster=cluster, nvlink_clique=cliques[i] if cliques else "")
        for i, g in enumerate(devices)])
    arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node_id, inv))




def booked_domains(world: World, rid: str) -> list[tuple[str, str]]:
    """(node, NVLink domain) of the atoms the reservation's live allocations book."""
    return world.sql(
        "SELECT DISTINCT at.node_id, at.nvlink_domain FROM allocations al JOIN bookings b ON b.allocation_id = al.id"
        " JOIN atoms at ON at.id = b.atom_id WHERE al.reservation_id = %s"
        " AND al.state IN ('placed', 'binding', 'bound') ORDER BY 1, 2", (rid,))


# -- a node's shape changed under a calendar booking ------------------------------------------


def test_an_nvlink_all_booking_never_binds_on_gpus_the_node_regrouped_into_two_domains(clock_world: World) -> None:
    """Placed for the start on eight GPUs of one NVLink domain; before the start the node reports
    them in two cliques. At the start the reservation binds on GPUs of two domains, though the
    other node's eight were free in one."""
    world = clock_world
    start = clock_now(world) + 60 * MIN
    r = world.create(count=8, topology="nvlink-all", start=start)
    assert r.state == "placed"
    (old,) = live_nodes(r)
    node = next(n for n in world.nodes if n.id == old)
    says(world, old, gpus(node.name), cluster=node.name, cliques=["a"] * 4 + ["b"] * 4)
    assert len({d for _, d in booked_domains(world, r.id)}) == 2

    moved = through_the_start(world, r.id, start)
    domains = booked_domains(world, r.id)
    assert len({d for _, d in domains}) == 1 and old not in live_nodes(moved), (
        f"{moved.state} on {domains}: nvlink-all across two NVLink domains")


def test_a_model_pinned_booking_never_binds_on_gpus_the_node_now_calls_another_model(clock_world: World) -> None:
    """Placed for the start on H100s (charged and decided as such); before the start the node
    reports its GPUs as another model. At the start it binds there, though H100s were free."""
    world = clock_world
    start = clock_now(world) + 60 * MIN
    r = world.create(count=8, model=MODEL, start=start)
    assert r.state == "placed"
    (old,) = live_nodes(r)
    node = next(n for n in world.nodes if n.id == old)
    says(world, old, gpus(node.name), model="A100-SXM4-40GB")

    moved = through_the_start(world, r.id, start)
    models = world.sql("SELECT DISTINCT at.model FROM allocations al JOIN bookings b ON b.allocation_id = al.id"
                       " JOIN atoms at ON at.id = b.atom_id WHERE al.reservation_id = %s"
                       " AND al.state IN ('placed', 'binding', 'bound')", (r.id,))
    assert models == [(MODEL,)], f"{moved.state} on {models} for a {MODEL} request"


def test_a_gang_member_that_moved_itself_to_another_fabric_is_replaced_before_the_start(clock_world: World) -> None:
    """A gang of two placed for the start in one fabric.domain; before the start one member's
    inventory puts its GPUs in another NVLink fabric (its system label fabric.domain follows). At
    the start the gang binds across two fabrics, though a third node of the first was free."""
    world = clock_world
    for n in list(world.nodes):
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=n.id, state="cordoned"))
    members = []
    for i in range(3):
        name = f"f{i}-{world.tenant[-6:]}"
        members.append(world.add_node(gpus(name), name=name, system_labels={FABRIC: "fab-1"}))
    start = clock_now(world) + 60 * MIN
    r = world.create(count=8, start=start, gang=pb.Gang(size=2, topology_key=FABRIC))
    assert r.state == "placed" and len(live_nodes(r)) == 2
    moved_node = next(n for n in members if n.id in live_nodes(r))
    says(world, moved_node.id, gpus(moved_node.name), cluster="fab-2", cliques=["0"] * 8)
    assert world.sql("SELECT labels->%s->>'value' FROM nodes WHERE id = %s", (FABRIC, moved_node.id)) == [("fab-2/0",)]

    moved = through_the_start(world, r.id, start)
    fabrics = world.sql("SELECT DISTINCT n.labels->%s->>'value' FROM allocations al JOIN nodes n ON n.id = al.node_id"
                        " WHERE al.reservation_id = %s AND al.state IN ('placed', 'binding', 'bound')", (FABRIC, r.id))
    assert fabrics == [("fab-1",)], f"{moved.state}: the gang's members are in fabrics {fabrics}"


def test_a_profile_pinned_mig_booking_moves_off_an_instance_repartitioned_to_another_profile(
        clock_world: World) -> None:
    """A MIG instance index reported again with another profile is the same atom with the new
    profile (docs/decisions.md, "MIG and shared GPUs"): a 3g.40gb booking for the start, whose
    instance the node then reports as 4g.40gb, moves to a 3g.40gb instance still free."""
    world = clock_world
    shared_pool(world, "mig", nodes=0)
    node = world.add_node(gpus("mig-node", count=2))
    first, second = (g.uuid for g in gpus("mig-node", count=2))
    apply = lambda inv: arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, inv))  # noqa: E731
    apply(_mig_inventory(1, {first: [(1, "3g.40gb")], second: [(1, "3g.40gb")]}))
    start = clock_now(world) + 60 * MIN
    r = world.create(device_class="gpu.mig", count=1, profile="3g.40gb", start=start)
    assert r.state == "placed"
    (booked,) = r.allocations[0].device_ids
    layout = {first: [(1, "3g.40gb")], second: [(1, "3g.40gb")]}
    layout[booked.split(":")[0]] = [(1, "4g.40gb")]
    apply(_mig_inventory(2, layout))

    moved = through_the_start(world, r.id, start)
    profiles = world.sql("SELECT at.device_uuid, at.profile FROM allocations al JOIN bookings b ON b.allocation_id = al.id"
                         " JOIN atoms at ON at.id = b.atom_id WHERE al.reservation_id = %s"
                         " AND al.state IN ('placed', 'binding', 'bound')", (r.id,))
    assert [p for _, p in profiles] == ["3g.40gb"], f"{moved.state} on {profiles} for a 3g.40gb request"


# -- a tenant with root on a leased machine and the GPUs of other machines ----------------------


def test_a_leased_machine_never_takes_a_gpu_another_machine_let_go_of_for_a_moment(
        gateway: GatewayThread, pool_id: str, cp: ControlPlane) -> None:
    """A GPU uuid is one node's: the first to report it holds it until its inventory drops it.
    A tenant with root on a leased machine writes that machine's inventory (it knows the uuids of
    GPUs it booked elsewhere: they are in its bindings). Platform node X's GPU falls off the bus
    for one inventory; the leased machine reports it at once and holds it, and when the GPU is
    back X's inventory is refused it ("held by another node"): the platform loses the GPU for as
    long as the tenant likes, and the tenant's lease gains an atom of another machine's GPU. Its
    own GPUs, dropped from its inventory, are let go of, so another machine can squat them too.
    And each inventory flipping its GPUs' MIG mode rewrites its atoms under the pool's lock."""
    from tests.test_hostile_metal import CAPS, metal_pool, node_lease, node_state
    from tests.test_node_profiles import register

    x, x_session = connected(gateway, pool_id, "x", gpus=2, uuid="GPU-x")
    metal_pool(cp.world)
    m1, m1_session = connected(gateway, cp.world.pool_id, "m1", gpus=4, caps=CAPS, uuid="GPU-m1")
    r = node_lease(cp.world, register(cp.world.root, 1), duration="4h")
    cp.drain()
    assert node_state(cp.world, m1.node_id) == "leased"
    mine = [f"GPU-m1-{i}" for i in range(4)]

    say(gateway.conninfo, x.node_id, x_session, node_inventory(2, "GPU-x-0"))  # GPU-x-1 fell off the bus
    say(gateway.conninfo, m1.node_id, m1_session, node_inventory(2, *mine[:3], "GPU-x-1"))  # the tenant
    say(gateway.conninfo, x.node_id, x_session, node_inventory(3, "GPU-x-0", "GPU-x-1"))  # back
    assert gpu_atoms(gateway.conninfo, x.node_id) == {"GPU-x-0": True, "GPU-x-1": True}, (
        f"X's GPU refused: {node_row(gateway.conninfo, x.node_id)['inventory'].get('refused_gpus')}")
    assert "GPU-x-1" not in gpu_atoms(gateway.conninfo, m1.node_id)
    # the machine's own GPU it dropped (GPU-m1-3) is still its: another node's claim is refused
    say(gateway.conninfo, x.node_id, x_session, node_inventory(4, "GPU-x-0", "GPU-x-1", "GPU-m1-3"))
    assert "GPU-m1-3" not in gpu_atoms(gateway.conninfo, x.node_id)
    # nor does the tenant rewrite the machine's own atoms (each MIG-mode flip of every GPU did,
    # under the pool's lock, at the gateway's pace)
    shape = ("SELECT id, device_uuid, bookable, model, numa_node, nvlink_domain FROM atoms"
             " WHERE node_id = %s ORDER BY id")
    before = cp.world.sql(shape, (m1.node_id,))
    say(gateway.conninfo, m1.node_id, m1_session, node_inventory(5, *mine, mig=True))
    assert cp.world.sql(shape, (m1.node_id,)) == before
    assert cp.get(r.id).state == "binding"
    x_session.close()
    m1_session.close()


def test_a_wiped_machines_last_inventory_never_shrinks_the_pools_host_share(
        gateway: GatewayThread, cp: ControlPlane) -> None:
    """"A machine counts again once it is the platform's (wiped and enrolled anew)"
    (docs/decisions.md): while leased, its tenant's inventory (4 GPUs on 3 vCPUs and 1 GiB) is
    left out of the pool's per-GPU host share. The tenant then reports the machine wiped, in that
    same lying inventory: the machine is the platform's again (ready, every key revoked) and its
    tenant-written sizes count at once, so every new reservation of the pool gets a share of 0
    vCPUs until the machine is enrolled anew, which may be never."""
    from tests.test_hostile_leftovers_node import two_metal_machines
    from tests.test_hostile_metal import CAPS, deployed, node_lease, node_state
    from tests.test_node_profiles import register

    machines = two_metal_machines(gateway, cp)
    before = cp.create(count=1).host_share
    assert before.vcpu > 0 and before.memory_gib > 0
    r = node_lease(cp.world, register(cp.world.root, 1), duration="4h")
    cp.drain()
    (alloc,) = cp.get(r.id).allocations
    name, _, session = machines[alloc.node_id]
    deployed(cp.world, session, gateway, alloc.node_id, alloc.id, 2)  # the tenant has root from here
    cp.drain()
    assert cp.get(r.id).state == "active"
    cp.world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=cp.world.tenant, reservation_id=r.id))
    cp.drain()
    assert node_state(cp.world, alloc.node_id) == "leased"
    lying = node_inventory(3, *(f"GPU-{name}-{i}" for i in range(4)))
    lying.vcpus, lying.memory_bytes, lying.numa_nodes[0].cpulist = 3, 1 << 30, "0-2"
    lying.numa_nodes[0].memory_bytes = 1 << 30
    lying.deployed.CopyFrom(npb.DeployedProfile(allocation_id=alloc.id, state="wiped"))
    say(gateway.conninfo, alloc.node_id, session, lying)
    cp.drain()
    assert node_state(cp.world, alloc.node_id) == "ready"

    after = cp.create(count=1).host_share
    assert (after.vcpu, after.memory_gib) == (before.vcpu, before.memory_gib), (
        f"the share went from {before} to {after} on the wiped machine's last (its tenant's) inventory")
    # enrolled anew, the machine reports itself and serves again
    again = enrolled(gateway, cp.world.pool_id, name).session()
    assert again.recv() is not None
    again.send(hello(gpus=4, caps=CAPS, uuid=f"GPU-{name}"))
    eventually_true(lambda: node_row(gateway.conninfo, alloc.node_id)["connectivity"] == "connected", what="hello")
    assert dict(cp.world.sql("SELECT resource, allocatable::int FROM host_resources WHERE node_id = %s",
                             (alloc.node_id,)))["vcpu"] == 64
    again.close()
    for _, _, s in machines.values():
        s.close()


# -- what one inventory costs under its pool's lock ------------------------------------------------


def test_an_inventory_of_fresh_uuids_in_a_slot_pool_holds_the_pool_lock_briefly(world: World) -> None:
    """A time-slice pool at 64 replicas; its node reports 256 GPUs (16,640 atoms), then the same
    256 under fresh uuids (a 7 KB message, well within the gateway's pace). The second inventory
    deletes the 16,384 slots and 256 GPUs gone and writes as many new ones, all under the pool's
    lock: it took 18 s (each deleted atom's foreign-key check scanned every atom, there being no
    index on atoms.parent_id), so a node sending one every 18 s wedged every placement of its
    pool. It now costs about what writing them did in the first place."""
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="ts", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="time-slice", replicas=64)))).id
    node = world.add_node([], name=f"big-{world.tenant[-6:]}")
    took = []
    for generation, prefix in enumerate(("A", "B"), 1):
        inv = npb.Inventory(generation=generation, gpus=[npb.Gpu(uuid=f"GPU-{prefix}-{i}", model=MODEL)
                                                         for i in range(256)])
        assert len(inv.SerializeToString()) < 8000
        started = time.perf_counter()
        arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node.id, inv))
        took.append(time.perf_counter() - started)
    assert world.sql("SELECT count(*) FROM atoms WHERE node_id = %s", (node.id,)) == [(256 * 65,)]
    first, swap = took
    assert swap < max(5 * first, 3.0), f"writing the atoms took {first:.2f} s, replacing them {swap:.2f} s"


# -- held -------------------------------------------------------------------------------------------


def test_a_gpu_of_an_offline_node_is_still_its_own(gateway: GatewayThread, pool_id: str, cp: ControlPlane) -> None:
    """Node A's session ends and it is marked unreachable (its machine down, its GPUs booked): B
    reports A's GPU meanwhile and is refused it, so A's GPU never gets a second, bookable atom
    while A is away; A, back, reports it and serves it."""
    from tests.test_hostile_leftovers_node import second

    a, a_session = connected(gateway, pool_id, "a", gpus=2)  # GPU-0, GPU-1
    a_session.close()
    cp.world.sql("UPDATE nodes SET connectivity = 'unreachable' WHERE id = %s", (a.node_id,))
    b, b_session = second(gateway, cp, "b", "GPU-1", "GPU-B0")
    assert gpu_atoms(gateway.conninfo, b.node_id) == {"GPU-B0": True}
    again = a.session()
    assert again.recv() is not None
    again.send(hello(gpus=2))
    eventually_true(lambda: node_row(gateway.conninfo, a.node_id)["connectivity"] == "connected", what="hello")
    assert gpu_atoms(gateway.conninfo, a.node_id) == {"GPU-0": True, "GPU-1": True}
    again.close()
    b_session.close()
