"""Leftovers of the node side, attacked as a hostile node would (real gateway, real mutual TLS,
real certificates, the control plane beside it on one database): one GPU uuid is one node's, and
a refused certificate is cheap to refuse again."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from bettercompute.node.v1 import node_pb2 as npb
from bettercompute.node.v1 import node_pb2_grpc as npb_grpc
from bettercompute.v1 import admin_pb2 as apb
from controlplane.common.status import error_info
from controlplane.pki import admin
from tests.invariants import snapshot
from tests.nodes_support import ControlPlane
from tests.support import rpc_error
from tests.test_gateway import (GatewayThread, Node, Session, connected, cp, enrolled, eventually,  # noqa: F401
                                gateway, hello, node_row, pool_id)
from tests.test_pki import arun, sql

MODEL = "H100-SXM5-80GB"


def inventory(generation: int, *uuids: str, mig: bool = False) -> npb.Inventory:
    """A node's inventory with these GPUs (in MIG mode with two instances each, when `mig`)."""
    return npb.Inventory(generation=generation, vcpus=64, memory_bytes=512 << 30, numa_nodes=[
        npb.NumaNode(id=0, cpulist="0-63", memory_bytes=512 << 30)], gpus=[
        npb.Gpu(uuid=u, model=MODEL, memory_mib=81559, mig_mode=mig,
                mig_instances=[npb.MigInstance(index=i, profile="3g.40gb") for i in range(2)] if mig else [])
        for u in uuids])


def say(conninfo: str, node_id: str, session: Session, inv: npb.Inventory, *, as_hello: bool = False) -> None:
    """Send `inv` (in a hello, or on its own) and wait until it is applied."""
    if as_hello:
        session.send(npb.NodeMessage(hello=npb.Hello(daemon_version="bcd", capabilities=["devices.limits"],
                                                     inventory=inv)))
    else:
        session.send(npb.NodeMessage(inventory=inv))
    eventually(lambda: node_row(conninfo, node_id)["inventory_generation"] == inv.generation, what="inventory")


def gpu_atoms(conninfo: str, node_id: str) -> dict[str, bool]:
    """The node's atoms: device id -> bookable."""
    return {r["device_uuid"]: r["bookable"] for r in sql(
        conninfo, "SELECT device_uuid, bookable FROM atoms WHERE node_id = %s", (node_id,))}


def live_devices(conninfo: str) -> list[dict[str, Any]]:
    """Device ids that two bookable atoms carry (never, on any nodes)."""
    return sql(conninfo, "SELECT device_uuid, count(*) AS n FROM atoms WHERE bookable"
                         " GROUP BY device_uuid HAVING count(*) > 1")


def second(gateway: GatewayThread, cp: ControlPlane, name: str, *uuids: str) -> tuple[Any, Session]:
    """A node of the control plane's pool (another pool than the first node's) whose hello
    reports these GPUs."""
    node = enrolled(gateway, cp.pool_id, name)
    session = node.session()
    assert session.recv() is not None
    say(gateway.conninfo, node.node_id, session, inventory(1, *uuids), as_hello=True)
    return node, session


# -- one GPU uuid, one node ----------------------------------------------------------------------


def test_a_gpu_another_node_holds_is_refused_and_the_operator_sees_why(
        gateway: GatewayThread, pool_id: str, cp: ControlPlane) -> None:
    """Node B reports, beside its own, a GPU node A reported first: B got a second atom of A's
    device, bookable, and a tenant's binding on B named A's GPU. Now B's copy is refused (no
    atom), A keeps its GPU, B keeps its own and its session, and the Admin API shows the refusal
    and who holds the GPU."""
    a, a_session = connected(gateway, pool_id, "a", gpus=2)  # GPU-0, GPU-1
    b, b_session = second(gateway, cp, "b", "GPU-1", "GPU-B0")
    assert gpu_atoms(gateway.conninfo, b.node_id) == {"GPU-B0": True}
    assert gpu_atoms(gateway.conninfo, a.node_id) == {"GPU-0": True, "GPU-1": True}
    assert live_devices(gateway.conninfo) == []
    shown = cp.root.admin("ListNodes", apb.ListNodesRequest(pool_id=cp.pool_id)).items
    assert [(g.uuid, g.held_by_node_id) for g in shown[0].refused_gpus] == [("GPU-1", a.node_id)]
    assert shown[0].gpu_count == 1
    # a tenant booking two GPUs in B's pool waits: there is one
    r = cp.create(count=2)
    cp.drain()
    assert cp.get(r.id).state == "pending"
    b_session.send(npb.NodeMessage(heartbeat=npb.Heartbeat(applied_generation=0)))  # B still served
    assert node_row(gateway.conninfo, b.node_id)["connectivity"] == "connected"
    cp.check_invariants()
    a_session.close()
    b_session.close()


def test_a_gpu_moved_to_another_machine_is_taken_once_its_old_node_lets_go(
        gateway: GatewayThread, pool_id: str, cp: ControlPlane) -> None:
    a, a_session = connected(gateway, pool_id, "a", gpus=2)
    b, b_session = second(gateway, cp, "b", "GPU-1")
    assert gpu_atoms(gateway.conninfo, b.node_id) == {}
    say(gateway.conninfo, a.node_id, a_session, inventory(2, "GPU-0"))  # GPU-1 left machine A
    say(gateway.conninfo, b.node_id, b_session, inventory(2, "GPU-1"))  # and B reports it again
    assert gpu_atoms(gateway.conninfo, b.node_id) == {"GPU-1": True}
    assert gpu_atoms(gateway.conninfo, a.node_id) == {"GPU-0": True}
    assert "refused_gpus" not in node_row(gateway.conninfo, b.node_id)["inventory"]
    # and A cannot take it back while B holds it
    say(gateway.conninfo, a.node_id, a_session, inventory(3, "GPU-0", "GPU-1"))
    assert gpu_atoms(gateway.conninfo, a.node_id) == {"GPU-0": True}
    assert live_devices(gateway.conninfo) == []
    a_session.close()
    b_session.close()


def test_the_gpus_of_a_revoked_node_can_be_reported_by_the_machine_enrolled_anew(
        gateway: GatewayThread, pool_id: str, cp: ControlPlane) -> None:
    """A machine enrolled under a new name (or a squatter's node revoked by the operator): the
    revoked node cannot report anything any more, so it holds no GPU."""
    a, a_session = connected(gateway, pool_id, "a", gpus=1)
    b, b_session = second(gateway, cp, "b", "GPU-0")
    assert gpu_atoms(gateway.conninfo, b.node_id) == {}
    arun(gateway.conninfo, lambda pool: admin.revoke_certificates(pool, a.node_id, "", "decommissioned"))
    say(gateway.conninfo, b.node_id, b_session, inventory(2, "GPU-0"))
    assert gpu_atoms(gateway.conninfo, b.node_id) == {"GPU-0": True}
    a_session.close()
    b_session.close()


def test_a_mig_gpu_another_node_holds_gives_no_instances(gateway: GatewayThread, pool_id: str,
                                                          cp: ControlPlane) -> None:
    """MIG instances and slots are named "<uuid>:<n>" after their GPU: refusing the GPU refuses
    them, so no two nodes carry one instance either."""
    a, a_session = connected(gateway, pool_id, "a", gpus=1)
    cp.world.pool_id = cp.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=cp.world.tenant, name="mig", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="mig")))).id
    mig_a, mig_a_session = second(gateway, cp, "mig-a", "GPU-M")
    say(gateway.conninfo, mig_a.node_id, mig_a_session, inventory(2, "GPU-M", mig=True))
    mig_b, mig_b_session = second(gateway, cp, "mig-b", "GPU-0")
    say(gateway.conninfo, mig_b.node_id, mig_b_session, inventory(2, "GPU-0", "GPU-M", mig=True))
    assert gpu_atoms(gateway.conninfo, mig_b.node_id) == {}
    assert gpu_atoms(gateway.conninfo, mig_a.node_id) == {"GPU-M": False, "GPU-M:0": True, "GPU-M:1": True}
    assert live_devices(gateway.conninfo) == []
    for s in (a_session, mig_a_session, mig_b_session):
        s.close()


def test_an_operator_registering_a_gpu_a_node_holds_is_a_conflict(gateway: GatewayThread, pool_id: str,
                                                                    cp: ControlPlane) -> None:
    a, a_session = connected(gateway, pool_id, "a", gpus=1)
    with pytest.raises(grpc.RpcError) as refused:
        cp.root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=cp.pool_id, name="twin", gpus=[
            apb.Gpu(uuid="GPU-X", model=MODEL), apb.Gpu(uuid="GPU-0", model=MODEL)]))
    assert rpc_error(refused) == (grpc.StatusCode.ABORTED, "CONFLICT", {"uuid": "GPU-0", "nodeId": a.node_id})
    assert sql(gateway.conninfo, "SELECT 1 FROM nodes WHERE name = 'twin'") == []
    assert sql(gateway.conninfo, "SELECT node_id FROM gpu_holders WHERE device_uuid IN ('GPU-0', 'GPU-X')") == [
        {"node_id": a.node_id}]
    a_session.close()


def test_nodes_reporting_one_gpu_at_once_leave_it_to_one(gateway: GatewayThread, pool_id: str,
                                                         cp: ControlPlane) -> None:
    nodes = []
    for i in range(6):
        node = enrolled(gateway, pool_id if i % 2 else cp.pool_id, f"racer-{i}")
        session = node.session()
        assert session.recv() is not None
        nodes.append((node, session))
    go = threading.Barrier(len(nodes))

    def report(node: Any, session: Session) -> None:
        go.wait()
        say(gateway.conninfo, node.node_id, session, inventory(1, "GPU-SHARED", f"GPU-{node.node_id}"),
            as_hello=True)

    threads = [threading.Thread(target=report, args=pair) for pair in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    holders = [n.node_id for n, _ in nodes if "GPU-SHARED" in gpu_atoms(gateway.conninfo, n.node_id)]
    assert len(holders) == 1
    assert sql(gateway.conninfo, "SELECT node_id FROM gpu_holders WHERE device_uuid = 'GPU-SHARED'") == [
        {"node_id": holders[0]}]
    assert all(f"GPU-{n.node_id}" in gpu_atoms(gateway.conninfo, n.node_id) for n, _ in nodes)
    assert live_devices(gateway.conninfo) == []
    cp.check_invariants()
    for _, s in nodes:
        s.close()


# -- a refused certificate, presented again and again ---------------------------------------------


def test_refusals_are_bounded_and_expire() -> None:
    from controlplane import errors
    from gateway.refusals import Refusals

    now = [0.0]
    kept = Refusals(2, 10, clock=lambda: now[0])
    revoked = errors.Unauthenticated("certificate revoked")
    for pem in (b"a", b"b", b"c"):
        kept.remember(pem, revoked)
    assert (kept.refused(b"a"), kept.refused(b"b"), kept.refused(b"c")) == (None, revoked, revoked)  # the oldest went
    assert len(kept) == 2 and kept.refused(None) is None
    now[0] = 10
    assert kept.refused(b"c") is None and len(kept) == 1  # expired
    off = Refusals(0, 10)
    off.remember(b"a", revoked)
    assert off.refused(b"a") is None


def refused_session(node: Any, timeout: float = 30) -> grpc.RpcError:
    """A session opened with the node's certificate: the error it was refused with."""
    with node.channel() as channel:
        call = npb_grpc.NodeGatewayStub(channel).Session(iter(()), timeout=timeout)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
    return ended.value


def test_a_revoked_certificate_presented_again_is_refused_without_a_database_read(
        gateway: GatewayThread, pool_id: str) -> None:
    """A revoked node reconnecting in a loop: each attempt was a read of its certificate from the
    gateway's small pool, unpaced, while holding the unreachable sweep. Now the refusal is kept:
    with the certificate table locked (a read would wait), the next attempts and a Renew are
    still refused at once, with the same error."""
    import psycopg

    node = enrolled(gateway, pool_id, "revoked")
    arun(gateway.conninfo, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "stolen"))
    first = refused_session(node)
    assert (first.code(), error_info(first).reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    with psycopg.connect(gateway.conninfo) as holder:
        holder.execute("LOCK TABLE node_certs IN ACCESS EXCLUSIVE MODE")
        for _ in range(3):
            again = refused_session(node, timeout=20)
            assert (again.code(), again.details()) == (first.code(), first.details())
        with node.channel() as channel, pytest.raises(grpc.RpcError) as renew:
            npb_grpc.NodeGatewayStub(channel).Renew(npb.RenewRequest(csr_pem=node.keys.csr()), timeout=20)
        assert renew.value.code() == grpc.StatusCode.UNAUTHENTICATED
        holder.rollback()
    assert not gateway.gateway.runner.liveness.holding(float("inf"))  # no arrival left behind


def test_a_readmitted_node_enrolled_again_serves_at_once(gateway: GatewayThread, pool_id: str) -> None:
    """The refusals are of certificates, never of a node: once readmitted and enrolled again (new
    certificates), the node's session opens at once, while its old certificate stays refused."""
    from tests.test_gateway import Node, join_token

    node, session = connected(gateway, pool_id, "again", gpus=1)
    arun(gateway.conninfo, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "stolen"))
    assert session.ended() is not None
    old = Node(gateway)
    old.keys, old.node_id, old.cert_pem, old.signing_pem = node.keys, node.node_id, node.cert_pem, node.signing_pem
    assert refused_session(old).code() == grpc.StatusCode.UNAUTHENTICATED
    assert arun(gateway.conninfo, lambda pool: admin.readmit_node(pool, node.node_id))
    node.enrol(join_token(gateway.conninfo, pool_id, "again"))
    back = node.session()
    assert back.recv() is not None
    back.send(hello(gpus=1, version="bcd-back"))
    eventually(lambda: node_row(gateway.conninfo, node.node_id)["daemon_version"] == "bcd-back", what="hello")
    assert refused_session(old).code() == grpc.StatusCode.UNAUTHENTICATED
    back.close()


# -- a GPU named like another's MIG instance or slot ----------------------------------------------


def test_a_gpu_uuid_shaped_like_an_instance_or_slot_id_is_dropped(gateway: GatewayThread, pool_id: str,
                                                                  cp: ControlPlane) -> None:
    """Instances and slots are named "<uuid>:<n>": a node reporting a GPU "GPU-T:0" carried, as a
    whole GPU, the device id of another node's slot (two bookable atoms of one id), and its own
    slots "GPU-T:0:1" named nothing a daemon parses. A ':' is in no GPU uuid: such a GPU is
    dropped like any malformed entry."""
    cp.world.pool_id = cp.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=cp.world.tenant, name="ts", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="time-slice", replicas=2)))).id
    sliced, sliced_session = second(gateway, cp, "sliced", "GPU-T")
    assert gpu_atoms(gateway.conninfo, sliced.node_id) == {"GPU-T": False, "GPU-T:0": True, "GPU-T:1": True}
    a, a_session = connected(gateway, pool_id, "a", gpus=0)
    say(gateway.conninfo, a.node_id, a_session, inventory(2, "GPU-T:0", "GPU-A"))
    assert gpu_atoms(gateway.conninfo, a.node_id) == {"GPU-A": True}
    assert live_devices(gateway.conninfo) == []
    with pytest.raises(grpc.RpcError) as refused:
        cp.root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=cp.pool_id, name="colon", gpus=[
            apb.Gpu(uuid="GPU-T:1", model=MODEL)]))
    assert rpc_error(refused) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", {"field": "gpus[0].uuid"})
    sliced_session.close()
    a_session.close()


# -- a node inventing GPUs in a loop ----------------------------------------------------------------


def test_gpus_a_node_invents_and_drops_in_a_loop_leave_no_rows_behind(gateway: GatewayThread,
                                                                        cp: ControlPlane) -> None:
    """Atoms of GPUs gone from an inventory were never deleted: a node reporting fresh uuids each
    inventory (here 16 GPUs, 4 slots each, 20 times) grew its atoms without end, and every later
    inventory of it digested all of them twice. A GPU gone with nothing booked on it (nor on its
    slots) and not quarantined is deleted; a quarantined or booked one stays."""
    cp.world.pool_id = cp.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=cp.world.tenant, name="ts", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="time-slice", replicas=4)))).id
    node, session = second(gateway, cp, "inventor", "GPU-sick", "GPU-booked")
    cp.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node.node_id, device_uuid="GPU-sick",
                                                          health="unhealthy"))
    r = cp.create(count=2, device_class="gpu.slot")
    cp.drain()
    placed = cp.get(r.id)
    assert placed.allocations, (placed.state, placed.conditions)
    assert {d.split(":")[0] for d in placed.allocations[0].device_ids} == {"GPU-booked"}
    for generation in range(2, 22):
        say(gateway.conninfo, node.node_id, session,
            inventory(generation, "GPU-kept", *(f"GPU-{generation}-{i}" for i in range(16))))
    rows = sql(gateway.conninfo, "SELECT count(*) AS n FROM atoms WHERE node_id = %s", (node.node_id,))[0]["n"]
    # the present GPUs and their slots; the sick one and its (sick) slots; the booked one and its two booked slots
    assert rows == (1 + 16) * 5 + 5 + 3, rows
    health = {r["device_uuid"]: r["health"] for r in sql(
        gateway.conninfo, "SELECT device_uuid, health FROM atoms WHERE node_id = %s AND kind = 'gpu'", (node.node_id,))}
    assert health["GPU-sick"] == "unhealthy" and "GPU-booked" in health
    say(gateway.conninfo, node.node_id, session, inventory(30, "GPU-kept", "GPU-sick"))
    assert sql(gateway.conninfo, "SELECT health FROM atoms WHERE node_id = %s AND device_uuid = 'GPU-sick'",
               (node.node_id,)) == [{"health": "unhealthy"}]  # still quarantined when it is back
    assert snapshot(cp.conninfo, cp.world.tenant)["double_booked"] == []
    session.close()


# -- an inventory that waited for the node's revocation ---------------------------------------------


def test_an_inventory_applied_after_the_nodes_revocation_takes_back_nothing(
        gateway: GatewayThread, pool_id: str, cp: ControlPlane) -> None:
    """A squatter's inventory waits on its node's row while the operator revokes it (which lets go
    of its GPUs); once the revocation commits, the inventory went in before the session's re-check
    ended it, and held the GPUs again for the revoked node. A revoked node's hello or inventory is
    now applied not at all."""
    import psycopg

    squatter, session = connected(gateway, pool_id, "squatter", gpus=2)
    waiting = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s"
    revoking = threading.Thread(target=lambda: arun(gateway.conninfo, lambda pool: admin.revoke_certificates(
        pool, squatter.node_id, "", "squatting")))
    with psycopg.connect(gateway.conninfo) as holder:
        holder.execute("LOCK TABLE revocations IN SHARE ROW EXCLUSIVE MODE")  # the revocation waits to write
        revoking.start()
        eventually(lambda: sql(gateway.conninfo, waiting, ("%INSERT INTO revocations%",)), what="the revocation")
        session.send(npb.NodeMessage(inventory=inventory(2, "GPU-0", "GPU-1", "GPU-new")))
        eventually(lambda: sql(gateway.conninfo, waiting, ("%FOR UPDATE%",))  # on the row, or the pool's lock
                   or sql(gateway.conninfo, waiting, ("%pg_advisory_xact_lock%",)), what="the inventory waiting")
        holder.rollback()
    revoking.join(30)
    assert session.ended() is not None
    assert sql(gateway.conninfo, "SELECT device_uuid FROM gpu_holders WHERE node_id = %s", (squatter.node_id,)) == []
    assert node_row(gateway.conninfo, squatter.node_id)["inventory_generation"] == 1
    b, b_session = second(gateway, cp, "rightful", "GPU-0")
    assert gpu_atoms(gateway.conninfo, b.node_id) == {"GPU-0": True}
    b_session.close()


# -- enrolling a machine a tenant holds -------------------------------------------------------------


def test_a_machine_enrolled_while_a_tenant_leases_it_gets_the_tenant_role(gateway: GatewayThread,
                                                                            cp: ControlPlane) -> None:
    """The role is the control plane's choice: node-tenant while a tenant has root on the machine.
    A renewal gave it, but an enrolment gave the join token's role, so a platform (`node`) key was
    made on a machine the tenant holds (and, once it opened a session, the node-tenant ones were
    retired)."""
    from tests.test_gateway import join_token
    from tests.test_hostile_metal import CAPS, get, metal_pool, node_lease, node_state
    from tests.test_node_profiles import register
    from controlplane.pki import certs
    from tests.test_pki import split

    metal_pool(cp.world)
    node, session = connected(gateway, cp.world.pool_id, "m1", gpus=4, caps=CAPS)
    r = node_lease(cp.world, register(cp.world.root, 1), duration="4h")
    cp.drain()
    assert get(cp.world, r.id).state == "binding" and node_state(cp.world, node.node_id) == "leased"
    response = node.enrol(join_token(gateway.conninfo, cp.world.pool_id, "m1", "node"))
    assert {certs.facts(c).role for c in split(response.certificate_pem)} == {"node-tenant"}
    session.close()


# -- a leased machine's inventory and the pool's host share -----------------------------------------


def two_metal_machines(gateway: GatewayThread, cp: ControlPlane) -> dict[str, tuple[str, Node, Session]]:
    """A metal pool with quota and two connected 4-GPU machines, m1 and m2 (GPUs GPU-m1-0 ... and
    GPU-m2-0 ...): by node id, each machine's name, node and session."""
    from tests.test_hostile_metal import CAPS, metal_pool

    metal_pool(cp.world)
    cp.world.quota(1000)
    machines = {}
    for name in ("m1", "m2"):
        node, session = connected(gateway, cp.world.pool_id, name, gpus=4, caps=CAPS, uuid=f"GPU-{name}")
        machines[node.node_id] = (name, node, session)
    return machines


def test_a_leased_machines_inventory_never_shrinks_the_pools_host_share(gateway: GatewayThread,
                                                                         cp: ControlPlane) -> None:
    """Each reservation's host share is the smallest per-GPU share any GPU host of its pool gives.
    A tenant with root on a leased machine says what its inventory is: 256 GPUs on 3 vCPUs and
    1 GiB made every other tenant's share in the pool 0 (their holds limited to nothing). A leased
    machine is left out of the share until it is the platform's again."""
    from tests.test_hostile_metal import get, node_lease
    from tests.test_node_profiles import register

    machines = two_metal_machines(gateway, cp)
    before = cp.create(count=1).host_share
    assert before.vcpu > 0 and before.memory_gib > 0
    r = node_lease(cp.world, register(cp.world.root, 1), duration="4h")
    cp.drain()
    assert get(cp.world, r.id).state == "binding"
    _, leased, leased_session = machines[r.allocations[0].node_id]
    lying = inventory(2, *(f"GPU-fake-{i}" for i in range(256)))
    lying.vcpus, lying.memory_bytes, lying.numa_nodes[0].cpulist = 3, 1 << 30, "0-2"
    lying.numa_nodes[0].memory_bytes = 1 << 30
    say(gateway.conninfo, leased.node_id, leased_session, lying)
    # the capacity index (what a create reads the share from) has the lie; so has the SQL
    index = cp.server.app.runtime.capacity
    eventually(lambda: index.pool(cp.world.pool_id).nodes[leased.node_id].host.get("vcpu", 0) <= 3,
               what="the index holding the lie")
    assert cp.create(count=1).host_share == before
    assert {r["resource"]: int(r["per_gpu"]) for r in sql(
        gateway.conninfo, "SELECT * FROM pool_host_share_per_gpu(%s)", (cp.world.pool_id,))} == {
        "vcpu": before.vcpu, "memoryGiB": before.memory_gib}
    for _, _, session in machines.values():
        session.close()


def test_a_leased_machines_inventory_never_changes_the_pools_models(gateway: GatewayThread,
                                                                     cp: ControlPlane) -> None:
    """A request that names no model is charged on the pool's one model; in a pool of several, a
    tenant with a model quota must name one (QUOTA_EXCEEDED). A tenant with root on a leased
    machine reported a GPU of another model and made every such request of the pool's tenants
    refused. A leased machine's models are left out until it is the platform's again."""
    from tests.test_hostile_metal import get, node_lease
    from tests.test_node_profiles import register

    machines = two_metal_machines(gateway, cp)
    cp.world.quota(1000, resource=f"gpu:{MODEL}")
    r = node_lease(cp.world, register(cp.world.root, 1), duration="4h")
    cp.drain()
    assert get(cp.world, r.id).state == "binding"
    _, leased, leased_session = machines[r.allocations[0].node_id]
    own = [f"GPU-{node_row(gateway.conninfo, leased.node_id)['name']}-{i}" for i in range(4)]
    lying = inventory(2, *own, "GPU-odd")
    lying.gpus[0].model = "B200"
    lying.gpus[-1].model = "B200"
    say(gateway.conninfo, leased.node_id, leased_session, lying)
    # (since round 25a a leased machine's inventory changes none of its atoms: the lie is not even
    # written, tests/test_hostile_round25a.py; the pool's models below would leave it out anyway)
    assert sql(gateway.conninfo, "SELECT DISTINCT model FROM atoms WHERE node_id = %s",
               (leased.node_id,)) == [{"model": MODEL}]
    assert cp.create(count=1).state == "placed"
    # and without the index (its SQL)
    from controlplane.reservations import queries as rq
    assert sql(gateway.conninfo, rq.POOL_MODELS, {"pool_id": cp.world.pool_id}) == [{"model": MODEL}]
    assert sql(gateway.conninfo, rq.VISIBLE_POOL, {"pool_id": cp.world.pool_id, "tenant_id": cp.world.tenant})[0][
        "single_model"] == MODEL
    for _, _, session in machines.values():
        session.close()
