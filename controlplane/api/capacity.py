"""Servicer for the Capacity service."""

from __future__ import annotations

import grpc

from bettercompute.v1 import capacity_pb2 as pb
from bettercompute.v1 import capacity_pb2_grpc as rpc
from bettercompute.v1 import reservations_pb2 as rpb
from controlplane import capacity, preview
from controlplane.api import convert
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

    async def Preview(self, request: rpb.CreateReservationRequest, context: grpc.aio.ServicerContext) -> pb.PreviewResponse:
        out = await preview.preview(self.rt, caller(), convert.create_input(request))
        return pb.PreviewResponse(
            fits=out["fits"], pool_id=out["pool_id"], start=out["start"], end=out["end"],
            members=[pb.PreviewMember(**m) for m in out["members"]], group=out["group"],
            resources=convert.resources_message(out["resources"]) if out["resources"] else None,
            reason=out["reason"], filters=[pb.FilterCount(**f) for f in out["filters"]])

    async def Rollup(self, request: pb.RollupRequest, context: grpc.aio.ServicerContext) -> pb.RollupResponse:
        out = await capacity.rollup(self.rt, caller(), {"tenant_id": request.tenant_id, "pool_id": request.pool_id})
        return pb.RollupResponse(
            pool_id=out["pool_id"], total=pb.CapacityCounts(**out["total"]),
            models=[pb.ModelRollup(model=m["model"], counts=pb.CapacityCounts(**m["counts"])) for m in out["models"]],
            own_in_use=out["own_in_use"], own_reserved=out["own_reserved"],
            others_in_use=out["others_in_use"], others_reserved=out["others_reserved"],
            tenants=[pb.TenantUse(**t) for t in out["tenants"]])
