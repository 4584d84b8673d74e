"""Who may do what in the vps package: root-only calls, and the IAM actions (spec 001)."""

from __future__ import annotations

from typing import Any

from controlplane import authorize, errors
from controlplane.auth import Caller
from controlplane.bootstrap import ROOT_TENANT
from controlplane.common.names import TENANT_ID, match
from controlplane.runtime import Runtime

PROVIDERS_MANAGE = "compute:providers:manage"
QUOTAS_READ = "compute:quotas:read"
PROJECTS_MANAGE = "compute:projects:manage"
INSTANCES_MANAGE = "compute:instances:manage"
INSTANCES_READ = "compute:instances:read"
USAGE_READ = "compute:usage:read"


def require_root_tenant(caller: Caller, tenant_id: str) -> None:
    """`tenantId` must be the root tenant and the caller a member of it; anyone else ACCESS_DENIED."""
    match("tenantId", tenant_id, TENANT_ID)
    if tenant_id != ROOT_TENANT:
        raise errors.AccessDenied("this call is root only: tenantId must be the root tenant", tenantId=tenant_id)
    caller.require_member(tenant_id)


async def on_account(rt: Runtime, caller: Caller, account_id: str, **attributes: Any) -> None:
    """compute:providers:manage on the provider account, decided under the root tenant's policy."""
    await authorize.require(rt.pool, caller, ROOT_TENANT, PROVIDERS_MANAGE, "ProviderAccount", account_id,
                            {"accountId": account_id, **attributes}, accountId=account_id)


async def on_tenant(rt: Runtime, caller: Caller, tenant_id: str, action: str, **attributes: Any) -> None:
    """`action` on the tenant (a member of it, then IAM)."""
    match("tenantId", tenant_id, TENANT_ID)
    caller.require_member(tenant_id)
    await authorize.require(rt.pool, caller, tenant_id, action, "Tenant", tenant_id,
                            {"tenantId": tenant_id, **attributes}, tenantId=tenant_id)
