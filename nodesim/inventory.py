"""A node's hardware as its daemon would read it: deterministic from the node's name and position,
so a restarted node reports the same GPU UUIDs and the control plane sees the same atoms."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from bettercompute.node.v1 import node_pb2 as pb
from nodesim.config import InventorySpec

GIB = 1 << 30
MIB = 1 << 20
# Fixed namespace: the same node name gives the same UUIDs in every run and on every machine.
_NAMESPACE = uuid.UUID("6f1b2c1e-3f5e-4b7a-9d0c-b0c0e7a1d5e2")


def gpu_uuid(node_name: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_NAMESPACE, f'{node_name}/gpu/{index}')}"


def _cpulist(ranges: list[tuple[int, int]]) -> str:
    return ",".join(f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in ranges)


def numa_cpulists(vcpus: int, numa_nodes: int) -> list[str]:
    """Linux numbering with two threads per core: cores first, then their siblings.

    192 vCPUs on 2 NUMA nodes: "0-47,96-143" and "48-95,144-191".
    """
    cores = vcpus // 2
    per_node = cores // numa_nodes
    out = []
    for n in range(numa_nodes):
        lo = n * per_node
        hi = lo + per_node - 1
        out.append(_cpulist([(lo, hi), (lo + cores, hi + cores)]))
    return out


@dataclass(frozen=True)
class Hardware:
    """The inventory message plus the lookups the converger needs."""

    inventory: pb.Inventory
    # GPU UUID -> device minor (/dev/nvidiaN).
    gpu_index: dict[str, int]
    # GPU UUID -> MIG instance indexes (only GPUs in MIG mode).
    mig_instances: dict[str, frozenset[int]]


def build(spec: InventorySpec, node_name: str, position: int) -> Hardware:
    """The inventory of the node at `position` in the fleet (fabric clusters group neighbours)."""
    fabric_cluster = ""
    fabric_clique = ""
    if spec.fabric_size > 0:
        cluster_no = position // spec.fabric_size
        fabric_cluster = str(uuid.uuid5(_NAMESPACE, f"nvlink-cluster/{cluster_no}"))
        fabric_clique = "1"
    gpus = []
    gpu_index: dict[str, int] = {}
    mig: dict[str, frozenset[int]] = {}
    for i in range(spec.gpus):
        uid = gpu_uuid(node_name, i)
        mig_mode = i >= spec.gpus - spec.mig_gpus
        instances = (
            [pb.MigInstance(index=k, profile=spec.instance_profile()) for k in range(spec.mig_instances)] if mig_mode else []
        )
        gpus.append(
            pb.Gpu(
                uuid=uid,
                model=spec.gpu_model,
                memory_mib=spec.gpu_memory_mib,
                numa_node=i * spec.numa_nodes // spec.gpus,
                nvlink_cluster=fabric_cluster,
                nvlink_clique=fabric_clique,
                mig_mode=mig_mode,
                mig_instances=instances,
            )
        )
        gpu_index[uid] = i
        if mig_mode:
            mig[uid] = frozenset(range(spec.mig_instances))
    memory_bytes = spec.memory_gib * GIB
    numa = [
        pb.NumaNode(id=n, cpulist=cpus, memory_bytes=memory_bytes // spec.numa_nodes)
        for n, cpus in enumerate(numa_cpulists(spec.vcpus, spec.numa_nodes))
    ]
    inventory = pb.Inventory(
        generation=1,
        gpus=gpus,
        numa_nodes=numa,
        isolated_cpus=spec.isolated_cpus,
        memory_bytes=memory_bytes,
        hugepages_2mi=spec.hugepages_2mi,
        hugepages_1gi=spec.hugepages_1gi,
        vcpus=spec.vcpus,
    )
    return Hardware(inventory=inventory, gpu_index=gpu_index, mig_instances=mig)
