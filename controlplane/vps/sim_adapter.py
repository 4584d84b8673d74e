"""The adapter to the simulated provider (providersim): the provider interface over its gRPC API.
One channel per endpoint, shared by the process; every call has a deadline."""

from __future__ import annotations

import asyncio
import weakref

import grpc

from bettercompute.provider.v1 import provider_pb2 as pb
from bettercompute.provider.v1 import provider_pb2_grpc as rpc
from controlplane.vps.provider import ProviderFailure, ProviderInstance, ProviderReservation

_KINDS = {grpc.StatusCode.NOT_FOUND: "not-found", grpc.StatusCode.RESOURCE_EXHAUSTED: "exhausted",
          grpc.StatusCode.FAILED_PRECONDITION: "invalid", grpc.StatusCode.ALREADY_EXISTS: "invalid"}

# Channels by event loop (a channel belongs to the loop that made it), then by endpoint.
_CHANNELS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, grpc.aio.Channel]] = (
    weakref.WeakKeyDictionary())


def _instance(i: pb.Instance) -> ProviderInstance:
    return ProviderInstance(name=i.name, flavor=i.flavor, reservation=i.reservation, state=i.state)


class SimProvider:
    def __init__(self, endpoint: str, timeout_seconds: float) -> None:
        channels = _CHANNELS.setdefault(asyncio.get_running_loop(), {})
        channel = channels.get(endpoint)
        if channel is None:
            channel = channels[endpoint] = grpc.aio.insecure_channel(endpoint)
        self._stub = rpc.ProviderStub(channel)
        self._timeout = timeout_seconds

    async def _call(self, method: str, request: object) -> object:
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise ProviderFailure(_KINDS.get(exc.code(), "unavailable"), exc.details() or exc.code().name) from None

    async def list_reservations(self, account: str) -> list[ProviderReservation]:
        found = await self._call("ListReservations", pb.ListReservationsRequest(account=account))
        return [ProviderReservation(r.name, r.flavor, r.region, r.total, r.state) for r in found.items]

    async def create_instance(self, account: str, name: str, flavor: str, region: str,
                              reservation: str) -> ProviderInstance:
        return _instance(await self._call("CreateInstance", pb.CreateInstanceRequest(
            account=account, name=name, flavor=flavor, region=region, reservation=reservation)))

    async def list_instances(self, account: str) -> list[ProviderInstance]:
        found = await self._call("ListInstances", pb.ListInstancesRequest(account=account))
        return [_instance(i) for i in found.items]

    async def stop_instance(self, account: str, name: str) -> ProviderInstance:
        return _instance(await self._call("StopInstance", pb.InstanceRef(account=account, name=name)))

    async def start_instance(self, account: str, name: str) -> ProviderInstance:
        return _instance(await self._call("StartInstance", pb.InstanceRef(account=account, name=name)))

    async def delete_instance(self, account: str, name: str) -> ProviderInstance:
        return _instance(await self._call("DeleteInstance", pb.InstanceRef(account=account, name=name)))


def connect(provider: str, endpoint: str, timeout_seconds: float) -> SimProvider:
    """The provider of an account row (provider kind and endpoint)."""
    if provider != "sim":
        raise ValueError(f"no adapter for provider {provider!r}")
    return SimProvider(endpoint, timeout_seconds)
