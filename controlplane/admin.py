"""The operator's domain: tenants, identities, pools, offers, nodes, quotas, policies.
Node rows are written by their owner, controlplane.nodes; these check the operator's input and call it.

Tokens live in `controlplane.tokens`. Callers must be members of the root tenant (checked by the
servicer through `Caller.require_root`).
"""

from __future__ import annotations

import re
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import admin_queries as q
from controlplane import authorize, db, db_errors, errors, iam, quota, tokens
from controlplane.common import devices
from controlplane.common.names import (GPU_UUID, IDEMPOTENCY_KEY, IDENTITY_ID, LABEL, MODEL, NODE_NAME, POOL_ID,
                                       TENANT_ID, match)
from controlplane.ids import keyed_id, new_id, request_hash
from controlplane.nodes import connectivity as node_connectivity
from controlplane.nodes import health as node_health
from controlplane.nodes import registry as node_registry
from controlplane.placement import lease
from controlplane.runtime import Runtime

KINDS = {"user", "service", "agent"}
QUOTA_RESOURCES = re.compile(r"^(gpu(:[A-Za-z0-9._-]{1,64})?|vcpu|memoryGiB)$")
SYSTEM_LABEL_PREFIXES = ("bc.dev/", "fabric.domain")


async def create_tenant(rt: Runtime, tenant_id: str, name: str) -> dict[str, Any]:
    match("id", tenant_id, TENANT_ID)
    if tenant_id.startswith(tokens.SECRET_PREFIX):  # the per-call log shows such a value as a token's prefix
        raise errors.InvalidInput("id", f"must not start with {tokens.SECRET_PREFIX!r}, the prefix of API tokens")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute(q.INSERT_TENANT, {"id": tenant_id, "name": name or tenant_id})
        row = await (await conn.execute(q.TENANT, {"id": tenant_id})).fetchone()
        if name and row["name"] != name:  # a retry answers the tenant; another name under its id is refused
            raise errors.Conflict("a tenant with this id exists with another name", tenantId=tenant_id)
        return row

    return await db.run_in_transaction(rt.pool, work)


async def create_identity(rt: Runtime, raw: dict[str, Any]) -> dict[str, Any]:
    identity_id = match("id", raw.get("id", ""), IDENTITY_ID)
    kind = raw.get("kind") or "user"
    if kind not in KINDS:
        raise errors.InvalidInput("kind", f"must be one of {sorted(KINDS)}")
    delegation = raw.get("delegation") or {}
    person = delegation.get("person_identity_id") or None
    if (kind == "agent") != (person is not None):
        raise errors.InvalidInput("delegation", "an agent, and only an agent, names the person it acts for")
    if person == identity_id:  # it would be its own person, and approve what its delegation holds
        raise errors.InvalidInput("delegation.personIdentityId", "names the agent itself: an agent acts for a person")
    tenant_ids = [match("tenantIds", t, TENANT_ID) for t in raw.get("tenant_ids", [])]
    name = raw.get("name") or identity_id
    confirm = list(delegation.get("confirm_actions") or [])

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        if person is not None:  # an agent acts for a person: never for another agent, nor for one gone
            named = await (await conn.execute(q.PERSON, {"id": person})).fetchone()
            if named is not None and named["kind"] == "agent":
                raise errors.InvalidInput("delegation.personIdentityId", "names an agent: an agent acts for a person")
            if (named is not None and named["offboarded_at"] is not None
                    and await (await conn.execute(q.IDENTITY, {"id": identity_id})).fetchone() is None):
                raise errors.InvalidState("the person is offboarded: no new agent acts for it",
                                          personIdentityId=person, state="offboarded")
        await conn.execute(q.INSERT_IDENTITY, {
            "id": identity_id, "kind": kind, "name": name, "delegator_id": person, "confirm_actions": confirm})
        for tenant_id in tenant_ids:
            await conn.execute(q.INSERT_MEMBERSHIP, {"tenant_id": tenant_id, "identity_id": identity_id})
        row = await (await conn.execute(q.IDENTITY, {"id": identity_id})).fetchone()
        if row["kind"] != kind:
            raise errors.Conflict("an identity with this id exists with another kind", identityId=identity_id)
        # A retry answers the identity (and adds the memberships it names: again with only the id,
        # kind and tenants adds a membership); a name, person or confirm actions given that differ
        # from the identity's are another identity under its id, refused.
        if ((raw.get("name") and row["name"] != name) or row["delegator_id"] != person
                or (confirm and list(row["confirm_actions"] or []) != confirm)):
            raise errors.Conflict("an identity with this id exists with another name or delegation",
                                  identityId=identity_id)
        return row

    with db_errors.mapped(personIdentityId=person, tenantIds=",".join(tenant_ids)):
        return await db.run_in_transaction(rt.pool, work)



def _sharing(raw: dict[str, Any], max_replicas: int) -> dict[str, Any]:
    """policy.sharing: a mode of controlplane.common.devices ("time-slicing" read as "time-slice"),
    and replicas (0: the mode's default) only for the slot modes, at most max_replicas."""
    mode = raw.get("mode") or devices.EXCLUSIVE
    mode = devices.ALIASES.get(mode, mode)
    if mode not in devices.MODES:
        raise errors.InvalidInput("policy.sharing.mode", f"must be one of {list(devices.MODES)}")
    replicas = raw.get("replicas") or 0
    if replicas and mode not in devices.DEFAULT_REPLICAS:
        raise errors.InvalidInput("policy.sharing.replicas", "applies to the time-slice and mps modes only")
    if not 0 <= replicas <= max_replicas:
        raise errors.InvalidInput("policy.sharing.replicas", f"must be 0 (the mode's default) to {max_replicas}")
    return {"mode": mode, "replicas": replicas}


def _policy(raw: dict[str, Any], max_replicas: int = 64, default_placer: str = "inline",
            max_notice_s: int = 86_400) -> dict[str, Any]:
    placer = raw.get("placer") or default_placer
    if placer not in lease.PLACERS:
        raise errors.InvalidInput("policy.placer", f"must be one of {sorted(lease.PLACERS)}")
    return {"sharing": _sharing(raw.get("sharing") or {}, max_replicas),
            "kubernetes": bool(raw.get("kubernetes")), "tenantRoot": bool(raw.get("tenant_root")),
            "placer": placer, **_host_policy(raw), **_spot_policy(raw, max_notice_s)}


def _spot_policy(raw: dict[str, Any], max_notice_s: int) -> dict[str, Any]:
    """policy.spot {noticeSeconds}: kept only when set (0 or unset: the default notice)."""
    notice = int(raw.get("spot_notice_seconds") or 0)
    if not 0 <= notice <= max_notice_s:
        raise errors.InvalidInput("policy.spotNoticeSeconds", f"must be 0 (the default, 30) to {max_notice_s}")
    return {"spot": {"noticeSeconds": notice}} if notice else {}


def _host_policy(raw: dict[str, Any]) -> dict[str, Any]:
    """policy.perGpu {vcpu, memoryGiB} (each optional) and policy.hostReserve {vcpu} (default 2)."""
    out: dict[str, Any] = {}
    per_gpu = raw.get("per_gpu")
    if per_gpu is not None:
        share = {}
        for field, key, cap in (("vcpu", "vcpu", 4096), ("memory_gib", "memoryGiB", 65536)):
            value = per_gpu.get(field)
            if value is not None:
                if not 0 <= int(value) <= cap:
                    raise errors.InvalidInput(f"policy.perGpu.{key}", f"must be 0 to {cap}")
                share[key] = int(value)
        out["perGpu"] = share
    reserve = raw.get("host_reserve")
    if reserve is not None and reserve.get("vcpu") is not None:
        if not 0 <= int(reserve["vcpu"]) <= 4096:
            raise errors.InvalidInput("policy.hostReserve.vcpu", "must be 0 to 4096")
        out["hostReserve"] = {"vcpu": int(reserve["vcpu"])}
    return out


async def create_pool(rt: Runtime, raw: dict[str, Any], caller_id: str = "") -> dict[str, Any]:
    """A pool. With an idempotency key its id is derived from the caller and the key and the
    normalised request's hash is stored: a retry answers the same pool, another request under the
    key is CONFLICT. Without one (not retry-safe) every call makes a pool."""
    owner = match("ownerTenantId", raw.get("owner_tenant_id", ""), TENANT_ID)
    name = match("name", raw.get("name", ""), NODE_NAME)
    policy = _policy(raw.get("policy") or {}, rt.settings.max_sharing_replicas, rt.settings.default_placer,
                     rt.settings.max_spot_notice_seconds)
    region = raw.get("region") or ""
    key = raw.get("idempotency_key") or ""
    if key:
        match("idempotencyKey", key, IDEMPOTENCY_KEY)
    pool_id = keyed_id("pool", 52, "CreatePool", caller_id, key) if key else new_id("pool")
    digest = request_hash({"ownerTenantId": owner, "name": name, "region": region, "policy": policy}) if key else None

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        made = await (await conn.execute(q.INSERT_POOL, {
            "id": pool_id, "owner": owner, "name": name, "region": region, "policy": Jsonb(policy),
            "request_hash": digest})).fetchone()
        if made is None:  # the key's pool exists (ON CONFLICT (id) DO NOTHING waited for its writer)
            return await _keyed_pool(conn, pool_id, digest)
        await lease.announce(conn, pool_id, policy)
        return await (await conn.execute(q.POOLS, {"id": pool_id, "owner": None})).fetchone()

    with db_errors.mapped(tenantId=owner):
        return await db.run_in_transaction(rt.pool, work)


async def _keyed_pool(conn: AsyncConnection, pool_id: str, digest: str | None) -> dict[str, Any]:
    row = await (await conn.execute(q.POOLS, {"id": pool_id, "owner": None})).fetchone()
    if row["request_hash"] != digest:
        raise errors.Conflict("this idempotency key was used with another request", poolId=pool_id)
    return row


async def offer_pool(rt: Runtime, pool_id: str, tenant_id: str) -> dict[str, Any]:
    match("poolId", pool_id, POOL_ID)
    match("tenantId", tenant_id, TENANT_ID)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        pool = await (await conn.execute(q.POOL_FOR_OFFERS, {"pool_id": pool_id})).fetchone()
        if pool is not None:  # else the insert's foreign key says NOT_FOUND
            _not_the_owner(pool, tenant_id)  # an offer WithdrawPoolOffer would refuse
        await conn.execute(q.INSERT_OFFER, {"pool_id": pool_id, "tenant_id": tenant_id})
        return await (await conn.execute(q.POOLS, {"id": pool_id, "owner": None})).fetchone()

    with db_errors.mapped(poolId=pool_id, tenantId=tenant_id):
        return await db.run_in_transaction(rt.pool, work)


async def withdraw_pool_offer(rt: Runtime, pool_id: str, tenant_id: str) -> dict[str, Any]:
    """Take the offer of `pool_id` back from `tenant_id`: the tenant no longer sees the pool, so
    it creates, previews and extends nothing more there; its reservations made before run their
    course. Refused for the pool's owner and while the tenant holds a live grant on the pool."""
    match("poolId", pool_id, POOL_ID)
    match("tenantId", tenant_id, TENANT_ID)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        pool = await (await conn.execute(q.POOL_FOR_OFFERS, {"pool_id": pool_id})).fetchone()
        if pool is None:
            raise errors.NotFound("no such pool", poolId=pool_id)
        if await (await conn.execute(q.TENANT_EXISTS, {"tenant_id": tenant_id})).fetchone() is None:
            raise errors.NotFound("no such tenant", tenantId=tenant_id)
        _not_the_owner(pool, tenant_id)
        await conn.execute(q.LOCK_OFFER, {"pool_id": pool_id, "tenant_id": tenant_id})
        grant = await (await conn.execute(q.LIVE_GRANT_ON_POOL, {"pool_id": pool_id, "tenant_id": tenant_id})).fetchone()
        if grant is not None:
            raise errors.InvalidState("the tenant holds a live reservation grant on this pool: end it first",
                                      grantId=grant["id"], poolId=pool_id, tenantId=tenant_id)
        await conn.execute(q.DELETE_OFFER, {"pool_id": pool_id, "tenant_id": tenant_id})
        return await (await conn.execute(q.POOLS, {"id": pool_id, "owner": None})).fetchone()

    return await db.run_in_transaction(rt.pool, work)


def _not_the_owner(pool: dict[str, Any], tenant_id: str) -> None:
    """An offer is to a tenant other than the pool's owner, who always sees its pool."""
    if pool["owner_tenant_id"] == tenant_id:
        raise errors.InvalidInput("tenantId", "owns the pool: its owner always sees it", poolId=pool["id"])


async def list_pools(rt: Runtime, owner: str | None) -> list[dict[str, Any]]:
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(q.POOLS, {"id": None, "owner": owner or None})).fetchall()


def _labels(raw: dict[str, Any]) -> dict[str, dict[str, str]]:
    labels: dict[str, dict[str, str]] = {}
    for key, value in (raw.get("labels") or {}).items():
        match(f"labels[{key!r}]", key, LABEL)
        match(f"labels[{key!r}]", value, LABEL)
        if key.startswith(SYSTEM_LABEL_PREFIXES):
            raise errors.InvalidInput(f"labels[{key!r}]", "is a system label; operators cannot set it")
        labels[key] = {"value": value, "source": "operator"}
    for key, value in (raw.get("system_labels") or {}).items():
        match(f"systemLabels[{key!r}]", key, LABEL)
        match(f"systemLabels[{key!r}]", value, LABEL)
        labels[key] = {"value": value, "source": "system"}
    return labels


async def register_node(rt: Runtime, raw: dict[str, Any]) -> dict[str, Any]:
    pool_id = match("poolId", raw.get("pool_id", ""), POOL_ID)
    name = match("name", raw.get("name", ""), NODE_NAME)
    gpus = raw.get("gpus") or []
    seen: set[str] = set()
    for i, gpu in enumerate(gpus):
        match(f"gpus[{i}].uuid", gpu.get("uuid") or "", GPU_UUID)
        if gpu["uuid"] in seen:
            raise errors.InvalidInput(f"gpus[{i}].uuid", "must be present and unique on the node")
        seen.add(gpu["uuid"])
        match(f"gpus[{i}].model", gpu.get("model") or "", MODEL)
    labels = _labels(raw)
    return await node_registry.register(rt.pool, pool_id=pool_id, name=name, labels=labels,
                                        capabilities=list(raw.get("capabilities") or []), gpus=gpus)


async def set_node_state(rt: Runtime, node_id: str, state: str) -> dict[str, Any]:
    if state not in ("ready", "cordoned"):
        raise errors.InvalidInput("state", "must be 'ready' or 'cordoned'")
    return await node_health.set_state(rt.pool, node_id, state)


async def set_gpu_health(rt: Runtime, node_id: str, device_uuid: str, health: str) -> dict[str, Any]:
    """Quarantine or restore a GPU (and its MIG instances and slots), under the pool lock."""
    if health not in ("healthy", "unhealthy"):
        raise errors.InvalidInput("health", "must be 'healthy' or 'unhealthy'")
    return await node_health.set_gpu_health(rt.pool, node_id, device_uuid, health)


async def set_node_connectivity(rt: Runtime, node_id: str, connectivity: str) -> dict[str, Any]:
    if connectivity not in ("connected", "unreachable"):
        raise errors.InvalidInput("connectivity", "must be 'connected' or 'unreachable'")
    return await node_connectivity.set_by_operator(rt.pool, node_id, connectivity)


async def list_nodes(rt: Runtime, pool_id: str) -> list[dict[str, Any]]:
    match("poolId", pool_id, POOL_ID)
    async with db.read_only(rt.pool) as conn:
        if await (await conn.execute(q.POOL_EXISTS, {"pool_id": pool_id})).fetchone() is None:
            raise errors.NotFound("no such pool", poolId=pool_id)
    return await node_registry.list_pool(rt.pool, pool_id)


async def set_quota(rt: Runtime, tenant_id: str, resource: str, limit: int) -> dict[str, Any]:
    match("tenantId", tenant_id, TENANT_ID)
    match("resource", resource, QUOTA_RESOURCES)
    if limit < 0:
        raise errors.InvalidInput("limit", "must be at least 0")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await quota.set_limit(conn, tenant_id, resource, limit)
        return {"tenant_id": tenant_id, "resource": resource, "limit": limit}

    with db_errors.mapped(tenantId=tenant_id):
        return await db.run_in_transaction(rt.pool, work)


async def quota_usage(rt: Runtime, tenant_id: str) -> list[dict[str, Any]]:
    match("tenantId", tenant_id, TENANT_ID)
    async with db.read_only(rt.pool) as conn:
        if await (await conn.execute(q.TENANT_EXISTS, {"tenant_id": tenant_id})).fetchone() is None:
            raise errors.NotFound("no such tenant", tenantId=tenant_id)
        return await quota.usage(conn, tenant_id)


async def put_policy(rt: Runtime, tenant_id: str, cedar: str) -> dict[str, Any]:
    match("tenantId", tenant_id, TENANT_ID)
    iam.validate_policy(cedar, rt.settings.max_policy_nesting)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        row = await (await conn.execute(q.UPSERT_POLICY, {"tenant_id": tenant_id, "cedar": cedar})).fetchone()
        await authorize.access_changed(conn, tenant_id)  # open streams decide again before their next event
        return row

    with db_errors.mapped(tenantId=tenant_id):
        return await db.run_in_transaction(rt.pool, work)
