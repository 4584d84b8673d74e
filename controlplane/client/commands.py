"""One function per command: build the request, call, return the answer (a protobuf message).

`reserve_request` and `create_and_wait` are shared with the MCP server.
"""

from __future__ import annotations

import argparse
import math
import time
import uuid
from collections.abc import Callable, Iterator

from google.protobuf.message import Message

from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import usage_pb2 as upb
from controlplane.client.connection import RPC_TIMEOUT_S, Client
from controlplane.client.errors import UsageError
from controlplane.client.times import parse_duration, parse_minutes, parse_moment

MAX_SERVER_WAIT_MS = 30_000  # the server holds a create at most this long
INT32_MAX = 2**31 - 1


def int32(flag: str, value: int) -> int:
    """`value` if it fits the request's 32-bit field (the server checks the range it allows)."""
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise UsageError(f"{flag} {value}: out of range")
    return value


def reserve_request(
    client: Client,
    *,
    gpus: int,
    topology: str = "",
    duration: str = "1h",
    start: str | None = None,
    key: str | None = None,
    pool: str | None = None,
    lease: str | None = None,
    kubernetes: bool = False,
    device_class: str = "gpu",
    profile: str = "",
    cpus: int | None = None,
    memory_gib: int | None = None,
    node_profile: str | None = None,
    gang: int | None = None,
    topology_key: str = "",
    spot: bool = False,
    earliest: bool = False,
    horizon: str | None = None,
) -> pb.CreateReservationRequest:
    pool_id = pool or client.conn.pool_id
    if not pool_id:
        raise UsageError("no pool: pass --pool or use a connection file that names one")
    request = pb.CreateReservationRequest(
        tenant_id=client.conn.tenant_id,
        pool_id=pool_id,
        devices=[pb.DeviceRequest(device_class=device_class, count=int32("--gpus", gpus), topology=topology,
                                  profile=profile)],
        duration_ms=parse_duration("--for", duration),  # `1h30m` as `list` prints it: the API reads one unit
        idempotency_key=key or f"cli-{uuid.uuid4().hex}",
        binding="kubernetes" if kubernetes else "",
        spot=spot,
    )
    if cpus is not None or memory_gib is not None:  # sent as resources; unset ones take the pool's share
        request.resources.CopyFrom(pb.HostResources(vcpu=cpus, memory_gib=memory_gib))
    if node_profile:
        if kubernetes:
            raise UsageError("--node-profile and --kubernetes are different bindings: pick one")
        request.binding = "node"
        request.node.CopyFrom(node_lease("--node-profile", node_profile))
    if gang is not None:
        request.gang.CopyFrom(pb.Gang(size=int32("--gang", gang), topology_key=topology_key))
    elif topology_key:
        raise UsageError("--topology-key needs --gang")
    if start:
        if earliest:
            raise UsageError("--start and --earliest: pick one")
        request.start = parse_moment("--start", start)
    request.start_earliest = earliest
    if horizon:
        if not earliest:
            raise UsageError("--horizon needs --earliest")
        request.horizon_ms = parse_duration("--horizon", horizon)
    if lease:
        request.lease_seconds = parse_duration("--lease", lease) // 1000
    return request


def node_lease(flag: str, text: str) -> pb.NodeLease:
    """`ID` or `ID:VERSION` (the server checks the id; a version is a positive number)."""
    profile_id, sep, version = text.partition(":")
    if not profile_id or (sep and not version.isdigit()) or (sep and int(version) < 1):
        raise UsageError(f"{flag} {text!r}: use a profile id, or id:version with a version from 1")
    lease = pb.NodeLease(profile_id=profile_id)
    if sep:
        lease.profile_version = int(version)
    return lease


def create_and_wait(
    client: Client,
    request: pb.CreateReservationRequest,
    wait_s: float,
    on_state: Callable[[str], None] = lambda state: None,
) -> pb.Reservation:
    """Create with `wait`; if the answer is still queued, poll get until the same deadline."""
    if not math.isfinite(wait_s):
        raise UsageError(f"--wait {wait_s}: use a number of seconds")
    deadline = time.monotonic() + wait_s
    server_wait_s = min(wait_s, MAX_SERVER_WAIT_MS / 1000)  # before scaling: 1e308 s is finite, 1e311 ms is not
    request.wait.timeout_ms = int(server_wait_s * 1000)
    reservation = client.call("reservations", "Create", request, timeout=server_wait_s + RPC_TIMEOUT_S)
    on_state(reservation.state)
    pause = 0.25
    while reservation.operation.state == "running" and time.monotonic() + pause < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
        reservation = client.call("reservations", "Get", _get_request(client, reservation.id))
        on_state(reservation.state)
    return reservation


def reserve(client: Client, args: argparse.Namespace, on_state: Callable[[str], None]) -> Message:
    request = reserve_request(
        client, gpus=args.gpus, topology=args.topology, duration=args.duration, start=args.start,
        key=args.key, pool=args.pool, lease=args.lease, kubernetes=args.kubernetes,
        device_class=args.device_class, profile=args.profile,
        cpus=args.cpus, memory_gib=args.memory,
        node_profile=args.node_profile,
        gang=args.gang, topology_key=args.topology_key, spot=args.spot, earliest=args.earliest,
        horizon=args.horizon,
    )
    return create_and_wait(client, request, args.wait, on_state)


def capacity(client: Client, args: argparse.Namespace) -> Message:
    """The pool's rollup, or with --preview where `reserve` with the same flags would place."""
    pool_id = args.pool or client.conn.pool_id
    if not pool_id:
        raise UsageError("no pool: pass --pool or use a connection file that names one")
    if not args.preview:
        if args.gpus is not None:
            raise UsageError("--gpus and the other reserve flags go with --preview")
        return client.call("capacity", "Rollup", cpb.RollupRequest(tenant_id=client.conn.tenant_id, pool_id=pool_id))
    if args.gpus is None:
        raise UsageError("--preview needs --gpus")
    request = reserve_request(
        client, gpus=args.gpus, topology=args.topology, duration=args.duration, start=args.start, pool=args.pool,
        kubernetes=args.kubernetes, device_class=args.device_class, profile=args.profile, cpus=args.cpus,
        memory_gib=args.memory, node_profile=args.node_profile, gang=args.gang, topology_key=args.topology_key,
        spot=args.spot, earliest=args.earliest, horizon=args.horizon,
    )
    return client.call("capacity", "Preview", request)


def _get_request(client: Client, reservation_id: str) -> pb.GetReservationRequest:
    return pb.GetReservationRequest(tenant_id=client.conn.tenant_id, reservation_id=reservation_id)


def get(client: Client, args: argparse.Namespace) -> Message:
    return client.call("reservations", "Get", _get_request(client, args.reservation_id))


def list_(client: Client, args: argparse.Namespace) -> Message:
    request = pb.ListReservationsRequest(
        tenant_id=client.conn.tenant_id,
        scope="all" if args.all else "mine",
        states=args.state or [],
        pool_id=args.pool or "",  # only when given: the connection's pool does not filter
        limit=args.limit,
        cursor=args.cursor or "",
    )
    return client.call("reservations", "List", request)


def extend_request(
    client: Client, reservation_id: str, *, until: str | None, by: str | None, key: str | None
) -> pb.ExtendReservationRequest:
    request = pb.ExtendReservationRequest(
        tenant_id=client.conn.tenant_id,
        reservation_id=reservation_id,
        idempotency_key=key or f"cli-{uuid.uuid4().hex}",
    )
    if (until is None) == (by is None):
        raise UsageError("extend takes exactly one of until (--until) and by (--by)")
    if until is not None:
        request.until = parse_moment("--until", until)
    else:
        request.by = f"{parse_duration('--by', by or '')}ms"
    return request


def extend(client: Client, args: argparse.Namespace) -> Message:
    request = extend_request(client, args.reservation_id, until=args.until, by=args.by, key=args.key)
    return client.call("reservations", "Extend", request)


def renew(client: Client, args: argparse.Namespace) -> Message:
    request = pb.RenewReservationRequest(tenant_id=client.conn.tenant_id, reservation_id=args.reservation_id)
    return client.call("reservations", "Renew", request)


def release(client: Client, args: argparse.Namespace) -> Message:
    request = pb.ReleaseReservationRequest(tenant_id=client.conn.tenant_id, reservation_id=args.reservation_id)
    return client.call("reservations", "Release", request)


def cancel(client: Client, args: argparse.Namespace) -> Message:
    request = pb.CancelReservationRequest(tenant_id=client.conn.tenant_id, reservation_id=args.reservation_id)
    return client.call("reservations", "Cancel", request)


def timeline(client: Client, args: argparse.Namespace) -> Message:
    pool_id = args.pool or client.conn.pool_id
    if not pool_id:
        raise UsageError("no pool: pass --pool or use a connection file that names one")
    request = cpb.TimelineRequest(tenant_id=client.conn.tenant_id, pool_id=pool_id)
    if args.from_:
        setattr(request, "from", parse_moment("--from", args.from_))  # `from` is a keyword
    if args.to:
        request.to = parse_moment("--to", args.to)
    if args.step:
        request.step_minutes = parse_minutes("--step", args.step)
    return client.call("capacity", "Timeline", request)


def confirmation(client: Client, args: argparse.Namespace) -> Message:
    request = pb.DecideConfirmationRequest(tenant_id=client.conn.tenant_id, confirmation_id=args.confirmation_id)
    method = {"approve": "Approve", "reject": "Reject"}[args.decision]
    return client.call("confirmations", method, request)


def watch(client: Client, args: argparse.Namespace) -> Iterator[epb.Event]:
    """The tenant's events after `--after` (or from now), as they happen; `--count` stops early."""
    if args.after and args.from_now:
        raise UsageError("watch takes --after or --from-now, not both")
    request = epb.WatchRequest(
        tenant_id=client.conn.tenant_id,
        after_id=args.after or 0,
        from_now=args.from_now,
        types=args.type or [],
        subject=args.subject or "",
    )
    stream = client.call("events", "Watch", request, timeout=None)
    try:
        for seen, event in enumerate(stream, start=1):
            yield event
            if args.count and seen >= args.count:
                return
    finally:
        stream.cancel()


def usage(client: Client, args: argparse.Namespace) -> Message:
    """The tenant's metered usage by meter, pool and hour range (hours starting in [from, to))."""
    pool_id = (args.pool or client.conn.pool_id) if args.only_pool else ""
    if args.only_pool and not pool_id:
        raise UsageError("no pool: pass --pool or use a connection file that names one")
    request = upb.QueryUsageRequest(tenant_id=client.conn.tenant_id, meter=args.meter or "", pool_id=pool_id)
    if args.from_:
        setattr(request, "from", parse_moment("--from", args.from_))  # `from` is a keyword
    if args.to:
        request.to = parse_moment("--to", args.to)
    return client.call("usage", "Query", request)


# The operator's commands (NodeAdmin, root's token) --------------------------------------------


def join_token(client: Client, args: argparse.Namespace) -> Message:
    pool_id = args.pool or client.conn.pool_id
    if not pool_id:
        raise UsageError("no pool: pass --pool or use a connection file that names one")
    ttl_s = parse_duration("--ttl", args.ttl) // 1000 if args.ttl else 0
    if args.ttl and ttl_s < 1:  # 0 on the wire is the server's default, an hour
        raise UsageError(f"--ttl {args.ttl!r}: at least 1s")
    return client.call("nodes", "CreateJoinToken", npb.CreateJoinTokenRequest(
        pool_id=pool_id, node_name=args.name, role=args.role, ttl_seconds=ttl_s))


def node_certificates(client: Client, args: argparse.Namespace) -> Message:
    return client.call("nodes", "ListNodeCertificates", npb.ListNodeCertificatesRequest(node_id=args.node_id))


def revoke_node(client: Client, args: argparse.Namespace) -> Message:
    request = npb.RevokeCertificatesRequest(reason=args.reason)
    if args.serial:
        request.serial = args.serial
    else:
        request.node_id = args.node_id
    return client.call("nodes", "RevokeCertificates", request)


def readmit_node(client: Client, args: argparse.Namespace) -> Message:
    return client.call("nodes", "ReadmitNode", npb.ReadmitNodeRequest(node_id=args.node_id))
