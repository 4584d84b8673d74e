"""A hostile tenant and a hostile node against whole-machine leases (binding "node", gangs of whole
machines), the node's role changes, the metal deploy workflow and the gateway's pacing, through the
real API: a real control plane and a real gateway on loopback, real TLS, raw node sessions that say
what a hostile node would. The reservation worker runs when the test says so (`cp.drain()`), on a
controlled clock."""

from __future__ import annotations

import dataclasses
import time

import grpc

from bettercompute.node.v1 import node_pb2 as npb
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.nodes_support import ControlPlane
from tests.support import World
from gateway.config import GatewaySettings
from tests.test_gateway import (GatewayThread, connected, cp, enrolled, eventually, gateway, hello,  # noqa: F401
                                node_row, pool_id)
from tests.test_node_profiles import register

MINUTE = 60_000
HOUR = 60 * MINUTE
CAPS = ("devices.limits", "binding.node")


def metal_pool(world: World) -> str:
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(tenant_root=True))).id
    return world.pool_id


def node_lease(world: World, profile: str, count: int = 4, **kw) -> pb.Reservation:
    return world.create(count=count, binding="node", node=pb.NodeLease(profile_id=profile), **kw)


def get(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def node_state(world: World, node_id: str) -> str:
    return world.sql("SELECT state FROM nodes WHERE id = %s", (node_id,))[0][0]


def disk(session, gateway, node_id: str, generation: int, state: str, allocation_id: str = "",  # noqa: F811
         profile: str = "", version: int = 1, checksum: str = "", gpus: int = 4) -> None:
    """The node's inventory, saying what is on its disk; waits until the gateway stored it."""
    inventory = hello(gpus=gpus).hello.inventory
    inventory.generation = generation
    inventory.deployed.CopyFrom(npb.DeployedProfile(allocation_id=allocation_id, profile_id=profile, version=version,
                                                    checksum=checksum, state=state))
    session.send(npb.NodeMessage(inventory=inventory))
    eventually(lambda: node_row(gateway.conninfo, node_id)["inventory_generation"] == generation, what="inventory")


def deployed(world: World, session, gateway, node_id: str, allocation_id: str, generation: int) -> None:  # noqa: F811
    """An honest node: the asked profile version deployed for `allocation_id`."""
    [(profile, version, checksum)] = world.sql(
        "SELECT profile_id, version, checksum FROM metal_deploys WHERE allocation_id = %s", (allocation_id,))
    disk(session, gateway, node_id, generation, "deployed", allocation_id, profile, version, checksum)


def advance_to(cp: ControlPlane, at_ms: int) -> None:  # noqa: F811
    now = cp.world.sql("SELECT epoch_ms(compute_now())")[0][0]
    if at_ms > now:
        cp.advance(at_ms - now)
    cp.drain()


# -- a lease starting on a machine another lease still holds ------------------------------------



def two_machines(gateway, world: World) -> dict:  # noqa: ANN001
    """A metal pool of the world's with two connected 4-GPU machines m1 and m2: node id -> session."""
    metal_pool(world)
    world.quota(1000)
    sessions = {}
    for name in ("m1", "m2"):
        node, session = connected(gateway, world.pool_id, name, gpus=4, caps=CAPS, uuid=f"GPU-{name}")
        sessions[node.node_id] = session
    return sessions

def test_a_lease_whose_machine_is_still_leased_at_its_start_never_deploys_there(
        gateway, cp: ControlPlane) -> None:  # noqa: F811
    """Tenant B leases the machine from t; tenant A then leases it for the ten minutes before t
    (free then, so it places). At t - 15 min BookingRepair finds the machine ready; at t - 10 min
    A's lease begins and the machine is A's (root, node-tenant keys A may copy); at t A's lease
    ends, but the machine is not wiped yet. B's start went straight to the deploy, on a machine A
    still held, with A's keys good through B's lease (they are revoked only by the wipe after the
    last lease); with A's deploy still under way, the worker failed on it instead (a unique
    violation, retried until A's two-hour deadline). Now the start checks the machine
    like the check 15 minutes before: B is repaired, here pending for want of another machine."""
    world = cp.world
    metal_pool(world)
    node, session = connected(gateway, world.pool_id, "m1", gpus=4, caps=CAPS)
    profile = register(world.root, 1)
    start = world.later(1)
    b = node_lease(world, profile, start=start, duration="2h")
    _, tenant_a = world.identity()
    a = world.create(tenant_a, count=4, binding="node", node=pb.NodeLease(profile_id=profile),
                     start=start - 10 * MINUTE, duration="10m")
    assert (a.state, b.state) == ("placed", "placed")
    assert a.allocations[0].node_id == b.allocations[0].node_id == node.node_id

    advance_to(cp, start - 15 * MINUTE)
    assert get(world, b.id).state == "placed"  # the machine is still ready: nothing to repair
    advance_to(cp, start - 10 * MINUTE)
    assert get(world, a.id).state == "binding" and node_state(world, node.node_id) == "leased"
    deployed(world, session, gateway, node.node_id, a.allocations[0].id, 2)
    cp.drain()
    assert get(world, a.id).state == "active"

    advance_to(cp, start)
    assert get(world, a.id).state == "released"
    assert node_state(world, node.node_id) == "leased"  # A's machine, not wiped yet
    after = get(world, b.id)
    assert after.state != "binding", "the lease began on a machine another tenant still held"
    assert not world.sql("SELECT 1 FROM metal_deploys WHERE reservation_id = %s", (b.id,))
    assert after.state == "pending" and after.conditions[0].reason == "BookingRepairFailed"
    assert world.sql("SELECT kind, last_error FROM work_items WHERE last_error IS NOT NULL") == []
    cp.check_invariants()
    session.close()


# -- a lease released while its deploy is under way ------------------------------------------------


def test_a_lease_released_before_its_node_said_anything_gives_the_machine_back_at_once(
        gateway, cp: ControlPlane) -> None:  # noqa: F811
    """The tenant's lease began (binding, the machine leased) and the tenant ends it before the node
    reported anything of the deploy. Nothing woke metal's worker: the deploy stayed under way and
    the machine leased, unbookable, until the deploy's two-hour deadline, though the node never ran
    the deploy and has nothing of the tenant's to wipe (a failed gang member's machine already came
    back at once)."""
    world = cp.world
    metal_pool(world)
    node, session = connected(gateway, world.pool_id, "m1", gpus=4, caps=CAPS)
    profile = register(world.root, 1)
    r = node_lease(world, profile, duration="4h")
    cp.drain()
    assert get(world, r.id).state == "binding" and node_state(world, node.node_id) == "leased"
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    cp.drain()
    assert world.sql("SELECT state FROM metal_deploys WHERE reservation_id = %s", (r.id,)) == [("ended",)]
    assert node_state(world, node.node_id) == "ready"
    again = node_lease(world, profile, duration="1h")  # and it is bookable again now
    assert again.state == "placed" and again.allocations[0].node_id == node.node_id
    cp.check_invariants()
    session.close()


def test_a_gang_member_cordoned_in_the_last_minutes_before_the_start_is_replaced_not_deployed(
        gateway, cp: ControlPlane) -> None:  # noqa: F811
    """A gang of two whole machines passed the check 15 minutes before its start; five minutes
    before it the operator cordons one member. At the start only that member is replaced (by the
    third machine) and the deploys go to the two good machines: the cordoned one is never leased."""
    world = cp.world
    metal_pool(world)
    nodes = {}
    sessions = []
    for name in ("m1", "m2", "m3"):
        node, session = connected(gateway, world.pool_id, name, gpus=4, caps=CAPS, uuid=f"GPU-{name}")
        nodes[node.node_id] = name
        sessions.append(session)
    profile = register(world.root, 1)
    start = world.later(1)
    r = node_lease(world, profile, start=start, duration="2h", gang=pb.Gang(size=2))
    assert r.state == "placed", r.conditions
    members = {a.node_id for a in r.allocations}
    advance_to(cp, start - 15 * MINUTE)
    assert get(world, r.id).state == "placed"
    cordoned = sorted(members)[0]
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=cordoned, state="cordoned"))
    advance_to(cp, start)
    after = get(world, r.id)
    assert after.state == "binding", after.conditions
    live = {a.node_id for a in after.allocations if a.state == "binding"}
    assert live == set(nodes) - {cordoned}
    assert node_state(world, cordoned) == "cordoned"
    assert {node_state(world, n) for n in live} == {"leased"}
    cp.check_invariants()
    for session in sessions:
        session.close()


# -- a node flooding the gateway ----------------------------------------------------------------


def test_a_node_reopening_its_session_in_a_loop_is_paced_like_its_messages(database: str, pool_id: str) -> None:  # noqa: F811
    """Hellos, inventories and reports are paced per node, but opening a session was not: each
    open costs the gateway several transactions (the session registered, other roles' certificates
    retired, the desired state read, the previous session unregistered), so a node reconnecting in
    a loop, sending nothing, cost the database as fast as it could call. An open now takes a
    token of the node's bucket like a hello (and the node is slowed, never refused)."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=1,
                                                     node_messages_burst=2))
    try:
        node = enrolled(gw, pool_id, "reopens")
        began = time.monotonic()
        for _ in range(8):
            session = node.session()
            assert session.recv() is not None  # served: the desired state
            session.close()
        assert time.monotonic() - began >= (8 - 2) / 1 * 0.9  # burst 2, then one a second
    finally:
        gw.stop()


# -- whole machines raced ---------------------------------------------------------------------


def test_twenty_machine_gangs_leases_and_holds_at_once_never_share_a_machine(
        gateway, cp: ControlPlane) -> None:  # noqa: F811
    """Four machines; 20 creates at once for one window: gangs of two whole machines, single
    machines and one-GPU holds. No atom is booked twice, no machine is in two leases or beside a
    hold, every placed gang has both machines whole, and the quota matches what is placed."""
    from tests.test_hostile_share import storm

    world = cp.world
    metal_pool(world)
    world.quota(1000)
    sessions = [connected(gateway, world.pool_id, f"m{i}", gpus=4, caps=CAPS, uuid=f"GPU-m{i}")[1] for i in range(4)]
    profile = register(world.root, 1)
    start = world.later(2)
    lease_of = dict(binding="node", node=pb.NodeLease(profile_id=profile), start=start, duration="2h")
    kinds = ["gang", "hold", "lease", "hold", "gang", "lease", "hold"] * 3
    kinds = kinds[:20]
    requests = [world.create_request(count=4, gang=pb.Gang(size=2), **lease_of) if kind == "gang" else
                world.create_request(count=4, **lease_of) if kind == "lease" else
                world.create_request(count=1, start=start + HOUR, duration="2h") for kind in kinds]
    got = storm(world, requests)
    assert not [r for r in got if isinstance(r, grpc.RpcError)], got
    placed = [(kind, r) for kind, r in zip(kinds, got) if r.state == "placed"]
    leased = [a.node_id for kind, r in placed if kind != "hold" for a in r.allocations]
    held = {a.node_id for kind, r in placed if kind == "hold" for a in r.allocations}
    assert len(leased) == len(set(leased)), "a machine in two leases"
    assert not set(leased) & held, "a hold beside a lease"
    assert all(len(r.allocations) == 2 for kind, r in placed if kind == "gang")
    assert len(leased) + len(held) <= 4 and placed
    cp.check_invariants()
    for session in sessions:
        session.close()


# -- a gang of machines through its stages ------------------------------------------------------


def test_a_machine_gang_extended_and_released_with_one_member_deployed_ends_every_member(
        gateway, cp: ControlPlane) -> None:  # noqa: F811
    """A gang of two machines: extended while placed and again while binding with one member
    deployed (every member's bookings move together), then released: the deployed member's
    machine waits for its wipe (and then has its keys revoked), the other's deploy ends and its
    machine is back at once; the quota is refunded and no booking is left."""
    from tests.test_hostile_queue import extend

    world = cp.world
    connected_nodes = two_machines(gateway, world)
    profile = register(world.root, 1)
    start = world.later(1)
    r = node_lease(world, profile, start=start, duration="2h", gang=pb.Gang(size=2))
    assert r.state == "placed"
    assert extend(world, r.id, by="1h").extended
    advance_to(cp, start)
    r = get(world, r.id)
    assert r.state == "binding" and r.during.end == start + 3 * HOUR
    first, second = r.allocations
    deployed(world, connected_nodes[first.node_id], gateway, first.node_id, first.id, 2)
    cp.drain()
    r = get(world, r.id)
    assert r.state == "binding" and {a.id: a.state for a in r.allocations} == {first.id: "bound", second.id: "binding"}
    assert extend(world, r.id, by="1h").extended
    ends = world.sql("SELECT DISTINCT epoch_ms(upper(b.during)) FROM bookings b JOIN allocations a"
                     " ON a.id = b.allocation_id WHERE a.reservation_id = %s", (r.id,))
    assert ends == [(start + 4 * HOUR,)]
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    cp.drain()
    assert node_state(world, second.node_id) == "ready"  # never deployed: back at once
    assert node_state(world, first.node_id) == "leased"  # the tenant's machine until its wipe
    disk(connected_nodes[first.node_id], gateway, first.node_id, 3, "wiped", first.id, profile)
    cp.drain()
    assert node_state(world, first.node_id) == "ready"
    assert world.sql("SELECT count(*) FROM revocations v JOIN node_certs c USING (serial) WHERE c.node_id = %s",
                     (first.node_id,))[0][0] > 0
    assert world.sql("SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
                     " WHERE a.reservation_id = %s AND upper(b.during) > compute_now()", (r.id,)) == [(0,)]
    cp.check_invariants()


# -- a hostile node during a lease --------------------------------------------------------------


def test_a_node_reporting_its_gang_partners_deploy_binds_neither_machine(gateway, cp: ControlPlane) -> None:  # noqa: F811
    """Two machines of one gang; m2 says on its disk that m1's allocation is deployed (the asked
    profile version and checksum), m1 says nothing. Neither allocation is bound by it: each deploy
    is judged only on its own node's disk."""
    world = cp.world
    sessions = two_machines(gateway, world)
    profile = register(world.root, 1)
    r = node_lease(world, profile, duration="2h", gang=pb.Gang(size=2))
    cp.drain()
    r = get(world, r.id)
    assert r.state == "binding"
    victim, liar = r.allocations
    deployed(world, sessions[liar.node_id], gateway, liar.node_id, victim.id, 2)
    cp.drain()
    r = get(world, r.id)
    assert r.state == "binding" and [a.state for a in r.allocations] == ["binding", "binding"]
    assert world.sql("SELECT state FROM metal_deploys WHERE reservation_id = %s", (r.id,)) == [("deploying",)] * 2
    deployed(world, sessions[victim.node_id], gateway, victim.node_id, victim.id, 2)  # the real one counts
    deployed(world, sessions[liar.node_id], gateway, liar.node_id, liar.id, 3)
    cp.drain()
    assert get(world, r.id).state == "active"


def test_a_node_reopening_sessions_without_a_hello_never_holds_the_unreachable_sweep_for_long(
        database: str, pool_id: str) -> None:  # noqa: F811
    """The sweeper holds while sessions wait for their hello (a reconnect storm has not been heard
    yet), each for at most the grace. One node that opens a new session within every grace and
    never says hello (a tenant with root on a leased machine holds its node-tenant keys) held it
    for ever: no node of the gateway was marked unreachable any more. A node now holds it only
    within the grace of its first session still waiting for a hello, so a dead node is swept."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_grace_seconds=2, sweep_seconds=0.2))
    try:
        silent, quiet = connected(gw, pool_id, "silent")  # says hello once, then nothing
        holder = enrolled(gw, pool_id, "holder")
        held = []
        deadline = time.monotonic() + 20
        while node_row(database, silent.node_id)["connectivity"] != "unreachable":
            assert time.monotonic() < deadline, "the silent node was never swept"
            session = holder.session()  # supersedes its previous session; never a hello
            assert session.recv() is not None
            held.append(session)
            time.sleep(0.5)
        for session in held:
            session.close()
        quiet.close()
    finally:
        gw.stop()


def test_gpus_removed_readded_and_added_under_an_active_lease_stay_the_lessees(gateway, cp: ControlPlane) -> None:  # noqa: F811
    """An active lease of a four-GPU machine; the node's inventory drops GPU-3, then brings it back
    with a fifth GPU and one GPU in MIG mode, then out of it. Every GPU is booked by the lease once
    (no second booking of the returning GPU), nobody else books any of them into the lease's
    window, and the lease's charge stays the four GPUs it was placed for. (Since round 25a a leased
    machine's inventory changes none of its atoms, tests/test_hostile_round25a.py: the fifth GPU
    has no atom anyone could book.)"""
    world = cp.world
    metal_pool(world)
    world.quota(1000)
    node, session = connected(gateway, world.pool_id, "m1", gpus=4, caps=CAPS)
    profile = register(world.root, 1)
    r = node_lease(world, profile, duration="4h")
    cp.drain()
    alloc = get(world, r.id).allocations[0]
    deployed(world, session, gateway, node.node_id, alloc.id, 2)
    cp.drain()
    assert get(world, r.id).state == "active"
    [(profile_id, version, checksum)] = world.sql(
        "SELECT profile_id, version, checksum FROM metal_deploys WHERE allocation_id = %s", (alloc.id,))

    def inventory(generation: int, gpus: int, mig: int | None = None) -> None:
        inv = hello(gpus=gpus).hello.inventory
        inv.generation = generation
        if gpus == 3:
            del inv.gpus[:]
            inv.gpus.extend(hello(gpus=4).hello.inventory.gpus[:3])
        if mig is not None:
            inv.gpus[mig].mig_mode = True
            inv.gpus[mig].mig_instances.append(npb.MigInstance(index=0, profile="7g.80gb"))
        inv.deployed.CopyFrom(npb.DeployedProfile(allocation_id=alloc.id, profile_id=profile_id, version=version,
                                                  checksum=checksum, state="deployed"))
        session.send(npb.NodeMessage(inventory=inv))
        eventually(lambda: node_row(gateway.conninfo, node.node_id)["inventory_generation"] == generation)

    booked = ("SELECT a.device_uuid, count(*) FROM bookings b JOIN atoms a ON a.id = b.atom_id"
              " WHERE b.allocation_id = %s AND a.kind = 'gpu' GROUP BY 1 ORDER BY 1")
    inventory(3, 3)
    assert world.sql(booked, (alloc.id,)) == [(f"GPU-{i}", 1) for i in range(4)]  # GPU-3's booking stays
    inventory(4, 5, mig=1)
    inventory(5, 5)
    assert world.sql(booked, (alloc.id,)) == [(f"GPU-{i}", 1) for i in range(4)]
    assert world.sql("SELECT count(*) FROM atoms WHERE node_id = %s AND device_uuid = 'GPU-4'", (node.node_id,)) == [(0,)]
    _, other = world.identity()
    taken = world.create(other, count=1, duration="1h")
    assert taken.state == "pending", "a GPU of a leased machine was booked"
    world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=taken.id))
    usage = world.root.admin("GetQuotaUsage", apb.GetQuotaUsageRequest(tenant_id=world.tenant))
    assert sum(line.used for line in usage.lines if line.resource == "gpu") == 4
    cp.check_invariants()
    session.close()
