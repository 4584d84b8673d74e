"""Servicers for Reservations and Confirmations: parse, call one domain function, convert."""

from __future__ import annotations

import grpc

from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import reservations_pb2_grpc as rpc
from controlplane import confirmations
from controlplane.api import convert
from controlplane.api.interceptor import caller, caller_or_unverified
from controlplane.reservations import admission, extend, lifecycle, reads
from controlplane.runtime import Runtime

Ctx = grpc.aio.ServicerContext


class ReservationsServicer(rpc.ReservationsServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Create(self, request: pb.CreateReservationRequest, context: Ctx) -> pb.Reservation:
        return convert.reservation(
            await admission.create(self.rt, caller_or_unverified(), convert.create_input(request))
        )

    async def Get(self, request: pb.GetReservationRequest, context: Ctx) -> pb.Reservation:
        return convert.reservation(await reads.get(self.rt, caller(), request.tenant_id, request.reservation_id))

    async def List(self, request: pb.ListReservationsRequest, context: Ctx) -> pb.ListReservationsResponse:
        rows, next_cursor = await reads.list_(self.rt, caller(), convert.list_input(request))
        return pb.ListReservationsResponse(items=[convert.reservation(r) for r in rows], next_cursor=next_cursor)

    async def Extend(self, request: pb.ExtendReservationRequest, context: Ctx) -> pb.ExtendReservationResponse:
        which = request.WhichOneof("change")
        raw = {"until": request.until if which == "until" else None, "by": request.by if which == "by" else None,
               "idempotency_key": request.idempotency_key}
        result = await extend.extend(self.rt, caller(), request.tenant_id, request.reservation_id, raw)
        return pb.ExtendReservationResponse(reservation=convert.reservation(result["reservation"]),
                                            extended=result["extended"], available_until=result.get("available_until"))

    async def Renew(self, request: pb.RenewReservationRequest, context: Ctx) -> pb.Reservation:
        return convert.reservation(await lifecycle.renew(self.rt, caller(), request.tenant_id, request.reservation_id))

    async def Release(self, request: pb.ReleaseReservationRequest, context: Ctx) -> pb.Reservation:
        return convert.reservation(
            await lifecycle.release(self.rt, caller(), request.tenant_id, request.reservation_id)
        )

    async def Cancel(self, request: pb.CancelReservationRequest, context: Ctx) -> pb.Reservation:
        return convert.reservation(await lifecycle.cancel(self.rt, caller(), request.tenant_id, request.reservation_id))


class ConfirmationsServicer(rpc.ConfirmationsServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Get(self, request: pb.GetConfirmationRequest, context: Ctx) -> pb.Confirmation:
        return convert.confirmation(
            await confirmations.get(self.rt, caller(), request.tenant_id, request.confirmation_id)
        )

    async def Approve(self, request: pb.DecideConfirmationRequest, context: Ctx) -> pb.Confirmation:
        return convert.confirmation(
            await confirmations.decide(self.rt, caller(), request.tenant_id, request.confirmation_id, True)
        )

    async def Reject(self, request: pb.DecideConfirmationRequest, context: Ctx) -> pb.Confirmation:
        return convert.confirmation(
            await confirmations.decide(self.rt, caller(), request.tenant_id, request.confirmation_id, False)
        )
