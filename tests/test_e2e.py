"""End to end through real processes: the control plane, the gateway and nodesim (the FakeDaemon),
each started as its own program, with real mutual TLS, real enrolment and node-signed reports.

Spec "Bindings" and "Attested bindings": a placed hold moves to binding at its start, the node
writes the CDI spec, env file and cgroup slice and reports AllocationBound signed with its key;
only a verified report makes the reservation active. Forged reports never do.
"""

from __future__ import annotations

import json
import pathlib
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.devtools import devstack
from tests.conftest import clone_database
from tests.support import Client, World, get, make_world
from tests.support import eventually as _eventually
from tests.test_nodesim import cdi_problems

CDI_NAME = r"^[a-zA-Z0-9][a-zA-Z0-9_.:-]*$"


@dataclass
class Stack:
    conninfo: str
    endpoint: str
    session: str
    enrol: str
    ca: pathlib.Path
    root: Client
    tmp: pathlib.Path


@pytest.fixture(scope="module")
def stack(pg_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e")
    conninfo = clone_database(pg_uri)
    root_token = bootstrap.ensure_root(conninfo)
    cp, endpoint = devstack.controlplane(conninfo, tmp / "controlplane.log", env={"BC_CLOCK_CONTROL": "1"})
    try:
        gw, session, enrol = devstack.gateway(conninfo, tmp / "gateway.log", tmp / "ca.pem",
                                              env={"BC_NODE_GRACE_SECONDS": "10", "BC_NODE_SWEEP_SECONDS": "1"})
    except Exception:
        cp.stop()
        raise
    root = Client(endpoint, root_token)
    try:
        yield Stack(conninfo, endpoint, session, enrol, tmp / "ca.pem", root, tmp)
    finally:
        root.close()
        gw.stop()
        cp.stop()


class Fleet:
    """A nodesim process for one test's pool; restartable with other flags."""

    def __init__(self, stack: Stack, world: World, count: int) -> None:
        self.stack, self.world = stack, world
        self.names = [f"e2e-{uuid.uuid4().hex[:6]}-{i}" for i in range(count)]
        self.sandbox = stack.tmp / f"sandbox-{self.names[0]}"
        self.tokens = stack.tmp / f"tokens-{self.names[0]}.json"
        devstack.issue_join_tokens(stack.endpoint, stack.root.metadata[0][1].split(" ", 1)[1], world.pool_id,
                                   self.names, self.tokens)
        self.proc: devstack.Process | None = None

    def start(self, *extra: str) -> None:
        self.proc = devstack.nodesim(len(self.names), self.stack.session, self.stack.enrol, self.sandbox,
                                     self.tokens, self.stack.ca, self.stack.tmp / f"{self.names[0]}.log",
                                     extra=("--heartbeat", "0.5", *extra))
        deadline = time.monotonic() + 60
        while True:
            nodes = self.world.root.admin("ListNodes", apb.ListNodesRequest(pool_id=self.world.pool_id)).items
            ready = [n for n in nodes if n.connectivity == "connected" and n.gpu_count == 8]
            if len(ready) == len(self.names):
                return
            assert self.proc.alive and time.monotonic() < deadline, f"fleet not connected: {nodes}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def node_dir(self, node_id: str) -> pathlib.Path:
        name = next(n.name for n in self.world.root.admin(
            "ListNodes", apb.ListNodesRequest(pool_id=self.world.pool_id)).items if n.id == node_id)
        return self.sandbox / name


@pytest.fixture
def world(stack: Stack) -> World:
    return make_world(stack.endpoint, stack.root, stack.conninfo, nodes=0)


@pytest.fixture
def fleet_factory(stack: Stack, world: World) -> Iterator:
    fleets: list[Fleet] = []

    def make(count: int = 2, *extra: str) -> Fleet:
        fleet = Fleet(stack, world, count)
        fleets.append(fleet)
        fleet.start(*extra)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()


def eventually(world: World, rid: str, check, seconds: float = 30) -> pb.Reservation:
    return _eventually(world, rid, check, seconds, poll=0.1)


def gateway_log(stack: Stack, event: str, node_id: str) -> list[dict]:
    """The gateway's log lines of `event` about one node."""
    lines = [json.loads(line) for line in (stack.tmp / "gateway.log").read_text().splitlines()
             if line.startswith("{")]
    return [line for line in lines if line.get("event") == event and line.get("node_id") == node_id]


def rejections(world: World, rid: str) -> list[dict]:
    return [d for (d,) in world.sql("SELECT data FROM events WHERE subject = %s AND"
                                    " type = 'reservation.binding-rejected' ORDER BY id", (f"reservation/{rid}",))]


def test_a_hold_binds_through_the_node_and_the_files_are_on_disk(world: World, fleet_factory) -> None:
    fleet = fleet_factory(2)
    r = world.create(count=4, topology="nvlink-all", duration="8h")
    active = eventually(world, r.id, lambda x: x.state == "active")
    alloc = active.allocations[-1]
    assert active.binding.node_id == alloc.node_id and active.binding.attested
    assert sorted(active.binding.cdi_devices) == sorted(f"bcd.dev/gpu={u}" for u in alloc.device_ids)
    assert active.binding.env_file == f"/run/bcd/allocations/{alloc.id}.env"
    types = [t for (t,) in world.sql("SELECT type FROM events WHERE subject = %s ORDER BY id",
                                     (f"reservation/{r.id}",))]
    assert types == ["reservation.placed", "reservation.binding", "reservation.active"]

    node_dir = fleet.node_dir(alloc.node_id)
    spec_path = node_dir / "etc" / "cdi" / f"bcd-{alloc.id}.json"
    spec_text = spec_path.read_text()
    assert cdi_problems(spec_text) == []
    spec = json.loads(spec_text)
    assert spec["kind"] == "bcd.dev/gpu"
    assert sorted(d["name"] for d in spec["devices"]) == sorted(alloc.device_ids)
    assert all(__import__("re").match(CDI_NAME, d["name"]) for d in spec["devices"])
    env = dict(line.split("=", 1) for line in
               (node_dir / "run" / "bcd" / "allocations" / f"{alloc.id}.env").read_text().splitlines() if line)
    assert env["BCD_ALLOCATION_ID"] == alloc.id
    assert set(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == set(alloc.device_ids)

    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    deadline = time.monotonic() + 20
    while spec_path.exists():
        assert time.monotonic() < deadline, "the node kept the CDI spec after the release"
        time.sleep(0.1)
    assert not (node_dir / "run" / "bcd" / "allocations" / f"{alloc.id}.env").exists()
    # The node removes the files, then reports the release: wait for the stored report.
    while not world.sql("SELECT count(*) FROM node_reports WHERE allocation_id = %s AND kind = 'released'",
                        (alloc.id,))[0][0]:
        assert time.monotonic() < deadline, "the node never reported the release"
        time.sleep(0.1)


@pytest.mark.parametrize("mode, reason", [
    ("unsigned", "unsigned report"),
    ("foreign-key", "bad signature"),  # the node's key id, another key's signature
])
def test_forged_bind_reports_never_activate(world: World, fleet_factory, mode: str, reason: str) -> None:
    fleet_factory(1, "--forge", mode)
    r = world.create(count=2, duration="8h")
    eventually(world, r.id, lambda x: any(d["reason"] == reason for d in rejections(world, r.id)))
    # Judged (the rejection is written with the verdict, in one transaction), and never accepted.
    current = get(world, r.id)
    assert current.state == "binding" and not current.HasField("binding")
    verdicts = world.sql("SELECT verdict FROM node_reports WHERE allocation_id = %s", (current.allocations[-1].id,))
    assert verdicts and all(v.startswith("rejected: ") for (v,) in verdicts), verdicts
    data = rejections(world, r.id)[0]
    assert data["allocationId"] == current.allocations[-1].id and data["nodeId"] == current.allocations[-1].node_id


def test_a_report_naming_another_allocation_never_activates(stack: Stack, world: World, fleet_factory) -> None:
    """nodesim signs a genuine report naming an allocation that is not this one; the gateway
    routes by the body, finds no such allocation on the node's session and drops it."""
    fleet_factory(1, "--forge", "other-allocation")
    r = world.create(count=2, duration="8h")
    node_id = eventually(world, r.id, lambda x: x.state == "binding").allocations[-1].node_id
    deadline = time.monotonic() + 30
    while not gateway_log(stack, "report ignored", node_id):  # the forged report came, and was dropped
        assert time.monotonic() < deadline, "the gateway never dropped the forged report"
        time.sleep(0.1)
    current = get(world, r.id)
    assert current.state == "binding" and not current.HasField("binding")
    assert world.sql("SELECT count(*) FROM node_reports WHERE allocation_id = %s", (current.allocations[-1].id,)) \
        == [(0,)]


def test_a_compromised_gateway_replaying_another_allocations_signed_report_is_rejected(
    world: World, fleet_factory
) -> None:
    """The threat attested bindings close: a gateway stores the node's genuine signed report of
    allocation B as allocation A's. The signature verifies, but the body is not A bound."""
    fleet = fleet_factory(1)
    other = eventually(world, world.create(count=2, duration="8h").id, lambda x: x.state == "active")
    genuine = world.sql("SELECT id FROM node_reports WHERE allocation_id = %s AND kind = 'bound'"
                        " AND verdict = 'accepted'", (other.allocations[-1].id,))[0][0]
    fleet.stop()  # the node goes quiet: nothing it says will bind the victim
    victim = eventually(world, world.create(count=2, duration="8h").id, lambda x: x.state == "binding")
    target = victim.allocations[-1].id
    # Acting as a compromised gateway: store B's genuine bytes as a report about A.
    world.sql("INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)"
              " SELECT node_id, %s, 'bound', body, key_id, signature FROM node_reports WHERE id = %s",
              (target, genuine))
    world.sql("SELECT wake_reservation(%s)", (victim.id,))
    eventually(world, victim.id, lambda x: any(d["reason"] == "not this allocation bound"
                                               for d in rejections(world, victim.id)))
    current = get(world, victim.id)
    assert current.state == "binding" and not current.HasField("binding")


def test_a_forged_re_report_of_an_active_binding_marks_it_lost(world: World, fleet_factory) -> None:
    fleet = fleet_factory(1)
    r = world.create(count=2, duration="8h")
    eventually(world, r.id, lambda x: x.state == "active")
    fleet.stop()
    fleet.start("--forge", "unsigned")  # recovers from its sandbox and re-reports, unsigned
    lost = eventually(world, r.id, lambda x: any(c.reason == "BindingLost" for c in x.conditions))
    assert lost.state == "active"  # an active reservation is never released for node trouble
    assert any(d["reason"] == "unsigned report" for d in rejections(world, r.id))
    fleet.stop()
    fleet.start()  # the genuine daemon re-reports: bound again, the condition clears
    healed = eventually(world, r.id, lambda x: not any(c.reason == "BindingLost" for c in x.conditions))
    assert healed.state == "active"


def test_allocation_failed_places_again_on_another_node(world: World, fleet_factory) -> None:
    fleet = fleet_factory(2)
    first_node = fleet.names[0]
    fleet.stop()
    fleet.start("--fail-binds", "1", "--fault-nodes", first_node)
    nodes = {n.name: n.id for n in world.root.admin("ListNodes", apb.ListNodesRequest(pool_id=world.pool_id)).items}
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=nodes[fleet.names[1]], state="cordoned"))
    r = world.create(count=8, duration="8h")
    assert r.allocations[0].node_id == nodes[first_node]
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=nodes[fleet.names[1]], state="ready"))
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert active.binding.node_id == nodes[fleet.names[1]]
    assert world.sql("SELECT bind_failures FROM reservations WHERE id = %s", (r.id,))[0][0] == 1
    assert [a.state for a in active.allocations] == ["failed", "bound"]


def test_an_unreachable_node_keeps_the_booking_with_a_condition(world: World, fleet_factory) -> None:
    fleet = fleet_factory(1, "--unreachable-on-signal")
    r = world.create(count=2, duration="8h")
    eventually(world, r.id, lambda x: x.state == "active")
    assert fleet.proc is not None
    fleet.proc.proc.send_signal(signal.SIGUSR1)  # the node goes silent now; the gateway's grace is 10 s
    degraded = eventually(world, r.id, lambda x: any(c.type == "NodeUnreachable" for c in x.conditions), 60)
    assert degraded.state == "active" and len(degraded.allocations[-1].device_ids) == 2
