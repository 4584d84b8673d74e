"""A node's MIG instances and slots, from its GPUs and its pool's sharing mode (DESIGN.md section
17: children atoms of a GPU). Called wherever GPU atoms are written (inventory, registration),
under the pool lock that write already holds.

- exclusive: whole GPUs are bookable, except GPUs in MIG mode (given whole, a workload would see
  no device); no children are.
- mig: each MIG instance of a GPU in MIG mode is a `gpu.mig` atom, device "<uuid>:<instance>", with
  its profile; whole GPUs are not bookable (a GPU not in MIG mode gives nothing).
- time-slice, mps: each GPU not in MIG mode gives `replicas` `gpu.slot` atoms, "<uuid>:<n>";
  whole GPUs are not bookable.

Children take their parent's model, NUMA node, NVLink domain and health. Children that are gone
(an instance repartitioned away, fewer replicas) stop being bookable; unless booked or quarantined
they are then deleted (controlplane.nodes.inventory).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane.common import devices
from controlplane.common.names import MIG_PROFILE
from controlplane.ids import new_id
from controlplane.nodes import queries

log = structlog.get_logger("nodes.shared_atoms")

MAX_MIG_INSTANCES = devices.MIG_PARTS  # a GPU holds at most seven MIG instances


@dataclass(frozen=True)
class GpuParts:
    uuid: str
    # (instance index, profile) of a GPU in MIG mode; None when it is not in MIG mode.
    mig_instances: tuple[tuple[int, str], ...] | None = None


def from_inventory(gpus: Iterable[Any]) -> list[GpuParts]:
    """GpuParts of inventory GPUs (node.v1 Gpu): instances with a bad index or profile, repeats and
    any beyond seven are dropped."""
    out = []
    for gpu in gpus:
        if not gpu.mig_mode:
            out.append(GpuParts(gpu.uuid))
            continue
        kept: dict[int, str] = {}
        for m in gpu.mig_instances:
            if 0 <= m.index < 1000 and MIG_PROFILE.fullmatch(m.profile) and m.index not in kept:
                kept[m.index] = m.profile
        if len(kept) != len(gpu.mig_instances) or len(kept) > MAX_MIG_INSTANCES:
            log.info("mig instances dropped", gpu=gpu.uuid, reported=len(gpu.mig_instances),
                     kept=min(len(kept), MAX_MIG_INSTANCES))
        out.append(GpuParts(gpu.uuid, tuple(sorted(kept.items()))[:MAX_MIG_INSTANCES]))
    return out


def children(gpus: Sequence[GpuParts], policy: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """(parent uuid, device id, profile) of every child atom the pool books on these GPUs."""
    kind = devices.pool_class(policy)
    if kind == devices.MIG:
        return [(g.uuid, f"{g.uuid}:{index}", profile)
                for g in gpus if g.mig_instances for index, profile in g.mig_instances]
    if kind == devices.SLOT:
        replicas = devices.replicas(policy)
        return [(g.uuid, f"{g.uuid}:{n}", "") for g in gpus if g.mig_instances is None for n in range(replicas)]
    return []


async def apply(conn: AsyncConnection, node_id: str, pool_id: str, gpus: Sequence[GpuParts]) -> None:
    """Bring the node's children in step with `gpus` (the GPUs present) and its pool's mode."""
    row = await (await conn.execute(queries.POOL_POLICY, {"pool_id": pool_id})).fetchone()
    policy = row["policy"] if row else None
    kind = devices.pool_class(policy)
    wanted = children(gpus, policy)
    not_whole = [g.uuid for g in gpus if kind != devices.GPU or g.mig_instances is not None]
    if not_whole:
        await conn.execute(queries.GPUS_NOT_WHOLE, {"node_id": node_id, "uuids": not_whole})
    if wanted:
        await conn.execute(queries.UPSERT_CHILDREN, {
            "node_id": node_id, "kind": kind, "parts": devices.parts_per_gpu(kind, policy),
            "ids": [new_id("atom") for _ in wanted], "parents": [w[0] for w in wanted],
            "devices": [w[1] for w in wanted], "profiles": [w[2] for w in wanted]})
    gone = (await conn.execute(queries.CHILDREN_GONE, {
        "node_id": node_id, "kind": kind, "devices": [w[1] for w in wanted]})).rowcount
    if gone:  # reservations booked on a vanished instance or slot hear of it, as on a vanished GPU
        await conn.execute(queries.WAKE_RESERVATIONS, {"node_id": node_id})
