"""Host resources end to end through real processes (control plane, gateway, nodesim): the booked
resources reach the node as the assignment's limits, the FakeDaemon admits the hold against the
host's memory (resources-exhausted re-places it), writes the bcd-alloc-<alloc>.slice in the cgroup
v2 file formats, names it in the CDI spec and the env file, removes it after the release, and Get
shows binding.cgroupParent; only daemons that enforce limits take host resources.
"""

from __future__ import annotations

import json
import time

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World
from tests.test_e2e import Fleet, Stack, eventually, fleet_factory, stack, world  # noqa: F401 (fixtures)

GIB = 1 << 30
# nodesim's default host: 192 vCPUs on two NUMA nodes ("0-47,96-143" and "48-95,144-191"),
# 2048 GiB with 256 GiB of 1 GiB huge pages, eight GPUs (four per NUMA node).
NUMA_CPUS_LESS_RESERVE = {0: "2-47,96-143", 1: "48-95,144-191"}  # CPUs 0 and 1 are the host reserve


def node_ids(world: World) -> dict[str, str]:
    return {n.name: n.id for n in world.root.admin("ListNodes", apb.ListNodesRequest(pool_id=world.pool_id)).items}


def wait_until(check, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_limits_reach_the_node_as_a_slice_named_in_the_cdi_spec_and_env(world: World, fleet_factory) -> None:  # noqa: F811
    fleet = fleet_factory(1)
    world.quota(16, "memoryGiB")
    r = world.create(count=2, topology="numa", duration="8h", resources=pb.HostResources(hugepages_1gi=2))
    # The share: (192 - 2) / 8 vCPUs and 1792 / 8 GiB per GPU, times two; 2 GiB of huge pages above it.
    assert r.host_share == pb.HostResources(vcpu=47, memory_gib=448)
    active = eventually(world, r.id, lambda x: x.state == "active")
    alloc = active.allocations[-1]
    slice_name = f"bcd-alloc-{alloc.id}.slice"
    assert active.binding.cgroup_parent == slice_name

    (numa,) = {n for (n,) in world.sql("SELECT numa_node FROM atoms WHERE device_uuid = ANY(%s)",
                                       (list(alloc.device_ids),))}
    node_dir = fleet.node_dir(alloc.node_id)
    slice_dir = node_dir / "sys" / "fs" / "cgroup" / "bcd.slice" / slice_name
    files = {f.name: f.read_text() for f in slice_dir.iterdir()}
    assert files == {
        "cpu.max": "4700000 100000\n",
        "memory.max": f"{448 * GIB}\n",
        "hugetlb.1GB.max": f"{2 * GIB}\n",
        "cpuset.cpus": NUMA_CPUS_LESS_RESERVE[numa] + "\n",
        "cpuset.mems": f"{numa}\n",
    }
    spec = json.loads((node_dir / "etc" / "cdi" / f"bcd-{alloc.id}.json").read_text())
    assert spec["annotations"]["bcd.dev/cgroup-parent"] == slice_name
    env_path = node_dir / "run" / "bcd" / "allocations" / f"{alloc.id}.env"
    env = dict(line.split("=", 1) for line in env_path.read_text().splitlines() if line)
    assert env["BCD_CGROUP_PARENT"] == slice_name
    assert f"BCD_CGROUP_PARENT={slice_name}" in spec["containerEdits"]["env"]

    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    wait_until(lambda: not slice_dir.exists(), "the node kept the slice after the release")
    assert not env_path.exists()


def test_a_hold_the_hosts_memory_cannot_take_fails_resources_exhausted_and_places_again(
    world: World, fleet_factory  # noqa: F811
) -> None:
    fleet = fleet_factory(2)
    nodes = node_ids(world)
    first, second = nodes[fleet.names[0]], nodes[fleet.names[1]]
    # The control plane believes the first host has 8 TiB (an inventory it applied that the
    # daemon's own does not match); the daemon admits against its real 2048 GiB.
    world.sql("UPDATE nodes SET inventory = jsonb_set(inventory, '{memory_bytes}', to_jsonb(%s::bigint))"
              " WHERE id = %s", (8192 * GIB, first))
    world.sql("SELECT sync_host_resources(%s)", (first,))
    world.quota(10_000, "memoryGiB")
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=second, state="cordoned"))
    r1 = world.create(count=1, duration="8h", resources=pb.HostResources(memory_gib=1500))
    assert r1.allocations[0].node_id == first
    eventually(world, r1.id, lambda x: x.state == "active")

    r2 = world.create(count=1, duration="8h", resources=pb.HostResources(memory_gib=1500))
    assert r2.allocations[0].node_id == first  # beside r1: 3000 GiB, more than the host has
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=second, state="ready"))
    active = eventually(world, r2.id, lambda x: x.state == "active")
    assert active.binding.node_id == second
    assert [a.state for a in active.allocations] == ["failed", "bound"]
    failed = world.sql("SELECT body FROM node_reports WHERE allocation_id = %s AND kind = 'failed'",
                       (r2.allocations[0].id,))
    assert failed and b"resources-exhausted" in bytes(failed[0][0])
    assert get_state(world, r1.id) == "active"  # the hold already there is untouched


def get_state(world: World, rid: str) -> str:
    return world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=rid)).state


def test_host_resources_place_only_on_daemons_that_enforce_limits(stack: Stack, world: World) -> None:  # noqa: F811
    fleet = Fleet(stack, world, 2)
    try:
        fleet.start("--fault-nodes", fleet.names[1], "--no-capabilities")  # an older daemon on the second
        _only_enforcing(world, fleet)
    finally:
        fleet.stop()


def _only_enforcing(world: World, fleet: Fleet) -> None:
    nodes = node_ids(world)
    capable, legacy = nodes[fleet.names[0]], nodes[fleet.names[1]]
    labels = dict(world.sql("SELECT id, labels FROM nodes WHERE pool_id = %s", (world.pool_id,)))
    assert "bc.dev/cap.devices.limits" in labels[capable] and "bc.dev/cap.devices.limits" not in labels[legacy]
    first = world.create(count=8, duration="8h")  # books the pool's per-GPU share
    assert first.state == "placed" and first.allocations[0].node_id == capable
    waiting = world.create(count=8, duration="8h")  # the legacy node is free, but would run it unbounded
    assert waiting.state == "pending" and "without the selected labels" in waiting.conditions[0].message
    active = eventually(world, first.id, lambda x: x.state == "active")
    assert active.binding.cgroup_parent == f"bcd-alloc-{active.allocations[0].id}.slice"
