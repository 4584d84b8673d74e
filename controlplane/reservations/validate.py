"""Validation and normalisation of reservation requests. Every failure names its field.

The normalised request is what is stored and hashed: durations in milliseconds, binding
defaulted to hold, topology defaulted to any, every optional key present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane import errors
from controlplane.common import devices as device_classes
from controlplane.common.names import IDEMPOTENCY_KEY, LABEL, MIG_PROFILE, MODEL, POOL_ID, TENANT_ID, match, shown_key
from controlplane.config import Settings
from controlplane.durations import parse_duration_ms
from controlplane.metal import request as metal_request
from controlplane.placement.planner import ANY, TOPOLOGIES

DAY_MS = 86_400_000
MAX_DURATION_MS = 366 * DAY_MS  # the default of Settings.max_reservation_days
MAX_GPUS = 64
MIN_GANG, MAX_GANG = 2, 64  # nodes in a gang (spec "Gang reservations"); Settings.max_gang_size may lower it
SERVED_CLASSES = set(device_classes.CLASSES)
SERVED_BINDINGS = {"hold", "kubernetes", "node"}
UNSERVED_BINDINGS = {"instance"}


@dataclass(frozen=True)
class CreateInput:
    tenant_id: str
    idempotency_key: str
    wait_ms: int | None
    request: dict[str, Any]  # normalised; hashed and stored


@dataclass(frozen=True)
class TimeLimits:
    """The horizon of every time the API takes (README "Limits")."""

    max_start_ahead_ms: int = 365 * DAY_MS
    max_length_ms: int = MAX_DURATION_MS
    # What `resources` may ask per node (README "Limits"; not times, but bounds of the same request).
    max_host_vcpu: int = 4096
    max_host_memory_gib: int = 65536
    # An earliest-fit search: its default horizon and the longest one asked for.
    earliest_horizon_ms: int = 14 * DAY_MS
    max_earliest_horizon_ms: int = 60 * DAY_MS

    @classmethod
    def of(cls, settings: Settings) -> TimeLimits:
        return cls(settings.max_start_ahead_days * DAY_MS, settings.max_reservation_days * DAY_MS,
                   settings.max_host_vcpu, settings.max_host_memory_gib,
                   settings.earliest_horizon_days * DAY_MS, settings.max_earliest_horizon_days * DAY_MS)


def epoch_ms(field: str, value: int, now_ms: int, limits: TimeLimits) -> int:
    """An epoch-millisecond time the API takes: at least 0, at most max_start_ahead after now."""
    if value < 0:
        raise errors.InvalidInput(field, "must be epoch milliseconds, at least 0")
    if value > now_ms + limits.max_start_ahead_ms:
        days = limits.max_start_ahead_ms // DAY_MS
        raise errors.InvalidInput(field, f"must be at most {days} days ahead", maxMs=now_ms + limits.max_start_ahead_ms)
    return value


def _devices(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(raw) != 1:
        raise errors.InvalidInput("devices", "exactly one device request is served per reservation")
    out = []
    for i, device in enumerate(raw):
        field = f"devices[{i}]"
        cls = device.get("class") or ""
        if cls not in SERVED_CLASSES:
            raise errors.InvalidInput(f"{field}.class", f"must be one of {sorted(SERVED_CLASSES)}")
        count = device.get("count", 0)
        if not isinstance(count, int) or not 1 <= count <= MAX_GPUS:
            raise errors.InvalidInput(f"{field}.count", f"must be 1 to {MAX_GPUS}")
        topology = device.get("topology") or ANY
        if topology not in TOPOLOGIES:
            raise errors.InvalidInput(f"{field}.topology", f"must be one of {sorted(TOPOLOGIES)}")
        model = match(f"{field}.model", device.get("model") or "", MODEL)
        normalised = {"class": cls, "count": count, "topology": topology, "model": model}
        profile = device.get("profile") or ""
        if cls == device_classes.MIG:  # only MIG requests carry the key: the others' hashes stay as they were
            normalised["profile"] = match(f"{field}.profile", profile, MIG_PROFILE) if profile else ""
        elif profile:
            raise errors.InvalidInput(f"{field}.profile", "is for class 'gpu.mig' only")
        out.append(normalised)
    return out


def _gang(raw: dict[str, Any] | None, max_size: int) -> dict[str, Any] | None:
    """`{size, topologyKey}` ("" without a key), or None when the request is not a gang."""
    if raw is None:
        return None
    size = raw.get("size", 0)
    if not isinstance(size, int) or not MIN_GANG <= size <= max_size:
        raise errors.InvalidInput("gang.size", f"must be {MIN_GANG} to {max_size}")
    key = raw.get("topology_key") or ""
    if key:
        match("gang.topologyKey", key, LABEL)
    return {"size": size, "topologyKey": key}


def duration_ms(field: str, text: str | None, ms: int | None, max_ms: int = MAX_DURATION_MS) -> int:
    if text is not None:
        try:
            value = parse_duration_ms(text)
        except ValueError as exc:
            raise errors.InvalidInput(field, str(exc)) from None
    elif ms is not None:
        value = ms
    else:
        raise errors.InvalidInput(field, "is required")
    if not 1 <= value <= max_ms:
        raise errors.InvalidInput(field, f"must be between 1 ms and {max_ms} ms ({max_ms / DAY_MS:g} days)")
    return value


def validate_create(raw: dict[str, Any], limits: TimeLimits | None = None, *, max_gang_size: int = MAX_GANG) -> CreateInput:
    """The normalised request. The start's horizon needs the database's clock: `check_start`."""
    limits = limits or TimeLimits()
    tenant_id = match("tenantId", raw.get("tenant_id", ""), TENANT_ID)
    pool_id = match("poolId", raw.get("pool_id", ""), POOL_ID)
    key = match("idempotencyKey", raw.get("idempotency_key", ""), IDEMPOTENCY_KEY)
    binding = raw.get("binding") or "hold"
    if binding in UNSERVED_BINDINGS:
        hint = " (VPS instances are created with instances.create)" if binding == "instance" else ""
        raise errors.Unsupported(f"binding {binding!r} is not served{hint}", field="binding")
    if binding not in SERVED_BINDINGS:
        raise errors.InvalidInput("binding", "must be 'hold', 'kubernetes' or 'node'")
    devices = _devices(raw.get("devices") or [])
    duration = duration_ms("duration", raw.get("duration"), raw.get("duration_ms"), limits.max_length_ms)
    start = raw.get("start")
    if start is not None and start < 0:
        raise errors.InvalidInput("start", "must be epoch milliseconds, at least 0")
    lease = raw.get("lease_seconds")
    if lease is not None and not 60 <= lease <= 30 * 86_400:
        raise errors.InvalidInput("leaseSeconds", "must be 60 to 2592000")
    selector = dict(raw.get("node_selector") or {})
    for k, v in selector.items():
        match(f"nodeSelector[{shown_key(k)}]", k, LABEL)
        match(f"nodeSelector[{shown_key(k)}]", v, LABEL)
    resources = resources_input(raw.get("resources"), limits)
    wait_ms = raw.get("wait_timeout_ms")
    if wait_ms is not None:
        if wait_ms < 0:
            raise errors.InvalidInput("wait.timeoutMs", "must be at least 0")
        # The server caps it (Settings.create_wait_cap_seconds) when it waits.
    request = {
        "poolId": pool_id,
        "devices": devices,
        "durationMs": duration,
        "binding": binding,
        "start": start,
        "leaseSeconds": lease,
        "nodeSelector": selector,
    }
    if resources is not None:  # absent from requests without it, so their hash is unchanged
        request["resources"] = resources
    metal_request.normalise(raw, request)  # binding "node": its `node`, and what it refuses
    gang = _gang(raw.get("gang"), max_gang_size)
    if gang is not None:  # only when asked: the hash of a request without one stays what it was
        request["gang"] = gang
    if raw.get("spot"):  # only when asked: the hash of a regular request stays what it was
        request["spot"] = True
    _earliest(raw, request, limits)
    return CreateInput(tenant_id, key, wait_ms, request)


def _earliest(raw: dict[str, Any], request: dict[str, Any], limits: TimeLimits) -> None:
    """start "earliest": `startEarliest` and its `horizonMs`, only when asked (other hashes stay)."""
    horizon = raw.get("horizon_ms")
    if not raw.get("start_earliest"):
        if horizon is not None:
            raise errors.InvalidInput("horizonMs", "is for start 'earliest' only")
        return
    if request["start"] is not None:
        raise errors.InvalidInput("start", "give a start or ask for the earliest one, not both")
    if request["binding"] == "node":
        raise errors.InvalidInput("startEarliest", "is not served for binding 'node'")
    most = limits.max_earliest_horizon_ms
    if horizon is not None and not 1 <= horizon <= most:
        raise errors.InvalidInput("horizonMs", f"must be 1 to {most} ms ({most / DAY_MS:g} days)", maxMs=most)
    request["startEarliest"] = True
    request["horizonMs"] = horizon if horizon is not None else min(limits.earliest_horizon_ms, most)


HOST_RESOURCES = ("vcpu", "memoryGiB", "hugepages1Gi")


def resources_input(raw: dict[str, Any] | None, limits: TimeLimits) -> dict[str, int | None] | None:
    """`resources` normalised: every key present, None where unset (the pool's share decides)."""
    if raw is None:
        return None
    caps = {"vcpu": limits.max_host_vcpu, "memoryGiB": limits.max_host_memory_gib,
            "hugepages1Gi": limits.max_host_memory_gib}
    out: dict[str, int | None] = {}
    for name in HOST_RESOURCES:
        value = raw.get(name)
        if value is not None and (not isinstance(value, int) or not 0 <= value <= caps[name]):
            raise errors.InvalidInput(f"resources.{name}", f"must be 0 to {caps[name]}")
        out[name] = value
    return out


def check_start(inp: CreateInput, now_ms: int, limits: TimeLimits) -> None:
    """Refuse a start beyond the horizon of compute_now()."""
    start = inp.request.get("start")
    if start is not None:
        epoch_ms("start", start, now_ms, limits)
