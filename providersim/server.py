"""The gRPC server of the simulated provider: the Provider API and the Simulator's controls."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from bettercompute.provider.v1 import provider_pb2 as pb
from bettercompute.provider.v1 import provider_pb2_grpc as rpc
from providersim.state import Instance, Provider, ProviderError, Reservation

log = structlog.get_logger(__name__)

_CODES = {"not-found": grpc.StatusCode.NOT_FOUND, "invalid": grpc.StatusCode.FAILED_PRECONDITION,
          "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED, "conflict": grpc.StatusCode.ALREADY_EXISTS}

class Faults:
    """The fault flags every Provider call passes through first."""

    def __init__(self, seed: int | None = None) -> None:
        self.failure_rate = 0.0
        self.stall_ms = 0
        self.lost_answer_rate = 0.0
        self.held: Counter[str] = Counter()  # calls being stalled now, by what they do (a test waits for its call)
        self._random = random.Random(seed)

    async def apply(self, context: grpc.aio.ServicerContext, what: str) -> None:
        if self.stall_ms > 0:
            self.held[what] += 1
            try:
                await asyncio.sleep(self.stall_ms / 1000)
            finally:
                self.held[what] -= 1
        if self.failure_rate > 0 and self._random.random() < self.failure_rate:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "simulated provider failure")

    async def answered(self, context: grpc.aio.ServicerContext) -> None:
        """After a call was carried out: its answer is lost at lost_answer_rate."""
        if self.lost_answer_rate > 0 and self._random.random() < self.lost_answer_rate:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "simulated lost answer")

def reservation_pb(r: Reservation, in_use: int) -> pb.Reservation:
    return pb.Reservation(account=r.account, name=r.name, flavor=r.flavor, region=r.region, total=r.total,
                          state=r.state, in_use=in_use)

def instance_pb(i: Instance) -> pb.Instance:
    return pb.Instance(account=i.account, name=i.name, flavor=i.flavor, region=i.region,
                       reservation=i.reservation, state=i.state, created_at=i.created_at)

async def _answer(context: grpc.aio.ServicerContext, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except ProviderError as exc:
        await context.abort(_CODES[exc.kind], str(exc))

class ProviderServicer(rpc.ProviderServicer):
    def __init__(self, state: Provider, faults: Faults) -> None:
        self.state = state
        self.faults = faults

    async def _call(self, context: grpc.aio.ServicerContext, what: str, call: Callable[[], Any]) -> Any:
        await self.faults.apply(context, what)
        answer = await _answer(context, call)
        await self.faults.answered(context)
        return answer

    async def ListReservations(self, request: pb.ListReservationsRequest, context: Any) -> pb.ListReservationsResponse:
        found = await self._call(context, "list_reservations", lambda: self.state.list_reservations(request.account))
        return pb.ListReservationsResponse(
            items=[reservation_pb(r, self.state.in_use(r.account, r.name)) for r in found])

    async def CreateInstance(self, request: pb.CreateInstanceRequest, context: Any) -> pb.Instance:
        return instance_pb(await self._call(context, "create_instance", lambda: self.state.create_instance(
            request.account, request.name, request.flavor, request.region, request.reservation)))

    async def GetInstance(self, request: pb.InstanceRef, context: Any) -> pb.Instance:
        return instance_pb(await self._call(context, "get_instance", lambda: self.state.get_instance(request.account, request.name)))

    async def ListInstances(self, request: pb.ListInstancesRequest, context: Any) -> pb.ListInstancesResponse:
        found = await self._call(context, "list_instances", lambda: self.state.list_instances(request.account))
        return pb.ListInstancesResponse(items=[instance_pb(i) for i in found])

    async def StopInstance(self, request: pb.InstanceRef, context: Any) -> pb.Instance:
        return instance_pb(await self._call(context, "stop_instance", lambda: self.state.stop_instance(request.account, request.name)))

    async def StartInstance(self, request: pb.InstanceRef, context: Any) -> pb.Instance:
        return instance_pb(await self._call(context, "start_instance", lambda: self.state.start_instance(request.account, request.name)))

    async def DeleteInstance(self, request: pb.InstanceRef, context: Any) -> pb.Instance:
        return instance_pb(await self._call(context, "delete_instance", lambda: self.state.delete_instance(request.account, request.name)))

class SimulatorServicer(rpc.SimulatorServicer):
    def __init__(self, state: Provider, faults: Faults) -> None:
        self.state = state
        self.faults = faults

    async def PutReservation(self, request: pb.PutReservationRequest, context: Any) -> pb.Reservation:
        found = await _answer(context, lambda: self.state.put_reservation(
            request.account, request.name, request.flavor, request.region, request.total, request.state))
        log.info("reservation put", account=request.account, name=request.name, total=request.total)
        return reservation_pb(found, self.state.in_use(found.account, found.name))

    async def DeleteReservation(self, request: pb.DeleteReservationRequest, context: Any) -> pb.Reservation:
        found = await _answer(context, lambda: self.state.delete_reservation(request.account, request.name))
        log.info("reservation deleted", account=request.account, name=request.name)
        return reservation_pb(found, 0)

    async def SetFaults(self, request: pb.Faults, context: Any) -> pb.Faults:
        if not 0 <= request.failure_rate <= 1 or request.stall_ms < 0 or not 0 <= request.lost_answer_rate <= 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "failure_rate and lost_answer_rate are 0..1, stall_ms at least 0")
        self.faults.failure_rate = request.failure_rate
        self.faults.stall_ms = request.stall_ms
        self.faults.lost_answer_rate = request.lost_answer_rate
        log.info("faults set", failure_rate=request.failure_rate, stall_ms=request.stall_ms,
                 lost_answer_rate=request.lost_answer_rate)
        return pb.Faults(failure_rate=self.faults.failure_rate, stall_ms=self.faults.stall_ms,
                         lost_answer_rate=self.faults.lost_answer_rate)

async def serve(listen: str = "127.0.0.1:0", *, seed: int | None = None) -> tuple[grpc.aio.Server, int, Provider, Faults]:
    """Start the simulated provider on `listen`; returns the server, its port, its state and its faults."""
    state, faults = Provider(), Faults(seed)
    server = grpc.aio.server()
    rpc.add_ProviderServicer_to_server(ProviderServicer(state, faults), server)
    rpc.add_SimulatorServicer_to_server(SimulatorServicer(state, faults), server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"cannot listen on {listen}")
    await server.start()
    return server, port, state, faults
