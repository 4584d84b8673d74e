"""The node's kubelet device plugin (device plugin API v1beta1; spec "Bindings", kubernetes).

A kubelet takes one resource per plugin socket, so the node runs one plugin per device class:
`bcd.dev/gpu` (whole GPUs), `bcd.dev/gpu.mig` (MIG instances) and `bcd.dev/gpu.slot` (GPU slots).
Under the node's root, in the kubelet's directory `var/lib/kubelet/device-plugins/`:
- each plugin serves `DevicePlugin` on its own socket (`bcd-gpu.sock`, `bcd-gpu.mig.sock`,
  `bcd-gpu.slot.sock`);
- it registers its resource with the kubelet's `Registration` service on `kubelet.sock` once that
  socket exists, retrying while it does not, and again when a new kubelet (a new socket) appears.

Each advertises exactly the devices of its class in the node's live kubernetes bindings (the holds
whose CDI spec carries the kubernetes marker), Healthy, until the hold ends; ListAndWatch sends the
whole list again whenever it changes. Allocate answers the devices' CDI names (`bcd.dev/gpu=<uuid>`,
`bcd.dev/gpu.mig=<uuid>:<n>`, ...: the names of the hold's CDI spec) and refuses a device it does not
advertise. A plugin's socket is created when the kubelet is first found, so a node with no kubelet
costs one stat per retry period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import grpc
import structlog

from k8s.deviceplugin.v1beta1 import api_pb2 as dp
from k8s.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from nodesim.artefacts import DEVICE_CLASSES, VENDOR, Hold

API_VERSION = "v1beta1"
PLUGIN_DIR = Path("var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
REGISTER_TIMEOUT = 5.0
# A Unix socket path holds at most 107 bytes; a longer one is reached through the directory's fd.
_SUN_PATH_MAX = 100


def resource_of(device_class: str) -> str:
    return f"{VENDOR}/{device_class}"


def socket_of(device_class: str) -> str:
    return f"bcd-{device_class}.sock"


def advertised(holds: Iterable[Hold], device_class: str = "gpu") -> list[str]:
    """The device ids of live kubernetes bindings of one class, sorted, without repeats."""
    return sorted({d for h in holds if h.kubernetes and h.device_class == device_class for d in h.device_ids})


class UnixPath:
    """A Unix socket address usable however deep the sandbox is: the path itself when short enough,
    otherwise the same file through an open descriptor of its directory (/proc/self/fd/N/name)."""

    def __init__(self, path: Path) -> None:
        # Absolute: gRPC reads "unix://" + a relative path (".dev/sandbox/...") as "//.dev/sandbox/...".
        self.path = path.absolute()
        self._dir_fd: int | None = None

    def address(self) -> str:
        if len(str(self.path)) <= _SUN_PATH_MAX:
            return f"unix://{self.path}"
        if self._dir_fd is None:
            self._dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        return f"unix:///proc/self/fd/{self._dir_fd}/{self.path.name}"

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


class DevicePlugins:
    """The node's plugins, one per device class, told of every change of the holds together."""

    def __init__(self, root: Path, holds: Callable[[], Iterable[Hold]], node_name: str,
                 retry: float = 2.0) -> None:
        self.plugins = [DevicePlugin(root, holds, node_name, c) for c in DEVICE_CLASSES]
        self.retry = retry
        self._kubelet = str(root / PLUGIN_DIR / KUBELET_SOCKET)

    def changed(self) -> None:
        for plugin in self.plugins:
            plugin.changed()

    async def run(self) -> None:
        """Register each plugin with the kubelet whenever one (a new kubelet.sock) appears; serve
        meanwhile. One look at the socket per period for all the node's plugins: a fleet of
        thousands of nodes on one event loop pays it thousands of times a period."""
        for plugin in self.plugins:
            plugin.devices = advertised(plugin.holds(), plugin.device_class)
        registered: dict[str, tuple[int, int]] = {}  # device class -> the kubelet it registered with
        try:
            while True:
                kubelet = kubelet_identity(self._kubelet)
                if kubelet is not None:
                    for plugin in self.plugins:
                        if registered.get(plugin.device_class) != kubelet and await plugin.register():
                            registered[plugin.device_class] = kubelet
                await asyncio.sleep(self.retry)
        finally:
            for plugin in self.plugins:
                await plugin.stop()


def kubelet_identity(path: str) -> tuple[int, int] | None:
    """The kubelet socket's inode and change time (a new kubelet makes a new socket); None without one."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


class DevicePlugin(dp_grpc.DevicePluginServicer):
    """The plugin of one device class (resource `bcd.dev/<class>`)."""

    def __init__(self, root: Path, holds: Callable[[], Iterable[Hold]], node_name: str,
                 device_class: str = "gpu") -> None:
        self.dir = root / PLUGIN_DIR
        self.holds = holds
        self.device_class = device_class
        self.resource = resource_of(device_class)
        self.endpoint = socket_of(device_class)
        self.devices: list[str] = []
        self.registrations = 0
        self._changed = asyncio.Condition()
        self._server: grpc.aio.Server | None = None
        self._socket = UnixPath(self.dir / self.endpoint)
        self._kubelet = UnixPath(self.dir / KUBELET_SOCKET)
        self.log = structlog.get_logger("nodesim.deviceplugin").bind(node=node_name, resource=self.resource)

    # -- the node's side ---------------------------------------------------------------------

    def changed(self) -> None:
        """The node's holds changed: wake the ListAndWatch streams when the device list did."""
        devices = advertised(self.holds(), self.device_class)
        if devices == self.devices:
            return
        self.devices = devices
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def register(self) -> bool:
        await self._serve()
        request = dp.RegisterRequest(
            version=API_VERSION, endpoint=self.endpoint, resource_name=self.resource,
            options=dp.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True))
        try:
            async with grpc.aio.insecure_channel(self._kubelet.address()) as channel:
                await dp_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            self.log.info("kubelet registration failed; retrying", code=exc.code().name, details=exc.details())
            return False
        self.registrations += 1
        self.log.info("registered with the kubelet", devices=len(self.devices))
        return True

    async def _serve(self) -> None:
        path = self.dir / self.endpoint
        if self._server is not None and path.exists():
            return
        await self.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(self._socket.address())
        await server.start()
        self._server = server

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=0.5)
        self._socket.close()
        self._kubelet.close()

    # -- the kubelet's side (DevicePlugin) ---------------------------------------------------

    async def GetDevicePluginOptions(self, request: dp.Empty, context) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: dp.Empty, context) -> AsyncIterator[dp.ListAndWatchResponse]:
        sent: list[str] | None = None
        while True:
            async with self._changed:
                if sent == self.devices:
                    await self._changed.wait()
                devices = list(self.devices)
            if devices != sent:
                yield dp.ListAndWatchResponse(devices=[dp.Device(ID=d, health=HEALTHY) for d in devices])
                sent = devices

    async def GetPreferredAllocation(self, request: dp.PreferredAllocationRequest,
                                     context) -> dp.PreferredAllocationResponse:
        out = dp.PreferredAllocationResponse()
        for req in request.container_requests:
            chosen = list(dict.fromkeys(req.must_include_deviceIDs))
            chosen += [d for d in sorted(req.available_deviceIDs) if d not in chosen]
            out.container_responses.append(
                dp.ContainerPreferredAllocationResponse(deviceIDs=chosen[:max(req.allocation_size, 0)]))
        return out

    async def Allocate(self, request: dp.AllocateRequest, context) -> dp.AllocateResponse:
        offered = set(self.devices)
        out = dp.AllocateResponse()
        for req in request.container_requests:
            unknown = [d for d in req.devices_ids if d not in offered]
            if unknown:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"devices not advertised by this plugin: {', '.join(unknown)}")
            out.container_responses.append(dp.ContainerAllocateResponse(
                cdi_devices=[dp.CDIDevice(name=f"{self.resource}={d}") for d in req.devices_ids]))
        return out

    async def PreStartContainer(self, request: dp.PreStartContainerRequest,
                                context) -> dp.PreStartContainerResponse:
        return dp.PreStartContainerResponse()
