"""Servicers for provider accounts, projects, reservation grants, instances and usage: parse,
call one domain function of controlplane.vps, convert."""

from __future__ import annotations

from typing import Any

import grpc

from bettercompute.v1 import grants_pb2 as gpb
from bettercompute.v1 import grants_pb2_grpc as grpc_grants
from bettercompute.v1 import instances_pb2 as ipb
from bettercompute.v1 import instances_pb2_grpc as grpc_instances
from bettercompute.v1 import providers_pb2 as ppb
from bettercompute.v1 import providers_pb2_grpc as grpc_providers
from bettercompute.v1 import usage_pb2 as upb
from bettercompute.v1 import usage_pb2_grpc as grpc_usage
from controlplane.api.interceptor import caller
from controlplane.runtime import Runtime
from controlplane.vps import accounts, grants, instances, metering, scan

Ctx = grpc.aio.ServicerContext


def _account(row: dict[str, Any]) -> ppb.ProviderAccount:
    return ppb.ProviderAccount(id=row["id"], name=row["name"], provider=row["provider"], endpoint=row["endpoint"],
                               external_account=row["external_account"], created_at=row["created_ms"])


def _reservation(row: dict[str, Any]) -> ppb.ProviderReservation:
    return ppb.ProviderReservation(account_id=row["account_id"], reservation_id=row["reservation_id"],
                                   flavor=row["flavor"], region=row["region"], total=row["total"],
                                   state=row["state"], pool_id=row["pool_id"] or "", seen_at=row["seen_ms"])


def _grant(row: dict[str, Any]) -> gpb.ReservationGrant:
    return gpb.ReservationGrant(
        id=row["id"], account_id=row["account_id"], reservation_id=row["reservation_id"], pool_id=row["pool_id"],
        tenant_id=row["tenant_id"], project_id=row["project_id"] or "", slots=row["slots"],
        starts_at=row["starts_ms"], ends_at=row["ends_ms"], state=row["state"], reason=row["reason"] or "",
        created_at=row["created_ms"], region=row["region"], flavor=row["flavor"])


def _instance(row: dict[str, Any]) -> ipb.Instance:
    return ipb.Instance(
        id=row["id"], tenant_id=row["tenant_id"], project_id=row["project_id"] or "", pool_id=row["pool_id"],
        account_id=row["account_id"], reservation_id=row["reservation_id"], flavor=row["flavor"], name=row["name"],
        state=row["state"], grant_id=row["grant_id"] or "", placement=row["placement"], billing=row["billing"],
        created_at=row["created_ms"])


def _project(row: dict[str, Any]) -> ppb.Project:
    return ppb.Project(id=row["id"], tenant_id=row["tenant_id"], name=row["name"], created_at=row["created_ms"])


class ProviderAccountsServicer(grpc_providers.ProviderAccountsServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Create(self, request: ppb.CreateProviderAccountRequest, context: Ctx) -> ppb.ProviderAccount:
        return _account(await accounts.create(self.rt, caller(), {
            "tenant_id": request.tenant_id, "name": request.name, "provider": request.provider,
            "endpoint": request.endpoint, "external_account": request.external_account}))

    async def Get(self, request: ppb.GetProviderAccountRequest, context: Ctx) -> ppb.ProviderAccount:
        return _account(await accounts.get(self.rt, caller(), request.tenant_id, request.account_id))

    async def List(self, request: ppb.ListProviderAccountsRequest, context: Ctx) -> ppb.ListProviderAccountsResponse:
        rows = await accounts.list_(self.rt, caller(), request.tenant_id)
        return ppb.ListProviderAccountsResponse(items=[_account(r) for r in rows])

    async def Delete(self, request: ppb.GetProviderAccountRequest, context: Ctx) -> ppb.ProviderAccount:
        return _account(await accounts.delete(self.rt, caller(), request.tenant_id, request.account_id))

    async def BindReservation(self, request: ppb.BindReservationRequest, context: Ctx) -> ppb.ProviderReservation:
        return _reservation(await accounts.bind(self.rt, caller(), {
            "tenant_id": request.tenant_id, "account_id": request.account_id,
            "reservation_id": request.reservation_id, "pool_id": request.pool_id}))

    async def UnbindReservation(self, request: ppb.UnbindReservationRequest, context: Ctx) -> ppb.ProviderReservation:
        return _reservation(await accounts.unbind(self.rt, caller(), {
            "tenant_id": request.tenant_id, "account_id": request.account_id,
            "reservation_id": request.reservation_id}))

    async def ListReservations(self, request: ppb.GetProviderAccountRequest,
                               context: Ctx) -> ppb.ListProviderReservationsResponse:
        rows = await accounts.reservations(self.rt, caller(), request.tenant_id, request.account_id)
        return ppb.ListProviderReservationsResponse(items=[_reservation(r) for r in rows])

    async def ScanReservations(self, request: ppb.GetProviderAccountRequest,
                               context: Ctx) -> ppb.ListProviderReservationsResponse:
        rows = await scan.scan_now(self.rt, caller(), request.tenant_id, request.account_id)
        return ppb.ListProviderReservationsResponse(items=[_reservation(r) for r in rows])


class ProjectsServicer(grpc_providers.ProjectsServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Create(self, request: ppb.CreateProjectRequest, context: Ctx) -> ppb.Project:
        return _project(await accounts.create_project(self.rt, caller(), request.tenant_id, request.name))

    async def List(self, request: ppb.ListProjectsRequest, context: Ctx) -> ppb.ListProjectsResponse:
        rows = await accounts.list_projects(self.rt, caller(), request.tenant_id)
        return ppb.ListProjectsResponse(items=[_project(r) for r in rows])


class ReservationGrantsServicer(grpc_grants.ReservationGrantsServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Create(self, request: gpb.CreateReservationGrantRequest, context: Ctx) -> gpb.ReservationGrant:
        return _grant(await grants.create(self.rt, caller(), {
            "tenant_id": request.tenant_id, "account_id": request.account_id,
            "reservation_id": request.reservation_id, "grant_tenant_id": request.grant_tenant_id,
            "project_id": request.project_id if request.HasField("project_id") else None,
            "slots": request.slots, "starts_at": request.starts_at, "ends_at": request.ends_at,
            "idempotency_key": request.idempotency_key}))

    async def Get(self, request: gpb.GetReservationGrantRequest, context: Ctx) -> gpb.ReservationGrant:
        return _grant(await grants.get(self.rt, caller(), request.tenant_id, request.grant_id))

    async def List(self, request: gpb.ListReservationGrantsRequest, context: Ctx) -> gpb.ListReservationGrantsResponse:
        rows = await grants.list_(self.rt, caller(), request.tenant_id, request.all)
        return gpb.ListReservationGrantsResponse(items=[_grant(r) for r in rows])

    async def End(self, request: gpb.EndReservationGrantRequest, context: Ctx) -> gpb.ReservationGrant:
        return _grant(await grants.end(self.rt, caller(), request.tenant_id, request.account_id, request.grant_id))


class InstancesServicer(grpc_instances.InstancesServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Create(self, request: ipb.CreateInstanceRequest, context: Ctx) -> ipb.Instance:
        return _instance(await instances.create(self.rt, caller(), {
            "tenant_id": request.tenant_id, "pool_id": request.pool_id, "flavor": request.flavor,
            "name": request.name, "billing": request.billing, "idempotency_key": request.idempotency_key,
            "project_id": request.project_id if request.HasField("project_id") else None}))

    async def Get(self, request: ipb.InstanceRequest, context: Ctx) -> ipb.Instance:
        return _instance(await instances.get(self.rt, caller(), request.tenant_id, request.instance_id))

    async def List(self, request: ipb.ListInstancesRequest, context: Ctx) -> ipb.ListInstancesResponse:
        rows = await instances.list_(self.rt, caller(), request.tenant_id)
        return ipb.ListInstancesResponse(items=[_instance(r) for r in rows])

    async def Stop(self, request: ipb.InstanceRequest, context: Ctx) -> ipb.Instance:
        return _instance(await instances.stop(self.rt, caller(), request.tenant_id, request.instance_id))

    async def Start(self, request: ipb.InstanceRequest, context: Ctx) -> ipb.Instance:
        return _instance(await instances.start(self.rt, caller(), request.tenant_id, request.instance_id))

    async def Delete(self, request: ipb.InstanceRequest, context: Ctx) -> ipb.Instance:
        return _instance(await instances.delete(self.rt, caller(), request.tenant_id, request.instance_id))


class UsageServicer(grpc_usage.UsageServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Query(self, request: upb.QueryUsageRequest, context: Ctx) -> upb.QueryUsageResponse:
        found = await metering.query(self.rt, caller(), {
            "tenant_id": request.tenant_id, "meter": request.meter, "pool_id": request.pool_id,
            "from": request.__getattribute__("from"), "to": request.to if request.HasField("to") else None})
        return upb.QueryUsageResponse(
            items=[upb.UsageRecord(meter=r["meter"], subject=r["subject"], hour=r["hour_ms"], quantity=r["quantity"],
                                   region=r["region"], pool_id=r["pool_id"], provider=r["provider"])
                   for r in found["items"]],
            total=found["total"], truncated=found["truncated"])
