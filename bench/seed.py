"""Seeding through the real Admin API: a tenant, its user and token, a pool of H100 nodes, a large
quota and a permissive Cedar policy (with --tenants, more tenants alike, the pool offered to them).
Nothing is written to the database directly."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import grpc

from bettercompute.v1 import admin_pb2 as a
from bettercompute.v1 import admin_pb2_grpc

TENANT = "bench"
IDENTITY = "bench-user"
MODEL = "H100-SXM5-80GB"
MEMORY_MIB = 81_559
POLICY = "permit(principal, action, resource);"
QUOTA = {"gpu": 10**12, "vcpu": 10**12, "memoryGiB": 10**12}
_UUIDS = uuid.UUID("6f1d6d3e-5a55-4c3e-9d8e-bc0000000001")


@dataclass
class Seeded:
    tenant_id: str
    pool_id: str
    token: str
    nodes: int
    gpus: int
    seconds: float
    placer: str = ""  # pool.policy.placer as the server answered it ("" = its default)
    callers: list[tuple[str, str]] = field(default_factory=list)  # (tenant, token) of every booking tenant


def tenant_name(k: int) -> str:
    """The k-th booking tenant (0: the pool's owner)."""
    return TENANT if k == 0 else f"{TENANT}-{k + 1}"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def node_request(pool_id: str, index: int, gpus_per_node: int) -> a.RegisterNodeRequest:
    """One HGX-style node: GPUs split over two NUMA nodes, all in one NVLink domain of its own."""
    domain = f"nvl-{index:05d}"
    gpus = [
        a.Gpu(
            uuid=f"GPU-{uuid.uuid5(_UUIDS, f'{index}/{g}')}",
            model=MODEL,
            memory_mib=MEMORY_MIB,
            numa_node=0 if g < gpus_per_node // 2 else 1,
            nvlink_domain=domain,
        )
        for g in range(gpus_per_node)
    ]
    return a.RegisterNodeRequest(
        pool_id=pool_id,
        name=f"h100-{index:05d}",
        gpus=gpus,
        labels={"rack": f"r{index // 32:03d}"},
        system_labels={"fabric.domain": domain},
    )


async def seed(
    channel: grpc.aio.Channel,
    root_token: str,
    *,
    nodes: int,
    gpus_per_node: int = 8,
    concurrency: int = 16,
    placer: str = "",
    tenants: int = 1,
) -> Seeded:
    admin = admin_pb2_grpc.AdminStub(channel)
    md = bearer(root_token)
    started = time.perf_counter()

    token = await _tenant(admin, md, 0)
    pool = await admin.CreatePool(
        a.CreatePoolRequest(
            owner_tenant_id=TENANT,
            name="h100-bench",
            region="bench-1",
            policy=a.PoolPolicy(sharing=a.SharingPolicy(mode="exclusive"), placer=placer),
        ),
        metadata=md,
    )
    callers = [(TENANT, token)]
    for k in range(1, tenants):  # the others book the pool through its offer
        other = tenant_name(k)
        callers.append((other, await _tenant(admin, md, k)))
        await admin.OfferPool(a.OfferPoolRequest(pool_id=pool.id, tenant_id=other), metadata=md)

    next_index = iter(range(nodes))
    done = 0
    t0 = time.perf_counter()

    async def register() -> None:
        nonlocal done
        for index in next_index:
            await admin.RegisterNode(node_request(pool.id, index, gpus_per_node), metadata=md, timeout=30)
            done += 1

    async def progress() -> None:
        while True:
            await asyncio.sleep(2)
            rate = done / (time.perf_counter() - t0)
            print(f"  seeding: {done}/{nodes} nodes registered ({rate:.0f}/s)", flush=True)

    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(register() for _ in range(concurrency)))
    finally:
        reporter.cancel()
    elapsed = time.perf_counter() - started
    print(f"  seeding: {nodes}/{nodes} nodes, {nodes * gpus_per_node} GPUs in {elapsed:.1f}s", flush=True)
    return Seeded(TENANT, pool.id, token, nodes, nodes * gpus_per_node, elapsed, pool.policy.placer, callers)


async def _tenant(admin: admin_pb2_grpc.AdminStub, md: tuple[tuple[str, str], ...], k: int) -> str:
    """The k-th booking tenant with its user, quota and permissive policy; the user's token."""
    tenant, identity = tenant_name(k), IDENTITY if k == 0 else f"{IDENTITY}-{k + 1}"
    await admin.CreateTenant(a.CreateTenantRequest(id=tenant, name=f"Benchmark tenant {k + 1}"), metadata=md)
    await admin.CreateIdentity(
        a.CreateIdentityRequest(id=identity, kind="user", name=f"Benchmark user {k + 1}", tenant_ids=[tenant]),
        metadata=md,
    )
    token = (await admin.CreateToken(a.CreateTokenRequest(identity_id=identity), metadata=md)).secret
    for resource, limit in QUOTA.items():
        await admin.SetQuota(a.SetQuotaRequest(tenant_id=tenant, resource=resource, limit=limit), metadata=md)
    await admin.PutPolicy(a.PutPolicyRequest(tenant_id=tenant, cedar=POLICY), metadata=md)
    return token
