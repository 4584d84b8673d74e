"""The operator's domain: tenants, identities, pools, offers, nodes, quotas, policies.

Tokens live in `controlplane.tokens`. Callers must be members of the root tenant (checked by the
servicer through `Caller.require_root`).
"""

from __future__ import annotations

import re
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import admin_queries as q
from controlplane import db, db_errors, errors, iam, quota
from controlplane.ids import new_id
from controlplane.reservations.validate import LABEL, MODEL, POOL_ID, TENANT_ID, match
from controlplane.runtime import Runtime

IDENTITY_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
NODE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
KINDS = {"user", "service", "agent"}
SHARING_MODES = {"", "exclusive", "mig", "time-slice", "mps"}
QUOTA_RESOURCES = re.compile(r"^(gpu(:[A-Za-z0-9._-]{1,64})?|vcpu|memoryGiB)$")
SYSTEM_LABEL_PREFIXES = ("bc.dev/", "fabric.domain")


async def create_tenant(rt: Runtime, tenant_id: str, name: str) -> dict[str, Any]:
    match("id", tenant_id, TENANT_ID)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute(q.INSERT_TENANT, {"id": tenant_id, "name": name or tenant_id})
        return await (await conn.execute(q.TENANT, {"id": tenant_id})).fetchone()

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
    tenant_ids = [match("tenantIds", t, TENANT_ID) for t in raw.get("tenant_ids", [])]

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute(q.INSERT_IDENTITY, {
            "id": identity_id, "kind": kind, "name": raw.get("name") or identity_id, "delegator_id": person,
            "confirm_actions": list(delegation.get("confirm_actions") or [])})
        for tenant_id in tenant_ids:
            await conn.execute(q.INSERT_MEMBERSHIP, {"tenant_id": tenant_id, "identity_id": identity_id})
        row = await (await conn.execute(q.IDENTITY, {"id": identity_id})).fetchone()
        if row["kind"] != kind:
            raise errors.Conflict("an identity with this id exists with another kind", identityId=identity_id)
        return row

    with db_errors.mapped(personIdentityId=person, tenantIds=",".join(tenant_ids)):
        return await db.run_in_transaction(rt.pool, work)



def _policy(raw: dict[str, Any]) -> dict[str, Any]:
    sharing = raw.get("sharing") or {}
    mode = sharing.get("mode") or "exclusive"
    if mode not in SHARING_MODES:
        raise errors.InvalidInput("policy.sharing.mode", f"must be one of {sorted(SHARING_MODES - {''})}")
    return {"sharing": {"mode": mode, "replicas": sharing.get("replicas") or 0},
            "kubernetes": bool(raw.get("kubernetes")), "tenantRoot": bool(raw.get("tenant_root"))}


async def create_pool(rt: Runtime, raw: dict[str, Any]) -> dict[str, Any]:
    owner = match("ownerTenantId", raw.get("owner_tenant_id", ""), TENANT_ID)
    name = match("name", raw.get("name", ""), NODE_NAME)
    policy = _policy(raw.get("policy") or {})
    pool_id = new_id("pool")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute(q.INSERT_POOL, {"id": pool_id, "owner": owner, "name": name,
                                           "region": raw.get("region") or "", "policy": Jsonb(policy)})
        return await (await conn.execute(q.POOLS, {"id": pool_id, "owner": None})).fetchone()

    with db_errors.mapped(tenantId=owner):
        return await db.run_in_transaction(rt.pool, work)


async def offer_pool(rt: Runtime, pool_id: str, tenant_id: str) -> dict[str, Any]:
    match("poolId", pool_id, POOL_ID)
    match("tenantId", tenant_id, TENANT_ID)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute(q.INSERT_OFFER, {"pool_id": pool_id, "tenant_id": tenant_id})
        return await (await conn.execute(q.POOLS, {"id": pool_id, "owner": None})).fetchone()

    with db_errors.mapped(poolId=pool_id, tenantId=tenant_id):
        return await db.run_in_transaction(rt.pool, work)


async def list_pools(rt: Runtime, owner: str | None) -> list[dict[str, Any]]:
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(q.POOLS, {"id": None, "owner": owner or None})).fetchall()


_NODE = """
SELECT n.*, (SELECT count(*) FROM atoms a WHERE a.node_id = n.id AND a.kind = 'gpu') AS gpu_count
FROM nodes n WHERE (%(id)s::text IS NULL OR n.id = %(id)s) AND (%(pool)s::text IS NULL OR n.pool_id = %(pool)s)
ORDER BY n.name
"""


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
        if not gpu.get("uuid") or gpu["uuid"] in seen:
            raise errors.InvalidInput(f"gpus[{i}].uuid", "must be present and unique on the node")
        seen.add(gpu["uuid"])
        match(f"gpus[{i}].model", gpu.get("model") or "", MODEL)
    labels = _labels(raw)
    node_id = new_id("node")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        await conn.execute(
            "INSERT INTO nodes (id, pool_id, name, labels, capabilities, inventory)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (node_id, pool_id, name, Jsonb(labels), list(raw.get("capabilities") or []),
             Jsonb({"gpus": gpus})),
        )
        async with conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO atoms (id, node_id, kind, device_uuid, model, numa_node, nvlink_domain)"
                " VALUES (%s, %s, 'gpu', %s, %s, %s, %s)",
                [(new_id("atom"), node_id, g["uuid"], g.get("model") or "", g.get("numa_node") or 0,
                  g.get("nvlink_domain") or "") for g in gpus],
            )
        return await (await conn.execute(_NODE, {"id": node_id, "pool": None})).fetchone()

    with db_errors.mapped(poolId=pool_id, name=name):
        return await db.run_in_transaction(rt.pool, work)


async def set_node_state(rt: Runtime, node_id: str, state: str) -> dict[str, Any]:
    if state not in ("ready", "cordoned"):
        raise errors.InvalidInput("state", "must be 'ready' or 'cordoned'")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        cur = await conn.execute("UPDATE nodes SET state = %s WHERE id = %s", (state, node_id))
        if cur.rowcount == 0:
            raise errors.NotFound("no such node", nodeId=node_id)
        await conn.execute("SELECT wake_node_reservations(%s)", (node_id,))
        if state == "ready":
            pool = await (await conn.execute("SELECT pool_id FROM nodes WHERE id = %s", (node_id,))).fetchone()
            await conn.execute("SELECT pg_notify('bc_pool_freed', %s)", (pool["pool_id"],))
        return await (await conn.execute(_NODE, {"id": node_id, "pool": None})).fetchone()

    return await db.run_in_transaction(rt.pool, work)


async def set_gpu_health(rt: Runtime, node_id: str, device_uuid: str, health: str) -> dict[str, Any]:
    """Quarantine or restore a GPU (and its MIG instances and slots)."""
    if health not in ("healthy", "unhealthy"):
        raise errors.InvalidInput("health", "must be 'healthy' or 'unhealthy'")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        cur = await conn.execute(
            "UPDATE atoms SET health = %s WHERE node_id = %s AND device_uuid = %s", (health, node_id, device_uuid)
        )
        if cur.rowcount == 0:
            raise errors.NotFound("no such GPU on that node", nodeId=node_id, deviceUuid=device_uuid)
        await conn.execute("SELECT wake_node_reservations(%s)", (node_id,))
        return await (await conn.execute(_NODE, {"id": node_id, "pool": None})).fetchone()

    return await db.run_in_transaction(rt.pool, work)


async def set_node_connectivity(rt: Runtime, node_id: str, connectivity: str) -> dict[str, Any]:
    if connectivity not in ("connected", "unreachable"):
        raise errors.InvalidInput("connectivity", "must be 'connected' or 'unreachable'")

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        cur = await conn.execute(
            "UPDATE nodes SET connectivity = %s, last_seen = CASE WHEN %s = 'connected' THEN compute_now()"
            " ELSE last_seen END WHERE id = %s", (connectivity, connectivity, node_id))
        if cur.rowcount == 0:
            raise errors.NotFound("no such node", nodeId=node_id)
        await conn.execute("SELECT wake_node_reservations(%s)", (node_id,))
        return await (await conn.execute(_NODE, {"id": node_id, "pool": None})).fetchone()

    return await db.run_in_transaction(rt.pool, work)


async def list_nodes(rt: Runtime, pool_id: str) -> list[dict[str, Any]]:
    match("poolId", pool_id, POOL_ID)
    async with db.read_only(rt.pool) as conn:
        return await (await conn.execute(_NODE, {"id": None, "pool": pool_id})).fetchall()


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
        return await quota.usage(conn, tenant_id)


async def put_policy(rt: Runtime, tenant_id: str, cedar: str) -> dict[str, Any]:
    match("tenantId", tenant_id, TENANT_ID)
    iam.validate_policy(cedar)

    async def work(conn: AsyncConnection) -> dict[str, Any]:
        return await (await conn.execute(q.UPSERT_POLICY, {"tenant_id": tenant_id, "cedar": cedar})).fetchone()

    with db_errors.mapped(tenantId=tenant_id):
        return await db.run_in_transaction(rt.pool, work)
