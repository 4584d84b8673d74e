"""Servicer for the Admin service: root only; each method calls one domain function."""

from __future__ import annotations

import grpc
from google.protobuf.json_format import MessageToDict

from bettercompute.v1 import admin_pb2 as pb
from bettercompute.v1 import admin_pb2_grpc as rpc
from controlplane import admin, clock, memberships, offboarding, tokens
from controlplane.api import convert
from controlplane.api.interceptor import caller
from controlplane.metal import profiles
from controlplane.runtime import Runtime

Ctx = grpc.aio.ServicerContext


def _root() -> None:
    caller().require_root()


def _plain(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True)


def _token(row: dict) -> pb.Token:
    return pb.Token(identity_id=row["identity_id"], secret=row.get("secret", ""), id=row["id"], prefix=row["prefix"],
                    created_at=row["created_ms"], expires_at=row["expires_ms"], revoked_at=row["revoked_ms"])


class AdminServicer(rpc.AdminServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def CreateTenant(self, request: pb.CreateTenantRequest, context: Ctx) -> pb.Tenant:
        _root()
        row = await admin.create_tenant(self.rt, request.id, request.name)
        return pb.Tenant(id=row["id"], name=row["name"])

    async def CreateIdentity(self, request: pb.CreateIdentityRequest, context: Ctx) -> pb.Identity:
        _root()
        return convert.identity(await admin.create_identity(self.rt, _plain(request)))

    async def CreateToken(self, request: pb.CreateTokenRequest, context: Ctx) -> pb.Token:
        _root()
        return _token(await tokens.mint(self.rt, request.identity_id, request.expires_at, request.ttl,
                                        request.idempotency_key, caller().identity_id))

    async def ListTokens(self, request: pb.ListTokensRequest, context: Ctx) -> pb.ListTokensResponse:
        _root()
        rows = await tokens.list_(self.rt, request.identity_id, request.include_inactive)
        return pb.ListTokensResponse(items=[_token(r) for r in rows])

    async def RevokeTokens(self, request: pb.RevokeTokensRequest, context: Ctx) -> pb.RevokeTokensResponse:
        _root()
        rows = await tokens.revoke(self.rt, request.token_id, request.prefix, request.identity_id)
        return pb.RevokeTokensResponse(items=[_token(r) for r in rows])

    async def CreatePool(self, request: pb.CreatePoolRequest, context: Ctx) -> pb.Pool:
        _root()
        return convert.pool(await admin.create_pool(self.rt, _plain(request), caller().identity_id))

    async def OfferPool(self, request: pb.OfferPoolRequest, context: Ctx) -> pb.Pool:
        _root()
        return convert.pool(await admin.offer_pool(self.rt, request.pool_id, request.tenant_id))

    async def WithdrawPoolOffer(self, request: pb.WithdrawPoolOfferRequest, context: Ctx) -> pb.Pool:
        _root()
        return convert.pool(await admin.withdraw_pool_offer(self.rt, request.pool_id, request.tenant_id))

    async def ListPools(self, request: pb.ListPoolsRequest, context: Ctx) -> pb.ListPoolsResponse:
        _root()
        return pb.ListPoolsResponse(
            items=[convert.pool(r) for r in await admin.list_pools(self.rt, request.owner_tenant_id)]
        )

    async def RegisterNode(self, request: pb.RegisterNodeRequest, context: Ctx) -> pb.Node:
        _root()
        return convert.node(await admin.register_node(self.rt, _plain(request)))

    async def SetNodeState(self, request: pb.SetNodeStateRequest, context: Ctx) -> pb.Node:
        _root()
        return convert.node(await admin.set_node_state(self.rt, request.node_id, request.state))

    async def ListNodes(self, request: pb.ListNodesRequest, context: Ctx) -> pb.ListNodesResponse:
        _root()
        return pb.ListNodesResponse(items=[convert.node(r) for r in await admin.list_nodes(self.rt, request.pool_id)])

    async def SetGpuHealth(self, request: pb.SetGpuHealthRequest, context: Ctx) -> pb.Node:
        _root()
        return convert.node(await admin.set_gpu_health(self.rt, request.node_id, request.device_uuid, request.health))

    async def SetNodeConnectivity(self, request: pb.SetNodeConnectivityRequest, context: Ctx) -> pb.Node:
        _root()
        return convert.node(await admin.set_node_connectivity(self.rt, request.node_id, request.connectivity))

    async def AdvanceClock(self, request: pb.AdvanceClockRequest, context: Ctx) -> pb.Clock:
        _root()
        return pb.Clock(**await clock.advance(self.rt, request.by_ms))

    async def GetClock(self, request: pb.GetClockRequest, context: Ctx) -> pb.Clock:
        _root()
        return pb.Clock(**await clock.read(self.rt))

    async def SetQuota(self, request: pb.SetQuotaRequest, context: Ctx) -> pb.Quota:
        _root()
        return pb.Quota(**await admin.set_quota(self.rt, request.tenant_id, request.resource, request.limit))

    async def GetQuotaUsage(self, request: pb.GetQuotaUsageRequest, context: Ctx) -> pb.QuotaUsage:
        _root()
        lines = await admin.quota_usage(self.rt, request.tenant_id)
        return pb.QuotaUsage(tenant_id=request.tenant_id, lines=[pb.QuotaLine(**line) for line in lines])

    async def PutPolicy(self, request: pb.PutPolicyRequest, context: Ctx) -> pb.Policy:
        _root()
        return pb.Policy(**await admin.put_policy(self.rt, request.tenant_id, request.cedar))

    async def OffboardIdentity(self, request: pb.OffboardIdentityRequest, context: Ctx) -> pb.OffboardIdentityResponse:
        _root()
        return pb.OffboardIdentityResponse(
            **await offboarding.offboard(self.rt, request.identity_id, request.successor_identity_id))

    async def RemoveMembership(self, request: pb.RemoveMembershipRequest, context: Ctx) -> pb.RemoveMembershipResponse:
        _root()
        return pb.RemoveMembershipResponse(**await memberships.remove(
            self.rt, request.identity_id, request.tenant_id, request.successor_identity_id))

    async def CreateNodeProfile(self, request: pb.CreateNodeProfileRequest, context: Ctx) -> pb.NodeProfile:
        _root()
        return convert.node_profile(await profiles.create(self.rt, request.id, request.description))

    async def AddNodeProfileVersion(self, request: pb.AddNodeProfileVersionRequest, context: Ctx) -> pb.NodeProfile:
        _root()
        return convert.node_profile(await profiles.add_version(
            self.rt, request.profile_id, request.version, request.image, request.checksum))

    async def GetNodeProfile(self, request: pb.GetNodeProfileRequest, context: Ctx) -> pb.NodeProfile:
        _root()
        return convert.node_profile(await profiles.get(self.rt, request.profile_id))

    async def ListNodeProfiles(self, request: pb.ListNodeProfilesRequest, context: Ctx) -> pb.ListNodeProfilesResponse:
        _root()
        return pb.ListNodeProfilesResponse(items=[convert.node_profile(r) for r in await profiles.list_(self.rt)])
