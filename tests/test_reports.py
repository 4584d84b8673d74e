"""How the reservation worker judges node reports, with real node keys and certificates from the
control-plane CA (the node side is stood in for by signing reports here, as the gateway would have
stored them: exactly as received).

Spec "Bindings": a report that arrives while the reservation is still placed is judged as soon as
the start is reached, not after the bind timeout; AllocationReleased for a bound allocation is
Degraded with BindingLost until the node reports it bound again. Spec "Host resources": the
control plane keeps a cgroup parent only when it is exactly the allocation's own slice.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import admin_pb2 as apb
from controlplane.reservations import reports
from tests.support import Client, ServerThread, World, eventually, get, make_world
from tests.test_pki import Enrolled, enrol, sign

HOUR = 3_600_000
_SEQUENCE = itertools.count(1)  # a node's reports are newer one after the other


def enrolled_node(world: World) -> Enrolled:
    """An enrolled node with eight GPUs, connected (what the gateway records from its Hello)."""
    enrolled = enrol(world.conninfo, world.pool_id, "reporter")
    world.sql("UPDATE nodes SET connectivity = 'connected' WHERE id = %s", (enrolled.node_id,))
    world.sql("INSERT INTO atoms (id, node_id, kind, device_uuid, model, numa_node, nvlink_domain)"
              " SELECT 'atom_' || md5(%s || g), %s, 'gpu', 'GPU-r-' || g, 'H100', g / 4, 'fab/1'"
              " FROM generate_series(0, 7) g", (enrolled.node_id, enrolled.node_id))
    return enrolled


@pytest.fixture
def node(world: World) -> Enrolled:
    return enrolled_node(world)


@pytest.fixture
def world(clock_stack: tuple[ServerThread, Client]) -> Iterator[World]:
    """A database and control plane of this test's own: the tests move the clock."""
    server, root = clock_stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=0)
    yield w
    w.close()


def eventually_rows(world: World, query: str, params: Any, count: int) -> list[tuple]:
    """The rows of `query` once there are at least `count` of them."""
    deadline = time.monotonic() + 30
    while len(rows := world.sql(query, params)) < count:
        assert time.monotonic() < deadline, rows
        time.sleep(0.05)
    return rows


def cdi_names(world: World, allocation_id: str) -> list[str]:
    """The CDI names of the allocation's devices (`bcd.dev/gpu=<uuid>`)."""
    return [f"bcd.dev/gpu={d}" for d in world.sql("SELECT device_ids FROM allocations WHERE id = %s",
                                                   (allocation_id,))[0][0]]


def report(node: Enrolled, world: World, allocation_id: str, kind: str, **fields: Any) -> None:
    """Store a node-signed report of `kind` about the allocation, as the gateway does, and wake."""
    body = node_pb2.Report(node_id=node.node_id, sequence=next(_SEQUENCE), time=int(time.time() * 1000))
    if kind == "bound":  # naming the allocation's devices as bcd names them, unless told otherwise
        fields.setdefault("cdi_devices", cdi_names(world, allocation_id))
        body.bound.CopyFrom(node_pb2.AllocationBound(allocation_id=allocation_id, **fields))
    elif kind == "released":
        body.released.CopyFrom(node_pb2.AllocationReleased(allocation_id=allocation_id, reason="unassigned"))
    raw = body.SerializeToString()
    rid = world.sql("SELECT reservation_id FROM allocations WHERE id = %s", (allocation_id,))[0][0]
    world.sql("INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)"
              " VALUES (%s, %s, %s, %s, %s, %s)",
              (node.node_id, allocation_id, kind, raw, node.key_id, sign(node.keys.signing, raw)))
    world.sql("SELECT wake_reservation(%s)", (rid,))


def test_a_report_that_arrives_while_placed_is_judged_at_the_start(world: World, node: Enrolled) -> None:
    now = world.root.admin("GetClock", apb.GetClockRequest()).now
    r = world.create(count=2, start=now + HOUR, duration="2h")
    alloc = r.allocations[0].id
    report(node, world, alloc, "bound")
    # The wake-up the report scheduled has run (the worker took every item due now) ...
    deadline = time.monotonic() + 30
    while world.sql("SELECT 1 FROM work_items WHERE subject = %s AND run_at <= compute_now()", (r.id,)):
        assert time.monotonic() < deadline, "the reservation's wake-up never ran"
        time.sleep(0.05)
    assert world.sql("SELECT last_error FROM work_items WHERE subject = %s AND last_error IS NOT NULL", (r.id,)) == []
    # ... and left the report unjudged: not before the start.
    assert get(world, r.id).state == "placed"
    assert world.sql("SELECT judged_at FROM node_reports WHERE allocation_id = %s", (alloc,)) == [(None,)]
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=HOUR))
    active = eventually(world, r.id, lambda x: x.state == "active")
    # At the start itself, not after the 5-minute bind timeout: the clock stands at the start.
    assert world.root.admin("GetClock", apb.GetClockRequest()).now < r.during.start + 5 * 60_000
    assert active.binding.attested and list(active.binding.cdi_devices) == cdi_names(world, alloc)


def test_released_by_the_node_is_binding_lost_until_bound_again(world: World, node: Enrolled) -> None:
    r = world.create(count=2, duration="8h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    report(node, world, alloc, "bound")
    eventually(world, r.id, lambda x: x.state == "active")
    report(node, world, alloc, "released")
    lost = eventually(world, r.id, lambda x: any(c.reason == "BindingLost" for c in x.conditions))
    assert lost.state == "active"
    assert next(c for c in lost.conditions if c.reason == "BindingLost").type == "Degraded"
    report(node, world, alloc, "bound")
    healed = eventually(world, r.id, lambda x: not any(c.reason == "BindingLost" for c in x.conditions))
    assert healed.state == "active" and [a.state for a in healed.allocations] == ["bound"]


@pytest.mark.parametrize("own", [True, False])
def test_a_cgroup_parent_counts_only_when_it_is_the_allocations_own_slice(
    world: World, node: Enrolled, own: bool, clock_stack: tuple[ServerThread, Client]
) -> None:
    # A hold with limits (it books the host's per-GPU share, on a daemon that enforces them): only
    # such a hold has a slice.
    world.sql("INSERT INTO host_resources (node_id, resource, allocatable) VALUES"
              " (%(n)s, 'vcpu', 66), (%(n)s, 'memoryGiB', 512)", {"n": node.node_id})
    world.sql("UPDATE nodes SET labels = labels || jsonb_build_object('bc.dev/cap.devices.limits',"
              " jsonb_build_object('value', 'true', 'source', 'system')) WHERE id = %s", (node.node_id,))
    server = clock_stack[0]
    server.call(server.app.runtime.capacity.barrier())
    r = world.create(count=1, duration="8h")
    assert r.request.resources.vcpu == 8
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    other = world.create(count=1, duration="8h").allocations[0].id
    parent = f"bcd-alloc-{alloc if own else other}.slice"
    report(node, world, alloc, "bound", cgroup_parent=parent, env_file=f"/run/bcd/allocations/{alloc}.env")
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert active.binding.cgroup_parent == (parent if own else "")
    assert active.binding.env_file == f"/run/bcd/allocations/{alloc}.env"


def test_a_release_signed_by_another_key_does_not_lose_the_binding(world: World, node: Enrolled) -> None:
    """Failure and release reports are checked like bound ones: a forgery cannot evict a hold."""
    r = world.create(count=1, duration="8h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    report(node, world, alloc, "bound")
    eventually(world, r.id, lambda x: x.state == "active")
    impostor = enrol(world.conninfo, world.pool_id, "impostor")
    report(impostor, world, alloc, "released")
    rejected = eventually(world, r.id, lambda x: bool(world.sql(
        "SELECT 1 FROM events WHERE subject = %s AND type = 'reservation.binding-rejected'",
        (f"reservation/{r.id}",))))
    assert rejected.state == "active" and not any(c.reason == "BindingLost" for c in rejected.conditions)
    assert world.sql("SELECT data->>'reason' FROM events WHERE subject = %s AND"
                     " type = 'reservation.binding-rejected'", (f"reservation/{r.id}",)) == [
        ("certificate of another node",)]
    assert [a.state for a in get(world, r.id).allocations] == ["bound"]


def test_a_kubernetes_binding_keeps_no_cgroup_parent_even_when_the_node_names_its_own_slice(
    world: World, node: Enrolled
) -> None:
    """Its pods live in the kubelet's cgroups: Get shows no cgroupParent for it, whatever is reported."""
    world.sql("UPDATE pools SET policy = policy || '{\"kubernetes\": true}' WHERE id = %s", (world.pool_id,))
    world.sql("UPDATE nodes SET labels = labels || jsonb_build_object('bc.dev/cap.binding.kubernetes',"
              " jsonb_build_object('value', 'true', 'source', 'system')) WHERE id = %s", (node.node_id,))
    r = world.create(count=1, duration="8h", binding="kubernetes")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    report(node, world, alloc, "bound", cgroup_parent=f"bcd-alloc-{alloc}.slice")
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert active.binding.cgroup_parent == "" and list(active.binding.cdi_devices) == cdi_names(world, alloc)


def test_a_signed_bound_report_naming_other_devices_never_binds(world: World, node: Enrolled) -> None:
    """The node's genuine signature over "bound" for this allocation, naming GPUs that are not the
    allocation's (another allocation's on the same node, or one too many): the binding `get`
    answers is what the workload runs with, so it never counts; binding-rejected says why."""
    first = world.create(count=2, duration="8h")
    mine = eventually(world, first.id, lambda x: x.state == "binding").allocations[0]
    other = world.create(count=2, duration="8h")
    theirs = eventually(world, other.id, lambda x: x.state == "binding").allocations[0]
    report(node, world, mine.id, "bound", cdi_devices=cdi_names(world, theirs.id))
    report(node, world, mine.id, "bound", cdi_devices=[*cdi_names(world, mine.id), *cdi_names(world, theirs.id)[:1]])
    rejected = eventually_rows(world, "SELECT data->>'reason' FROM events WHERE subject = %s"
                               " AND type = 'reservation.binding-rejected'", (f"reservation/{first.id}",), 2)
    assert {r for (r,) in rejected} == {reports.NOT_ALLOCATED}
    assert get(world, first.id).state == "binding"
    report(node, world, mine.id, "bound")  # its own devices: bound
    assert list(eventually(world, first.id, lambda x: x.state == "active").binding.cdi_devices) == \
        cdi_names(world, mine.id)
