"""What a node says about itself (Hello, Inventory) becomes its row, system labels, GPU atoms and
host resources. The node is not trusted for more than its own facts: malformed entries are
dropped, sizes no host has read as 0, and only system labels inventory owns are written
(`bc.dev/cap.*`, `fabric.domain`).

A GPU is one node's: a GPU whose uuid another node holds (gpu_holders, migration 0036: the first
node to report it, until its inventory drops it or it is revoked) is refused, as if not reported:
no atom, no MIG instances or slots, not in the stored GPU list. The refusal is logged, kept in the
stored inventory (`refused_gpus`, uuid and holder) and shown on the Admin API's Node; the node is
not cut off (its other GPUs serve), and its next inventory after the holder let go takes the GPU.
A leased machine's inventory (its tenant has root there) changes none of that until the machine is
the platform's again (`_apply_inventory`).

The node's pool lock first, then its row (controlplane.common.locks), so a placement that
re-reads labels and atoms under the pool lock never sees them change before it commits.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2
from controlplane import db, errors
from controlplane.common.names import GPU_UUID, LABEL, MODEL
from controlplane.config import Settings
from controlplane.ids import new_id
from controlplane.nodes import cpulist, hosts, queries, shared_atoms, tenancy
from controlplane.nodes.locking import lock_for_placement_change

log = structlog.get_logger("nodes.inventory")

CAPABILITY = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
CAP_PREFIX = "bc.dev/cap."
FABRIC = "fabric.domain"
SYSTEM = "system"
MAX_CAPABILITIES = 64
MAX_GPUS = 256
MAX_NUMA_NODES = 1024  # Linux's MAX_NUMNODES


def capabilities(hello: node_pb2.Hello) -> list[str]:
    good = sorted({c for c in hello.capabilities if CAPABILITY.fullmatch(c)})
    if len(good) != len(hello.capabilities):
        log.info("capabilities dropped", advertised=len(hello.capabilities), kept=len(good))
    return good[:MAX_CAPABILITIES]


def gpus(inventory: node_pb2.Inventory) -> list[node_pb2.Gpu]:
    kept: dict[str, node_pb2.Gpu] = {}
    for gpu in inventory.gpus[:MAX_GPUS]:
        if GPU_UUID.fullmatch(gpu.uuid) and MODEL.fullmatch(gpu.model) and gpu.uuid not in kept:
            kept[gpu.uuid] = gpu
    if len(kept) != len(inventory.gpus):
        log.info("inventory gpus dropped", reported=len(inventory.gpus), kept=len(kept))
    return list(kept.values())


def nvlink_domain(gpu: node_pb2.Gpu) -> str:
    domain = f"{gpu.nvlink_cluster}/{gpu.nvlink_clique}"
    return domain if gpu.nvlink_cluster and gpu.nvlink_clique and LABEL.fullmatch(domain) else ""


def cap_labels(labels: dict[str, Any], caps: list[str]) -> dict[str, Any]:
    kept = {k: v for k, v in labels.items() if not (k.startswith(CAP_PREFIX) and v.get("source") == SYSTEM)}
    kept.update({CAP_PREFIX + c: {"value": "true", "source": SYSTEM} for c in caps if LABEL.fullmatch(CAP_PREFIX + c)})
    return kept


def fabric_label(labels: dict[str, Any], gpu_list: list[node_pb2.Gpu]) -> dict[str, Any]:
    """`fabric.domain` is the GPUs' NVLink domain when they all agree; otherwise absent."""
    kept = {k: v for k, v in labels.items() if not (k == FABRIC and v.get("source") == SYSTEM)}
    domains = {nvlink_domain(g) for g in gpu_list}
    if len(domains) == 1 and "" not in domains:
        kept[FABRIC] = {"value": domains.pop(), "source": SYSTEM}
    return kept


_BOUNDS = Settings()  # read once, from the environment (README "Limits")
MAX_MEMORY = _BOUNDS.node_max_memory_bytes
MAX_VCPUS = cpulist.MAX_CPU + 1
MIB = 1 << 20


def bounded(value: int, most: int) -> int:
    """A size the node reports, read as 0 when negative or beyond `most`: the pool's per-GPU host
    share is made from them, and absurd ones overflowed it (every create in the pool INTERNAL)."""
    return value if 0 <= value <= most else 0


def inventory_json(inventory: node_pb2.Inventory, gpu_list: list[node_pb2.Gpu],
                   refused: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "generation": inventory.generation,
        **({"refused_gpus": refused} if refused else {}),
        "gpus": [{"uuid": g.uuid, "model": g.model, "memory_mib": g.memory_mib, "numa_node": max(0, g.numa_node),
                  "nvlink_cluster": g.nvlink_cluster, "nvlink_clique": g.nvlink_clique,
                  "nvlink_domain": nvlink_domain(g), "mig_mode": g.mig_mode,
                  "mig_instances": [{"index": m.index, "profile": m.profile} for m in g.mig_instances]}
                 for g in gpu_list],
        "numa_nodes": numa_json(inventory.numa_nodes),
        "isolated_cpus": cpulist.normalise(inventory.isolated_cpus),
        "memory_bytes": bounded(inventory.memory_bytes, MAX_MEMORY),
        "hugepages_2mi": bounded(inventory.hugepages_2mi, MAX_MEMORY // (2 * MIB)),
        "hugepages_1gi": bounded(inventory.hugepages_1gi, MAX_MEMORY // (1024 * MIB)),
        "vcpus": bounded(inventory.vcpus, MAX_VCPUS),
        **({"deployed": deployed_json(inventory.deployed)} if inventory.HasField("deployed") else {}),
    }


def numa_json(numa_nodes: Sequence[node_pb2.NumaNode]) -> list[dict[str, Any]]:
    """At most MAX_NUMA_NODES NUMA nodes, their cpulists together read within one list's bounds
    (cpulist.parse_all: 256 lists each within the bounds added up to seconds of the event loop)."""
    kept = numa_nodes[:MAX_NUMA_NODES]
    lists = cpulist.parse_all(n.cpulist for n in kept)
    return [{"id": n.id, "cpulist": cpulist.format_list(cpus), "memory_bytes": bounded(n.memory_bytes, MAX_MEMORY)}
            for n, cpus in zip(kept, lists)]


ALLOCATION_ID = re.compile(r"^alloc_[0-9a-hjkmnp-tv-z]{26}$")
PROFILE_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
CHECKSUM = re.compile(r"^sha256:[0-9a-f]{64}$")
DEPLOY_STATES = frozenset({"deploying", "deployed", "failed", "wiping", "wiped"})
MAX_IMAGE = 512
MAX_MESSAGE = 256


def deployed_json(d: node_pb2.DeployedProfile) -> dict[str, Any]:
    """What the node says is on its disk (whole-machine leases), bounded: a malformed id, profile,
    checksum or state reads as empty, so metal never matches it (controlplane.metal.deploy)."""
    def ok(value: str, pattern: re.Pattern[str]) -> str:
        return value if pattern.fullmatch(value) else ""

    return {"allocation_id": ok(d.allocation_id, ALLOCATION_ID), "profile_id": ok(d.profile_id, PROFILE_ID),
            "version": d.version, "image": d.image[:MAX_IMAGE].replace("\x00", ""),
            "checksum": ok(d.checksum, CHECKSUM), "state": d.state if d.state in DEPLOY_STATES else "",
            "message": d.message[:MAX_MESSAGE].replace("\x00", "")}


REFUSED_HELD = "held by another node"


async def held(conn: AsyncConnection, node_id: str, gpu_list: list[node_pb2.Gpu]
               ) -> tuple[list[node_pb2.Gpu], list[dict[str, str]]]:
    """The reported GPUs this node holds (taking those no node holds, letting go of those it no
    longer reports), and the refused ones: {uuid, reason, heldBy}."""
    uuids = sorted(g.uuid for g in gpu_list)
    await conn.execute(queries.HOLD_GPUS, {"node_id": node_id, "uuids": uuids})
    taken = {r["device_uuid"]: r["node_id"] for r in await (await conn.execute(
        queries.HELD_ELSEWHERE, {"node_id": node_id, "uuids": uuids})).fetchall()}
    await conn.execute(queries.RELEASE_GPUS, {"node_id": node_id, "held": [u for u in uuids if u not in taken]})
    if not taken:
        return gpu_list, []
    refused = [{"uuid": u, "reason": REFUSED_HELD, "heldBy": holder} for u, holder in taken.items()]
    log.warning("inventory gpus refused", node_id=node_id, reason=REFUSED_HELD, refused=refused)
    return [g for g in gpu_list if g.uuid not in taken], refused


async def _apply_inventory(conn: AsyncConnection, node: dict[str, Any], inventory: node_pb2.Inventory) -> dict:
    """Atoms, host resources and the stored inventory; returns the labels with `fabric.domain`.

    While a tenant holds the machine (`leased`: it has root there, so the inventory is its word)
    the machine is the lessee's whole as it was when the lease began: its GPU holds, atoms and
    `fabric.domain` stay as they were, and only the rest is stored (what is on its disk, which
    metal judges; its sizes, which the pool's host share leaves out while it is leased). A GPU
    another machine dropped for one inventory (its uuid known from the tenant's bindings) was the
    tenant's to keep from the platform; its own GPUs dropped were anyone's to claim; and every
    MIG-mode flip rewrote its atoms under the pool's lock."""
    if node.get("state") == tenancy.LEASED:
        await conn.execute(queries.SET_LEASED_INVENTORY, {"inventory": Jsonb(inventory_json(inventory, [])),
                                                          "generation": inventory.generation, "node_id": node["id"]})
        await hosts.sync_node(conn, node["id"])
        return node["labels"]
    gpu_list, refused = await held(conn, node["id"], gpus(inventory))
    async with conn.cursor() as cur:
        await cur.executemany(queries.UPSERT_GPU, [
            {"id": new_id("atom"), "node_id": node["id"], "uuid": g.uuid, "model": g.model,
             "numa_node": max(0, g.numa_node), "nvlink_domain": nvlink_domain(g)} for g in gpu_list])
    # (GPUs gone change the placement facts: `_wake_pool_if_changed` wakes their reservations)
    await conn.execute(queries.GPUS_GONE, {"node_id": node["id"], "present": [g.uuid for g in gpu_list]})
    await shared_atoms.apply(conn, node["id"], node["pool_id"], shared_atoms.from_inventory(gpu_list))
    await conn.execute(queries.DELETE_UNUSED_PARTS, {"node_id": node["id"]})
    await conn.execute(queries.DELETE_UNUSED_GPUS, {"node_id": node["id"], "present": [g.uuid for g in gpu_list]})
    await conn.execute(queries.SET_INVENTORY, {"inventory": Jsonb(inventory_json(inventory, gpu_list, refused)),
                                               "generation": inventory.generation, "node_id": node["id"]})
    await hosts.sync_node(conn, node["id"])  # bookable at once, not at the reconciler's next pass
    return fabric_label(node["labels"], gpu_list)


async def _placement_facts(conn: AsyncConnection, node_id: str) -> str:
    return (await (await conn.execute(queries.PLACEMENT_FACTS, {"node_id": node_id})).fetchone())["facts"]


async def _wake_pool_if_changed(conn: AsyncConnection, node: dict[str, Any], before: str) -> None:
    """New or returning GPUs, more host resources, new labels: the pool's pending reservations
    retry now. Nothing changed: no placer wakes (a node repeating its inventory in a loop made
    every placer of the pool re-plan once per message)."""
    if await _placement_facts(conn, node["id"]) != before:
        await conn.execute(queries.NOTIFY_POOL_FREED, {"pool_id": node["pool_id"]})
        # Its reservations too: a GPU gone raises a condition, one back clears it.
        await conn.execute(queries.WAKE_RESERVATIONS, {"node_id": node["id"]})


def _revoked(node: dict[str, Any] | None) -> bool:
    """A node revoked (by the operator, by node id) while its message waited for the node's row:
    nothing of the message is applied (its sessions are ending; the revocation let go of its GPUs,
    which it must not take back)."""
    if node is not None and node["revoked_at"] is None:
        return False
    log.info("message of a revoked node ignored")
    return True


async def apply_hello(pool: AsyncConnectionPool, node_id: str, hello: node_pb2.Hello,
                      session_id: str | None = None) -> float:
    """The node's daemon version, capabilities (and their system labels) and, when the hello
    carries one, its inventory. Returns the seconds it held the pool's lock (`_under_pool_lock`)."""

    async def change(conn: AsyncConnection, node: dict[str, Any]) -> None:
        caps = capabilities(hello)
        if hello.HasField("inventory"):
            node["labels"] = await _apply_inventory(conn, node, hello.inventory)
        await conn.execute(queries.SET_HELLO, {
            "daemon_version": hello.daemon_version[:128], "capabilities": caps,
            "labels": Jsonb(cap_labels(node["labels"], caps)), "node_id": node_id})

    return await _under_pool_lock(pool, node_id, change, session_id)


async def apply_inventory(pool: AsyncConnectionPool, node_id: str, inventory: node_pb2.Inventory,
                          session_id: str | None = None) -> float:
    """A new inventory snapshot: atoms, host resources, `fabric.domain`. Returns the seconds it
    held the pool's lock (`_under_pool_lock`)."""

    async def change(conn: AsyncConnection, node: dict[str, Any]) -> None:
        labels = await _apply_inventory(conn, node, inventory)
        await conn.execute(queries.SET_LABELS, {"labels": Jsonb(labels), "node_id": node_id})

    return await _under_pool_lock(pool, node_id, change, session_id)


async def _under_pool_lock(pool: AsyncConnectionPool, node_id: str,
                           change: Callable[[AsyncConnection, dict[str, Any]], Awaitable[None]],
                           session_id: str | None = None) -> float:
    """`change` applied to the node's row locked under its pool's lock (nothing for a revoked
    node), the pool woken when what placement reads of the node changed. Returns the seconds the
    lock was held (its work, not its wait: the gateway charges the node for it, gateway.throttle).

    With `session_id` (the gateway's), only while that is still the node's newest session: a newer
    one registers under the same row lock, so what a replaced session sends is never applied
    after the newer session spoke, even before the replaced one hears it was (CONFLICT)."""

    async def work(conn: AsyncConnection) -> float:
        node = await lock_for_placement_change(conn, node_id)
        locked = time.perf_counter()
        if _revoked(node):
            return 0.0
        if session_id is not None and node["session_id"] != session_id:
            log.info("message of a replaced session ignored", node_id=node_id, session_id=session_id)
            raise errors.Conflict("a newer session of this node took over", sessionId=session_id)
        before = await _placement_facts(conn, node_id)
        await change(conn, node)
        await _wake_pool_if_changed(conn, node, before)
        return time.perf_counter() - locked

    return await db.run_in_transaction(pool, work)
