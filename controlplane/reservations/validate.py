"""Validation and normalisation of reservation requests. Every failure names its field.

The normalised request is what is stored and hashed: durations in milliseconds, binding
defaulted to hold, topology defaulted to any, every optional key present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane import errors
from controlplane.common.names import IDEMPOTENCY_KEY, LABEL, MODEL, POOL_ID, TENANT_ID, match, shown_key
from controlplane.config import Settings
from controlplane.durations import parse_duration_ms
from controlplane.placement.planner import ANY, TOPOLOGIES

DAY_MS = 86_400_000
MAX_DURATION_MS = 366 * DAY_MS  # the default of Settings.max_reservation_days
MAX_GPUS = 64
MIN_GANG, MAX_GANG = 2, 64  # nodes in a gang (spec "Gang reservations"); Settings.max_gang_size may lower it
SERVED_CLASSES = {"gpu"}
RESERVED_CLASSES = {"gpu.mig", "gpu.slot"}
SERVED_BINDINGS = {"hold", "kubernetes"}
UNSERVED_BINDINGS = {"instance", "node"}


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

    @classmethod
    def of(cls, settings: Settings) -> TimeLimits:
        return cls(settings.max_start_ahead_days * DAY_MS, settings.max_reservation_days * DAY_MS)


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
        if cls in RESERVED_CLASSES:
            raise errors.Unsupported(f"{field}.class {cls!r} is not served yet", field=f"{field}.class")
        if cls not in SERVED_CLASSES:
            raise errors.InvalidInput(f"{field}.class", "must be 'gpu'")
        count = device.get("count", 0)
        if not isinstance(count, int) or not 1 <= count <= MAX_GPUS:
            raise errors.InvalidInput(f"{field}.count", f"must be 1 to {MAX_GPUS}")
        topology = device.get("topology") or ANY
        if topology not in TOPOLOGIES:
            raise errors.InvalidInput(f"{field}.topology", f"must be one of {sorted(TOPOLOGIES)}")
        model = match(f"{field}.model", device.get("model") or "", MODEL)
        out.append({"class": cls, "count": count, "topology": topology, "model": model})
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
        raise errors.InvalidInput("binding", "must be 'hold' or 'kubernetes'")
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
    gang = _gang(raw.get("gang"), max_gang_size)
    if gang is not None:  # only when asked: the hash of a request without one stays what it was
        request["gang"] = gang
    return CreateInput(tenant_id, key, wait_ms, request)


def check_start(inp: CreateInput, now_ms: int, limits: TimeLimits) -> None:
    """Refuse a start beyond the horizon of compute_now()."""
    start = inp.request.get("start")
    if start is not None:
        epoch_ms("start", start, now_ms, limits)
