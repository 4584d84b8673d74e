"""The kubernetes binding (spec "Bindings"), end to end through the real control plane, gateway and
nodesim processes; the test plays the kubelet.

- Only a pool with policy.kubernetes, and only its owner tenant, may book it (INVALID_INPUT naming
  binding otherwise).
- It places only on nodes whose daemon advertises binding.kubernetes (the system label written from
  Hello); an operator label of that name does not count.
- The node binds it like a hold, marks its CDI spec for its device plugin and gives it no cgroup
  slice; its device plugins (one per resource: bcd.dev/gpu, bcd.dev/gpu.mig, bcd.dev/gpu.slot)
  register with the kubelet and each advertises exactly the devices of its class until the
  reservation ends; Allocate answers their CDI names.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from k8s.deviceplugin.v1beta1 import api_pb2 as dp
from k8s.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from nodesim.deviceplugin import KUBELET_SOCKET, PLUGIN_DIR, UnixPath
from tests.support import World, make_world, rpc_error
from tests.test_e2e import Fleet, Stack, eventually, fleet_factory, stack  # noqa: F401 (fixtures)

CAP_LABEL = "bc.dev/cap.binding.kubernetes"
A100 = "A100-SXM4-40GB"
# The node's plugins: resource -> socket (a kubelet takes one resource per plugin socket).
PLUGINS = {"bcd.dev/gpu": "bcd-gpu.sock", "bcd.dev/gpu.mig": "bcd-gpu.mig.sock",
           "bcd.dev/gpu.slot": "bcd-gpu.slot.sock"}


@pytest.fixture
def world(stack: Stack) -> Iterator[World]:  # noqa: F811
    """A tenant whose own pool has policy.kubernetes (and no nodes until a fleet joins it). Its GPUs
    carry no host share (perGpu 0), so a plain hold books no host resources and may place on an
    older daemon (spec "Host resources")."""
    w = kubernetes_world(stack)
    yield w
    w.close()


def kubernetes_world(stack: Stack) -> World:
    """A new tenant with its own pool of policy.kubernetes, perGpu 0, and no nodes."""
    w = make_world(stack.endpoint, stack.root, stack.conninfo, nodes=0)
    w.pool_id = stack.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=w.tenant, name="k8s", region="eu-1",
        policy=apb.PoolPolicy(kubernetes=True, per_gpu=apb.PerGpuShare(vcpu=0, memory_gib=0)))).id
    return w


def kubernetes(world: World, count: int = 1, **kw) -> pb.Reservation:
    return world.create(count=count, binding="kubernetes", **kw)


def node_of(world: World, name: str) -> apb.Node:
    return next(n for n in world.root.admin("ListNodes", apb.ListNodesRequest(pool_id=world.pool_id)).items
                if n.name == name)


# -- who may book it ---------------------------------------------------------------------------


def test_a_pool_without_policy_kubernetes_refuses_the_binding(stack: Stack) -> None:  # noqa: F811
    plain = make_world(stack.endpoint, stack.root, stack.conninfo, nodes=0)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            kubernetes(plain)
        code, reason, details = rpc_error(exc)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and reason == "INVALID_INPUT"
        assert details["field"] == "binding" and details["poolId"] == plain.pool_id
        assert plain.create().state == "pending"  # a hold in the same pool is fine (no nodes: pending)
    finally:
        plain.close()


def test_a_tenant_the_pool_is_offered_to_cannot_book_it_but_books_holds(stack: Stack, world: World) -> None:  # noqa: F811
    guest = make_world(stack.endpoint, stack.root, stack.conninfo, nodes=0)
    try:
        stack.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
        with pytest.raises(grpc.RpcError) as exc:
            kubernetes(guest, pool_id=world.pool_id)
        code, reason, details = rpc_error(exc)
        assert reason == "INVALID_INPUT" and details["field"] == "binding"
        assert "owner" in exc.value.details()
        assert guest.create(pool_id=world.pool_id).state == "pending"  # holds are the guest's way
        assert kubernetes(world).state == "pending"  # the owner may (no nodes yet: pending)
    finally:
        guest.close()


# -- where it places ---------------------------------------------------------------------------


def test_only_nodes_whose_daemon_advertises_the_binding_are_chosen(stack: Stack, world: World) -> None:  # noqa: F811
    fleet = Fleet(stack, world, 2)
    try:
        fleet.start("--fault-nodes", fleet.names[1], "--no-capabilities")  # an older daemon
        _only_capable_nodes(world, fleet)
    finally:
        fleet.stop()


def _only_capable_nodes(world: World, fleet: Fleet) -> None:
    capable, legacy = node_of(world, fleet.names[0]), node_of(world, fleet.names[1])
    labels = dict(world.sql("SELECT id, labels FROM nodes WHERE pool_id = %s", (world.pool_id,)))
    assert labels[capable.id][CAP_LABEL] == {"value": "true", "source": "system"}
    assert CAP_LABEL not in labels[legacy.id]

    first = kubernetes(world, count=8)
    assert first.state == "placed" and first.allocations[0].node_id == capable.id
    # The capable node is full; the legacy node is free but never chosen for this binding.
    waiting = kubernetes(world, count=8)
    assert waiting.state == "pending"
    assert "without the selected labels" in waiting.conditions[0].message

    # An operator label of the same name does not count: the placer reads the label's source.
    world.sql("UPDATE nodes SET labels = labels || jsonb_build_object(%s::text, "
              "jsonb_build_object('value', 'true', 'source', 'operator')) WHERE id = %s", (CAP_LABEL, legacy.id))
    assert kubernetes(world, count=8).state == "pending"
    hold = world.create(count=8)  # a plain hold needs no capability
    assert hold.state == "placed" and hold.allocations[0].node_id == legacy.id


# -- the kubelet's view ------------------------------------------------------------------------


class Kubelet(dp_grpc.RegistrationServicer):
    """The kubelet's Registration service on kubelet.sock in one node's sandbox."""

    def __init__(self, directory) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.requests: queue.Queue[dp.RegisterRequest] = queue.Queue()
        self._socket = UnixPath(directory / KUBELET_SOCKET)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        dp_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(self._socket.address())
        self.server.start()

    def Register(self, request: dp.RegisterRequest, context) -> dp.Empty:
        self.requests.put(request)
        return dp.Empty()

    def plugin(self, endpoint: str) -> tuple[grpc.Channel, dp_grpc.DevicePluginStub, UnixPath]:
        path = UnixPath(self.dir / endpoint)
        channel = grpc.insecure_channel(path.address())
        return channel, dp_grpc.DevicePluginStub(channel), path

    def stop(self) -> None:
        self.server.stop(grace=None)
        self._socket.close()


def registrations(kubelet: Kubelet) -> dict[str, dp.RegisterRequest]:
    """The node's registrations, one per plugin, by resource name (they come in any order)."""
    got: dict[str, dp.RegisterRequest] = {}
    while len(got) < len(PLUGINS):
        request = kubelet.requests.get(timeout=30)
        got[request.resource_name] = request
    assert {r: (q.version, q.endpoint) for r, q in got.items()} == {r: ("v1beta1", e) for r, e in PLUGINS.items()}
    return got


def watch(stub: dp_grpc.DevicePluginStub) -> tuple[queue.Queue, grpc.Future]:
    """ListAndWatch in a thread: every list it sends, as (id, health) pairs."""
    lists: queue.Queue[list[tuple[str, str]]] = queue.Queue()
    call = stub.ListAndWatch(dp.Empty())

    def read() -> None:
        try:
            for response in call:
                lists.put([(d.ID, d.health) for d in response.devices])
        except grpc.RpcError:
            pass

    threading.Thread(target=read, daemon=True).start()
    return lists, call


def next_list(lists: queue.Queue, want, seconds: float = 30) -> list[tuple[str, str]]:
    """Lists until one matches `want` (the plugin sends a new list at each change)."""
    deadline = time.monotonic() + seconds
    while True:
        got = lists.get(timeout=max(0.1, deadline - time.monotonic()))
        if got == want:
            return got


def test_the_device_plugin_advertises_the_bound_devices_to_the_kubelet_until_release(
        world: World, fleet_factory) -> None:  # noqa: F811
    fleet: Fleet = fleet_factory(1, "--kubelet-retry", "0.2")
    node = node_of(world, fleet.names[0])
    kubelet = Kubelet(fleet.sandbox / fleet.names[0] / PLUGIN_DIR)  # after the node started: it retries
    channel = path = None
    try:
        registered = registrations(kubelet)["bcd.dev/gpu"]
        channel, stub, path = kubelet.plugin(registered.endpoint)
        assert stub.GetDevicePluginOptions(dp.Empty(), timeout=10).get_preferred_allocation_available
        lists, call = watch(stub)
        assert lists.get(timeout=30) == []  # nothing bound yet

        r = kubernetes(world, count=2, duration="8h")
        active = eventually(world, r.id, lambda x: x.state == "active")
        devices = sorted(active.allocations[0].device_ids)
        assert active.allocations[0].node_id == node.id
        assert active.binding.cgroup_parent == ""  # its pods live in the kubelet's cgroups
        assert sorted(active.binding.cdi_devices) == [f"bcd.dev/gpu={d}" for d in devices]
        next_list(lists, [(d, "Healthy") for d in devices])

        # On disk: bound like a hold, its CDI spec marked for the plugin, no cgroup slice.
        root = fleet.sandbox / fleet.names[0]
        spec = json.loads((root / f"etc/cdi/bcd-{active.allocations[0].id}.json").read_text())
        assert spec["annotations"]["bcd.dev/binding"] == "kubernetes"
        assert "bcd.dev/cgroup-parent" not in spec["annotations"]
        assert not (root / f"sys/fs/cgroup/bcd.slice/bcd-alloc-{active.allocations[0].id}.slice").exists()

        answer = stub.Allocate(dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=devices)]), timeout=10)
        assert [c.name for c in answer.container_responses[0].cdi_devices] == [f"bcd.dev/gpu={d}" for d in devices]
        other = "GPU-never-advertised"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Allocate(dp.AllocateRequest(container_requests=[
                dp.ContainerAllocateRequest(devices_ids=[devices[0], other])]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
        next_list(lists, [])  # the devices leave the kubelet when the reservation ends
        with pytest.raises(grpc.RpcError) as gone:
            stub.Allocate(dp.AllocateRequest(container_requests=[
                dp.ContainerAllocateRequest(devices_ids=devices[:1])]), timeout=10)
        assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        call.cancel()
        channel.close()
        path.close()
        channel = path = None

        # A restarted kubelet removes the plugins' sockets and listens anew: the plugin registers
        # again, on a fresh socket.
        kubelet.stop()
        for endpoint in PLUGINS.values():
            (kubelet.dir / endpoint).unlink()
        kubelet = Kubelet(kubelet.dir)
        again = registrations(kubelet)["bcd.dev/gpu"]
        channel, stub, path = kubelet.plugin(again.endpoint)
        lists, call = watch(stub)
        assert lists.get(timeout=30) == []
        call.cancel()
    finally:
        if channel is not None:
            channel.close()
        if path is not None:
            path.close()
        kubelet.stop()


def test_a_mig_kubernetes_binding_is_advertised_as_bcd_dev_gpu_mig(stack: Stack) -> None:  # noqa: F811
    """MIG instances bound for kubernetes reach the kubelet through their own plugin and resource."""
    world = make_world(stack.endpoint, stack.root, stack.conninfo, nodes=0)
    world.pool_id = stack.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="k8s-mig", region="eu-1",
        policy=apb.PoolPolicy(kubernetes=True, sharing=apb.SharingPolicy(mode="mig"),
                              per_gpu=apb.PerGpuShare(vcpu=0, memory_gib=0)))).id
    fleet = Fleet(stack, world, 1)
    kubelet = channels = None
    try:
        fleet.start("--kubelet-retry", "0.2", "--gpu-model", A100, "--gpu-memory-mib", "40960", "--mig-gpus", "2")
        kubelet = Kubelet(fleet.sandbox / fleet.names[0] / PLUGIN_DIR)
        registered = registrations(kubelet)
        mig_channel, mig, mig_path = kubelet.plugin(registered["bcd.dev/gpu.mig"].endpoint)
        gpu_channel, gpu, gpu_path = kubelet.plugin(registered["bcd.dev/gpu"].endpoint)
        channels = [(mig_channel, mig_path), (gpu_channel, gpu_path)]
        lists, call = watch(mig)
        assert lists.get(timeout=30) == []  # nothing bound yet

        # Booked (once UNSUPPORTED): the class has its own plugin.
        r = kubernetes(world, count=2, device_class="gpu.mig", profile="1g.5gb", duration="8h")
        active = eventually(world, r.id, lambda x: x.state == "active")
        devices = sorted(active.allocations[0].device_ids)
        assert len(devices) == 2 and all(":" in d for d in devices)  # "<uuid>:<instance>"
        assert active.binding.cgroup_parent == ""
        next_list(lists, [(d, "Healthy") for d in devices])

        answer = mig.Allocate(dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=devices)]), timeout=10)
        assert [c.name for c in answer.container_responses[0].cdi_devices] == [
            f"bcd.dev/gpu.mig={d}" for d in devices]
        assert sorted(active.binding.cdi_devices) == [f"bcd.dev/gpu.mig={d}" for d in devices]
        # The whole-GPU plugin does not advertise MIG instances.
        with pytest.raises(grpc.RpcError) as other_class:
            gpu.Allocate(dp.AllocateRequest(container_requests=[
                dp.ContainerAllocateRequest(devices_ids=devices[:1])]), timeout=10)
        assert other_class.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
        next_list(lists, [])  # the instances leave the kubelet when the reservation ends
        call.cancel()
    finally:
        for channel, path in channels or []:
            channel.close()
            path.close()
        if kubelet is not None:
            kubelet.stop()
        fleet.stop()
        world.close()
