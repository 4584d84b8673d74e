"""What a request's devices mean in its pool: whether the pool's sharing mode serves their class,
what quota they charge (in GPU equivalents, and per model), and what IAM sees of them.

The pool's mode decides its one bookable class (controlplane.common.devices); a request of another
class could never fit, since the mode is fixed when the pool is created, so it is INVALID_INPUT at
create, before the draft, like a kubernetes binding the pool cannot serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from controlplane import errors
from controlplane.common import devices
from controlplane.quota import MODEL_PREFIX

_WHAT = {devices.GPU: "whole GPUs", devices.MIG: "MIG instances", devices.SLOT: "GPU slots"}


def check_pool(request: dict[str, Any], pool: dict[str, Any]) -> None:
    """INVALID_INPUT naming `devices[0].class` when the pool's sharing mode does not book it."""
    wanted = request["devices"][0]["class"]
    booked = devices.pool_class(pool.get("policy"))
    if wanted != booked:
        mode = devices.mode(pool.get("policy"))
        raise errors.InvalidInput(
            "devices[0].class",
            f"pool {pool['id']} (sharing mode {mode}) books {_WHAT[booked]} only: ask for class {booked!r}",
            poolId=pool["id"], sharingMode=mode, served=booked)


@dataclass(frozen=True)
class Charges:
    """The quota a request charges: resource -> exact amount, and the per-model resources it could
    not name (a request without a model in a pool of several models)."""

    amounts: dict[str, Fraction]
    unnamed_models: tuple[str, ...] = field(default=())


def model_of(device: dict[str, Any], pool: dict[str, Any]) -> str:
    """The model a device request books: its own, else the pool's single model ('' when the pool
    has several or none)."""
    return device.get("model") or pool.get("single_model") or ""


def pinned(request: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    """The request as its draft stores it: without a model of its own in a pool of one model, that
    model. IAM decides on it (deviceModel) and quota charges it (gpu:<model>), so the reservation
    must book nothing else: a pending retry or a repair after the pool gained another model would
    otherwise place it on GPUs its tenant's policy or model quota does not allow."""
    device = request["devices"][0]
    model = model_of(device, pool)
    if not model or device.get("model"):
        return request
    return {**request, "devices": [{**device, "model": model}, *request["devices"][1:]]}


def charges(request: dict[str, Any], pool: dict[str, Any], gang_size: int = 1) -> Charges:
    """`gpu` in GPU equivalents (a MIG instance 1/7, a slot 1/replicas) times the gang size, and
    the same amount on `gpu:<model>` for the model it books. `pool` carries `policy`,
    `single_model` and, when the pool has several models, `models`."""
    device = request["devices"][0]
    worth = devices.gpu_equivalent(device["class"], device["count"], pool.get("policy")) * gang_size
    model = model_of(device, pool)
    if model:
        return Charges({"gpu": worth, MODEL_PREFIX + model: worth})
    return Charges({"gpu": worth}, tuple(MODEL_PREFIX + m for m in pool.get("models") or ()))


def attributes(request: dict[str, Any], pool: dict[str, Any], gang_size: int = 1) -> dict[str, Any]:
    """IAM's device attributes: gpuCount counts whole GPUs only, gpuEquivalent every device's worth."""
    device = request["devices"][0]
    worth = devices.gpu_equivalent(device["class"], device["count"], pool.get("policy")) * gang_size
    return {
        "deviceClass": device["class"],
        "deviceModel": model_of(device, pool),
        "deviceProfile": device.get("profile") or "",
        "gpuCount": devices.whole_gpus(device["class"], device["count"]) * gang_size,
        "gpuEquivalent": float(worth),
    }
