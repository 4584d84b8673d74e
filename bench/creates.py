"""The workload: Reservations.Create calls of calendar reservations spread over the next ~60 days.

Each call has its own idempotency key, so each is a new reservation (draft, IAM, quota, placement).
The mix is 1/2/4/8 GPUs, some multi-GPU requests with `nvlink-all`; each starts at a random minute
in the horizon and lasts 1-8 h, so the pool fills by a few percent at most and the figure measures
admission and placement, not a full pool answering "pending".
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2

from bench.load import Call
from bench.seed import bearer
from bettercompute.v1 import reservations_pb2 as r
from bettercompute.v1 import reservations_pb2_grpc

HOUR_MS = 3_600_000
MINUTE_MS = 60_000
# GPUs per request and how often: most jobs are small, a sizeable share wants a whole node.
MIX = ((1, 40), (2, 25), (4, 20), (8, 15))
NVLINK_ALL_SHARE = 0.3  # of the multi-GPU requests
LONGEST_HOURS = 8  # durations are 1 to 8 whole hours


@dataclass(frozen=True)
class Workload:
    tenant_id: str
    pool_id: str
    run_id: str
    horizon_days: float = 60.0
    seed: int = 1


def make_request(work: Workload, number: int, now_ms: int) -> r.CreateReservationRequest:
    rng = random.Random(f"{work.seed}/{number}")  # the same call number is the same request
    gpus = rng.choices([g for g, _ in MIX], weights=[w for _, w in MIX])[0]
    topology = "nvlink-all" if gpus > 1 and rng.random() < NVLINK_ALL_SHARE else ""
    # Starts at least an hour out, so no reconciler deadline (start - 15 min) falls in the run.
    offset_min = rng.randrange(60, int(work.horizon_days * 24 * 60))
    start = (now_ms // MINUTE_MS + offset_min) * MINUTE_MS
    return r.CreateReservationRequest(
        tenant_id=work.tenant_id,
        pool_id=work.pool_id,
        devices=[r.DeviceRequest(device_class="gpu", count=gpus, topology=topology)],
        duration=f"{rng.randint(1, LONGEST_HOURS)}h",
        start=start,
        idempotency_key=f"{work.run_id}-{number:08d}",
    )


def error_label(exc: grpc.aio.AioRpcError) -> str:
    """`CODE/REASON`: the gRPC code and the spec code from google.rpc.ErrorInfo when present."""
    reason = ""
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    reason = info.reason
    code = exc.code().name if exc.code() else "UNKNOWN"
    return f"error {code}/{reason}" if reason else f"error {code}"


def create_call(channels: grpc.aio.Channel | list[grpc.aio.Channel], token: str, work: Workload, *,
                timeout: float = 30, wait_ms: int = 0, callers: list[tuple[str, str]] | None = None) -> Call:
    """Call number n goes to channel n mod len(channels) (one per control-plane replica), as the
    tenant n mod len(callers) with its token when `callers` ((tenant, token) pairs) are given, else
    as `work.tenant_id` with `token`. With
    `wait_ms` the call asks the server to hold the answer until the reservation is placed (or
    pending) for up to that long: a `queued` answer (the lease placer) then counts when placed,
    and one still `queued` at the end of the wait is labelled so."""
    channels = channels if isinstance(channels, list) else [channels]
    stubs = [reservations_pb2_grpc.ReservationsStub(channel) for channel in channels]
    as_whom = [(tenant, bearer(secret)) for tenant, secret in callers or [(work.tenant_id, token)]]
    now_ms = int(time.time() * 1000)
    wait = r.Wait(timeout_ms=wait_ms) if wait_ms else None
    if wait_ms:
        timeout = max(timeout, wait_ms / 1000 + 10)

    async def call(number: int) -> str:
        request = make_request(work, number, now_ms)
        tenant, md = as_whom[number % len(as_whom)]
        request.tenant_id = tenant
        if wait is not None:
            request.wait.CopyFrom(wait)
        try:
            reply = await stubs[number % len(stubs)].Create(request, metadata=md, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return error_label(exc)
        if reply.state == "queued" and wait is not None:
            return "queued (not placed within the wait)"
        return reply.state or "(no state)"

    return call


def request_size() -> int:
    """Bytes of a typical request, so the echo baseline carries the same payload."""
    work = Workload("bench", "pool_" + "0" * 26, "bench-0000000000")
    return len(make_request(work, 0, int(time.time() * 1000)).SerializeToString())
