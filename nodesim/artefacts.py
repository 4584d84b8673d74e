"""The hold on disk (DESIGN.md §11), under the node's root:

- `etc/cdi/bcd-<alloc>.json`: the CDI spec; it *is* the hold, written last and removed first;
- `run/bcd/allocations/<alloc>.env`: KEY=value lines for a workload;
- `sys/fs/cgroup/bcd.slice/bcd-alloc-<alloc>.slice/`: cpu.max, memory.max, cpuset.cpus,
  cpuset.mems, hugetlb.1GB.max in the cgroup v2 file formats, when the hold is limited.

Everything a restarted daemon needs to know about a hold is in its CDI spec's annotations.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from bettercompute.node.v1 import node_pb2 as pb
from nodesim.files import is_temporary, remove, write_atomic

GIB = 1 << 30
CDI_VERSION = "0.6.0"
VENDOR = "bcd.dev"
DEVICE_CLASSES = ("gpu", "gpu.mig", "gpu.slot")
CPU_PERIOD_US = 100_000

ANN_ALLOCATION = f"{VENDOR}/allocation-id"
ANN_UNTIL = f"{VENDOR}/until"
ANN_BINDING = f"{VENDOR}/binding"
ANN_CGROUP_PARENT = f"{VENDOR}/cgroup-parent"
ANN_LIMITS = f"{VENDOR}/limits"

# An allocation id becomes part of file names: nothing that could leave its directory.
ALLOCATION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# CDI device names (container-device-interface pkg/parser): the ids the node is given become them.
DEVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
# A cpuset's cpus and mems (Linux cpulist format), or "" when not pinned: written into the slice.
CPULIST = re.compile(r"^(\d+(-\d+)?(,\d+(-\d+)?)*)?$")

_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

log = structlog.get_logger("nodesim.artefacts")


@dataclass(frozen=True)
class Limits:
    cpu_millis: int = 0
    memory_bytes: int = 0
    hugepages_1gi: int = 0
    cpus: str = ""
    mems: str = ""

    @classmethod
    def from_proto(cls, limits: pb.Limits) -> Limits | None:
        out = cls(limits.cpu_millis, limits.memory_bytes, limits.hugepages_1gi, limits.cpus, limits.mems)
        return out if out != cls() else None

    def cgroup_files(self) -> dict[str, str]:
        """The cgroup v2 interface files; an unset limit is written as the kernel's unlimited value."""
        quota = str(self.cpu_millis * CPU_PERIOD_US // 1000) if self.cpu_millis > 0 else "max"
        return {
            "cpu.max": f"{quota} {CPU_PERIOD_US}\n",
            "memory.max": f"{self.memory_bytes if self.memory_bytes > 0 else 'max'}\n",
            "cpuset.cpus": f"{self.cpus}\n",
            "cpuset.mems": f"{self.mems}\n",
            "hugetlb.1GB.max": f"{self.hugepages_1gi * GIB if self.hugepages_1gi > 0 else 'max'}\n",
        }


@dataclass(frozen=True)
class Hold:
    """What the node holds for one allocation (or was asked to: a desired assignment, normalised)."""

    allocation_id: str
    device_class: str
    device_ids: tuple[str, ...]
    until: int
    kubernetes: bool
    # Limits the node enforces; None when unlimited (or when this daemon ignores limits).
    limits: Limits | None

    @property
    def slice_name(self) -> str:
        return f"bcd-alloc-{self.allocation_id}.slice"

    @property
    def cgroup_parent(self) -> str:
        """The slice, when the hold has one: a limited hold; a kubernetes binding's pods live in the
        kubelet's cgroups, so it gets none."""
        return self.slice_name if self.limits is not None and not self.kubernetes else ""

    @property
    def kind(self) -> str:
        return f"{VENDOR}/{self.device_class}"

    @property
    def cdi_devices(self) -> list[str]:
        return [f"{self.kind}={d}" for d in self.device_ids]

    @property
    def env_file(self) -> str:
        """The env file's path as the node sees it (the sandbox is the simulator's root)."""
        return f"/run/bcd/allocations/{self.allocation_id}.env"

    def gpu_uuids(self) -> list[str]:
        """Parent GPUs of the devices, in order, without repeats ("<uuid>:<n>" names a part of one)."""
        return list(dict.fromkeys(d.split(":", 1)[0] for d in self.device_ids))


def check_names(allocation_id: str, device_class: str, device_ids: list[str]) -> str | None:
    """Why an assignment cannot be written as CDI, or None."""
    if not ALLOCATION_ID.fullmatch(allocation_id):
        return f"allocation id {allocation_id!r} is not a safe file name"
    if device_class not in DEVICE_CLASSES:
        return f"unknown device class {device_class!r}"
    if not device_ids:
        return "no devices"
    bad = [d for d in device_ids if not DEVICE_NAME.fullmatch(d)]
    if bad:
        return f"device ids not valid CDI device names: {bad}"
    if len(set(device_ids)) != len(device_ids):
        return "repeated device ids"
    return None


def check_limits(limits: Limits | None) -> str | None:
    """Why limits cannot be written into a slice, or None."""
    if limits is None:
        return None
    # A negative amount would be written as unlimited, and subtracted from what the host gives.
    negative = [n for n in ("cpu_millis", "memory_bytes", "hugepages_1gi") if getattr(limits, n) < 0]
    if negative:
        return f"negative limits: {', '.join(negative)}"
    bad = [name for name in ("cpus", "mems") if not CPULIST.fullmatch(getattr(limits, name))]
    if bad:
        return f"not a cpulist: {', '.join(bad)}"
    return None


def check_cpuset(limits: Limits | None, vcpus: int, numa_nodes: int) -> str | None:
    """Why a cpuset (a cpulist already) names CPUs or NUMA nodes this node does not have, or None:
    the node's CPUs are 0 to `vcpus` - 1, its NUMA nodes 0 to `numa_nodes` - 1."""
    if limits is None:
        return None
    for name, cpulist, count, what in (("cpuset.cpus", limits.cpus, vcpus, "CPUs"),
                                       ("cpuset.mems", limits.mems, numa_nodes, "NUMA nodes")):
        bad = _outside(cpulist, count)
        if bad is not None:
            return f"{name} {bad!r} is not within this node's {what} (0-{count - 1})"
    return None


def _outside(cpulist: str, count: int) -> str | None:
    """The first part of the cpulist naming an id of `count` or more, or a range running backwards."""
    for part in filter(None, cpulist.split(",")):
        lo, _, hi = part.partition("-")
        hi = hi or lo
        # No node has 10**18 CPUs (and int() refuses over 4300 digits).
        if max(len(lo), len(hi)) > 18 or int(hi) >= count or int(lo) > int(hi):
            return part
    return None


class Sandbox:
    """One node's root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cdi_dir = root / "etc" / "cdi"
        self.env_dir = root / "run" / "bcd" / "allocations"
        self.cgroup_dir = root / "sys" / "fs" / "cgroup" / "bcd.slice"

    def cdi_path(self, allocation_id: str) -> Path:
        return self.cdi_dir / f"bcd-{allocation_id}.json"

    def env_path(self, allocation_id: str) -> Path:
        return self.env_dir / f"{allocation_id}.env"

    def slice_path(self, allocation_id: str) -> Path:
        return self.cgroup_dir / f"bcd-alloc-{allocation_id}.slice"

    # -- writing -----------------------------------------------------------------------------

    def write(self, hold: Hold, gpu_index: dict[str, int]) -> None:
        """Slice, then env file, then the CDI spec: once the spec exists, everything it names does."""
        slice_dir = self.slice_path(hold.allocation_id)
        if hold.cgroup_parent:
            assert hold.limits is not None
            for name, content in hold.limits.cgroup_files().items():
                write_atomic(slice_dir / name, content)
        else:
            _remove_tree(slice_dir)
        write_atomic(self.env_path(hold.allocation_id), "".join(f"{k}={v}\n" for k, v in env(hold).items()))
        spec = cdi_spec(hold, gpu_index)
        write_atomic(self.cdi_path(hold.allocation_id), json.dumps(spec, indent=2, sort_keys=False) + "\n")

    def remove(self, allocation_id: str) -> None:
        """The CDI spec first (the hold ends there), then the env file, then the emptied slice."""
        remove(self.cdi_path(allocation_id))
        remove(self.env_path(allocation_id))
        _remove_tree(self.slice_path(allocation_id))

    # -- recovery ----------------------------------------------------------------------------

    def recover(self) -> list[Hold]:
        """The holds a previous run left, read from their CDI specs. Leftovers of an interrupted
        write or release (temporary files, env files and slices without a spec) are removed."""
        holds: list[Hold] = []
        if self.cdi_dir.is_dir():
            for path in sorted(self.cdi_dir.iterdir()):
                if is_temporary(path):
                    remove(path)
                    continue
                if not (path.name.startswith("bcd-") and path.name.endswith(".json")):
                    continue
                try:
                    hold = hold_from_spec(json.loads(path.read_text()))
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("unreadable CDI spec left in place", path=str(path), error=str(exc))
                    continue
                if path != self.cdi_path(hold.allocation_id):
                    log.warning("CDI spec names another allocation; left in place", path=str(path))
                    continue
                holds.append(hold)
        held = {h.allocation_id for h in holds}
        if self.env_dir.is_dir():
            for path in self.env_dir.iterdir():
                if is_temporary(path) or (path.suffix == ".env" and path.stem not in held):
                    remove(path)
        if self.cgroup_dir.is_dir():
            for path in self.cgroup_dir.iterdir():
                name = path.name
                if name.startswith("bcd-alloc-") and name.endswith(".slice"):
                    alloc = name[len("bcd-alloc-") : -len(".slice")]
                    if alloc not in held:
                        _remove_tree(path)
                    else:
                        for f in path.iterdir():
                            if is_temporary(f):
                                remove(f)
        return holds


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def env(hold: Hold) -> dict[str, str]:
    visible = ",".join(hold.device_ids if hold.device_class == "gpu.mig" else hold.gpu_uuids())
    out = {
        "NVIDIA_VISIBLE_DEVICES": visible,
        "CUDA_VISIBLE_DEVICES": visible,
        "BCD_ALLOCATION_ID": hold.allocation_id,
        "BCD_UNTIL": str(hold.until),
        "BCD_DEVICE_CLASS": hold.device_class,
        "BCD_CDI_DEVICES": ",".join(hold.cdi_devices),
        "BCD_BINDING": "kubernetes" if hold.kubernetes else "hold",
    }
    if hold.cgroup_parent:
        out["BCD_CGROUP_PARENT"] = hold.cgroup_parent
    return out


def cdi_spec(hold: Hold, gpu_index: dict[str, int]) -> dict:
    annotations = {
        ANN_ALLOCATION: hold.allocation_id,
        ANN_UNTIL: str(hold.until),
        # The kubernetes marker: bcd's device plugin advertises exactly the devices of such specs.
        ANN_BINDING: "kubernetes" if hold.kubernetes else "hold",
    }
    if hold.cgroup_parent:
        annotations[ANN_CGROUP_PARENT] = hold.cgroup_parent
    if hold.limits is not None:
        annotations[ANN_LIMITS] = json.dumps(asdict(hold.limits), separators=(",", ":"), sort_keys=True)
    devices = [
        {
            "name": device_id,
            "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{gpu_index[device_id.split(':', 1)[0]]}"}]},
        }
        for device_id in hold.device_ids
    ]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": hold.kind,
        "annotations": annotations,
        "devices": devices,
        "containerEdits": {
            "env": [f"{k}={v}" for k, v in env(hold).items()],
            "deviceNodes": [{"path": p} for p in _CONTROL_NODES],
        },
    }


def hold_from_spec(spec: dict) -> Hold:
    annotations = spec["annotations"]
    vendor, _, device_class = spec["kind"].partition("/")
    if vendor != VENDOR or device_class not in DEVICE_CLASSES:
        raise ValueError(f"not a bcd spec kind: {spec['kind']!r}")
    limits_json = annotations.get(ANN_LIMITS)
    return Hold(
        allocation_id=annotations[ANN_ALLOCATION],
        device_class=device_class,
        device_ids=tuple(d["name"] for d in spec["devices"]),
        until=int(annotations[ANN_UNTIL]),
        kubernetes=annotations.get(ANN_BINDING) == "kubernetes",
        limits=Limits(**json.loads(limits_json)) if limits_json else None,
    )
