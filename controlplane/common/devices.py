"""Device classes and GPU sharing: which atoms a pool books, and what they are worth in GPUs.

A pool's `policy.sharing.mode` (fixed when the pool is created) decides its one bookable class:
`exclusive` books whole GPUs (`gpu`); `mig` books MIG instances (`gpu.mig`, 1/7 of a GPU each,
whatever their profile); `time-slice` and `mps` book slots (`gpu.slot`, 1/replicas of a GPU each,
`policy.sharing.replicas`, default 4, or 10 for mps). In a shared pool the GPUs themselves are not
bookable whole.

`gpu_equivalent` is the one place a request's worth in GPUs is computed (host share, quota, IAM).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

GPU = "gpu"
MIG = "gpu.mig"
SLOT = "gpu.slot"
CLASSES = (GPU, MIG, SLOT)

EXCLUSIVE = "exclusive"
MIG_MODE = "mig"
TIME_SLICE = "time-slice"
MPS = "mps"
MODES = (EXCLUSIVE, MIG_MODE, TIME_SLICE, MPS)
ALIASES = {"time-slicing": TIME_SLICE}  # the spelling of NVIDIA's device plugin

MIG_PARTS = 7  # a MIG instance is 1/7 of a GPU, whatever its profile
DEFAULT_REPLICAS = {TIME_SLICE: 4, MPS: 10}
_CLASS_OF_MODE = {EXCLUSIVE: GPU, MIG_MODE: MIG, TIME_SLICE: SLOT, MPS: SLOT}


def _sharing(policy: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return (policy or {}).get("sharing") or {}


def mode(policy: Mapping[str, Any] | None) -> str:
    """The pool's sharing mode (a pool policy without one is exclusive)."""
    raw = _sharing(policy).get("mode") or EXCLUSIVE
    return ALIASES.get(raw, raw)


def replicas(policy: Mapping[str, Any] | None) -> int:
    """Slots per GPU of a time-slice or mps pool (0 for the other modes)."""
    which = mode(policy)
    if which not in DEFAULT_REPLICAS:
        return 0
    return int(_sharing(policy).get("replicas") or 0) or DEFAULT_REPLICAS[which]


def pool_class(policy: Mapping[str, Any] | None) -> str:
    """The one device class the pool books: `gpu`, `gpu.mig` or `gpu.slot`."""
    return _CLASS_OF_MODE.get(mode(policy), GPU)


def parts_per_gpu(device_class: str, policy: Mapping[str, Any] | None) -> int:
    """How many atoms of `device_class` make one GPU in this pool."""
    if device_class == MIG:
        return MIG_PARTS
    if device_class == SLOT:
        return replicas(policy) or DEFAULT_REPLICAS[TIME_SLICE]
    return 1


def gpu_equivalent(device_class: str, count: int, policy: Mapping[str, Any] | None) -> Fraction:
    """What `count` devices of `device_class` are worth in GPUs in a pool with `policy` (the
    pool's policy document): a whole GPU 1, a MIG instance 1/7, a slot 1/replicas. Exact, so sums
    of many small parts never drift; round where a figure must be whole."""
    return Fraction(count, parts_per_gpu(device_class, policy))


def whole_gpus(device_class: str, count: int) -> int:
    """Whole GPUs among `count` devices of `device_class` (IAM's gpuCount)."""
    return count if device_class == GPU else 0
