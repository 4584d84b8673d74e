"""MIG instances and slots end to end through real processes (control plane, gateway, nodesim):
nodesim presents MIG-partitioned GPUs (`--mig-gpus`), the control plane books their instances, and
the node binds them under the CDI names `bcd.dev/gpu.mig=<uuid>:<instance>` and
`bcd.dev/gpu.slot=<uuid>:<n>`, files checked on disk."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World, make_world, rpc_error
from tests.test_e2e import Fleet, Stack, eventually, stack  # noqa: F401 (fixtures)
from tests.test_nodesim import cdi_problems

A100 = "A100-SXM4-40GB"


def shared_world(stack: Stack, mode: str, replicas: int = 0) -> World:  # noqa: F811
    w = make_world(stack.endpoint, stack.root, stack.conninfo, nodes=0)
    w.pool_id = stack.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=w.tenant, name=mode, region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode=mode, replicas=replicas)))).id
    return w


@pytest.fixture
def fleets() -> Iterator[list[Fleet]]:
    started: list[Fleet] = []
    yield started
    for fleet in started:
        fleet.stop()


def on_disk(fleet: Fleet, alloc: pb.Allocation) -> tuple[dict, dict[str, str]]:
    """The allocation's CDI spec (checked against the CDI schema) and env file on its node."""
    node_dir = fleet.node_dir(alloc.node_id)
    text = (node_dir / "etc" / "cdi" / f"bcd-{alloc.id}.json").read_text()
    assert cdi_problems(text) == []
    env_text = (node_dir / "run" / "bcd" / "allocations" / f"{alloc.id}.env").read_text()
    return json.loads(text), dict(line.split("=", 1) for line in env_text.splitlines() if line)


def gone(fleet: Fleet, alloc: pb.Allocation) -> None:
    path = fleet.node_dir(alloc.node_id) / "etc" / "cdi" / f"bcd-{alloc.id}.json"
    deadline = time.monotonic() + 20
    while path.exists():
        assert time.monotonic() < deadline, "the node kept the CDI spec after the release"
        time.sleep(0.1)


def test_a_mig_hold_binds_under_gpu_mig_names(stack: Stack, fleets: list[Fleet]) -> None:  # noqa: F811
    world = shared_world(stack, "mig")
    fleet = Fleet(stack, world, 1)
    fleets.append(fleet)
    fleet.start("--gpu-model", A100, "--gpu-memory-mib", "40960", "--mig-gpus", "2")
    node_id = fleet.world.root.admin("ListNodes", apb.ListNodesRequest(pool_id=world.pool_id)).items[0].id
    kinds = world.sql("SELECT kind, bookable, profile, count(*) FROM atoms WHERE node_id = %s "
                      "GROUP BY 1, 2, 3 ORDER BY 1", (node_id,))
    assert kinds == [("gpu", False, "", 8), ("gpu.mig", True, "1g.5gb", 14)]  # A100 40GB: 1g.5gb

    # A profile no node has: pending, and the reason says what was looked for.
    missing = world.create(device_class="gpu.mig", count=1, profile="3g.20gb")
    assert missing.state == "pending"
    assert "MIG instance of profile 3g.20gb" in missing.conditions[0].message

    r = world.create(device_class="gpu.mig", count=2, profile="1g.5gb", duration="8h")
    active = eventually(world, r.id, lambda x: x.state == "active")
    alloc = active.allocations[-1]
    assert all(":" in d for d in alloc.device_ids)
    assert sorted(active.binding.cdi_devices) == sorted(f"bcd.dev/gpu.mig={d}" for d in alloc.device_ids)
    spec, env = on_disk(fleet, alloc)
    assert spec["kind"] == "bcd.dev/gpu.mig"
    assert sorted(d["name"] for d in spec["devices"]) == sorted(alloc.device_ids)
    assert env["BCD_DEVICE_CLASS"] == "gpu.mig"
    assert sorted(env["BCD_CDI_DEVICES"].split(",")) == sorted(active.binding.cdi_devices)

    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    gone(fleet, alloc)
    world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=missing.id))

    # Quota in GPU equivalents: one GPU's quota is seven instances, not eight.
    world.quota(1)
    assert world.create(device_class="gpu.mig", count=7).state == "placed"
    with pytest.raises(grpc.RpcError) as exc:
        world.create(device_class="gpu.mig", count=1)
    _, reason, details = rpc_error(exc)
    assert (reason, details["resource"], details["used"], details["requested"]) == ("QUOTA_EXCEEDED", "gpu", "1",
                                                                                     "0.1429")
    world.close()


def test_a_slot_hold_binds_under_gpu_slot_names(stack: Stack, fleets: list[Fleet]) -> None:  # noqa: F811
    world = shared_world(stack, "time-slice", replicas=2)
    fleet = Fleet(stack, world, 1)
    fleets.append(fleet)
    fleet.start()
    r = world.create(device_class="gpu.slot", count=2, duration="8h")
    active = eventually(world, r.id, lambda x: x.state == "active")
    alloc = active.allocations[-1]
    assert sorted(active.binding.cdi_devices) == sorted(f"bcd.dev/gpu.slot={d}" for d in alloc.device_ids)
    spec, env = on_disk(fleet, alloc)
    assert spec["kind"] == "bcd.dev/gpu.slot"
    assert sorted(d["name"] for d in spec["devices"]) == sorted(alloc.device_ids)
    parents = {d.rsplit(":", 1)[0] for d in alloc.device_ids}
    assert set(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == parents  # a slot shares its whole GPU
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    gone(fleet, alloc)
    world.close()
