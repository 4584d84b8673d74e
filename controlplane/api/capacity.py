"""Servicer for the Capacity service."""

from __future__ import annotations

import grpc

from bettercompute.v1 import capacity_pb2 as pb
from bettercompute.v1 import capacity_pb2_grpc as rpc
from controlplane import capacity
from controlplane.api.interceptor import caller
from controlplane.runtime import Runtime


class CapacityServicer(rpc.CapacityServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Timeline(self, request: pb.TimelineRequest, context: grpc.aio.ServicerContext) -> pb.TimelineResponse:
        raw = {
            "tenant_id": request.tenant_id,
            "pool_id": request.pool_id,
            "from": getattr(request, "from") if request.HasField("from") else None,
            "to": request.to if request.HasField("to") else None,
            "step_minutes": request.step_minutes if request.HasField("step_minutes") else None,
        }
        out = await capacity.timeline(self.rt, caller(), raw)
        return pb.TimelineResponse(pool_id=out["pool_id"], allocatable=out["allocatable"],
                                   buckets=[pb.TimelineBucket(**b) for b in out["buckets"]])
