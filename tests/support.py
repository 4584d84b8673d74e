"""Test support: a control plane in a background thread on a loopback port, real gRPC clients,
and a per-test world (tenant, identities, tokens, pool, nodes, quota, policy)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import admin_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import reservations_pb2_grpc
from controlplane.common.status import error_info
from controlplane.config import Settings

PERMISSIVE = "permit(principal, action, resource);"


class ServerThread:
    """The real control plane (grpc.aio + psycopg pool + workers) on its own event loop."""

    def __init__(self, conninfo: str, settings: Settings | None = None, workers: bool = True) -> None:
        self.conninfo = conninfo
        self.settings = settings or Settings(database_url=conninfo, pending_retry_seconds=30)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        from controlplane.app import start_app

        self.app = self.call(start_app(self.settings, conninfo, listen="127.0.0.1:0", workers=workers))
        self.port = self.app.port
        self.endpoint = f"127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if not self.thread.is_alive():  # stopped already
            return
        try:
            self.call(self.app.stop(0.2))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():  # its selector and self-pipe: no descriptors left behind
                self.loop.close()


class _Opened:
    """Every Client and World opened, in order, until closed: the conftest closes what a test
    opened and left open (channels and connections do not outlive their test)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._items: dict[int, Any] = {}

    def add(self, item: Any) -> int:
        with self._lock:
            n = next(self._seq)
            self._items[n] = item
            return n

    def discard(self, n: int) -> None:
        with self._lock:
            self._items.pop(n, None)

    def mark(self) -> int:
        """A position: close_since(mark) closes what was opened after it."""
        with self._lock:
            return next(self._seq)

    def close_since(self, mark: int) -> None:
        with self._lock:
            later = [item for n, item in self._items.items() if n > mark]
        for item in reversed(later):
            item.close()


OPENED = _Opened()


class Client:
    """Sync stubs with a bearer token."""

    def __init__(self, endpoint: str, token: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self._opened = OPENED.add(self)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self._r = reservations_pb2_grpc.ReservationsStub(self.channel)
        self._c = reservations_pb2_grpc.ConfirmationsStub(self.channel)
        self._a = admin_pb2_grpc.AdminStub(self.channel)

    def _call(self, stub: Any, method: str, request: Any, **kw: Any) -> Any:
        return getattr(stub, method)(request, metadata=self.metadata, timeout=kw.pop("timeout", 60), **kw)

    def res(self, method: str, request: Any, **kw: Any) -> Any:
        return self._call(self._r, method, request, **kw)

    def conf(self, method: str, request: Any, **kw: Any) -> Any:
        return self._call(self._c, method, request, **kw)

    def admin(self, method: str, request: Any, **kw: Any) -> Any:
        return self._call(self._a, method, request, **kw)

    def close(self) -> None:
        OPENED.discard(self._opened)
        self.channel.close()


def rpc_error(excinfo: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(gRPC code, spec code, details) of a failed call, as pytest.raises caught it."""
    return error_of(excinfo.value)


def error_of(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(gRPC code, spec code, details) of a failed call's error."""
    info = error_info(exc)
    assert info is not None, f"no ErrorInfo on {exc}"
    return exc.code(), info.reason, dict(info.metadata)


def refused(call, *args, **kw) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(gRPC code, spec code, details) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as exc:
        call(*args, **kw)
    return rpc_error(exc)


def outcome(call, *args, **kw) -> Any:
    """The call's answer, or (gRPC code, spec code, details) of its refusal (the call made once)."""
    try:
        return call(*args, **kw)
    except grpc.RpcError as exc:
        return error_of(exc)


def invalid(field: str, call, *args, **kw) -> dict[str, str]:
    """The details of a call that must be INVALID_INPUT naming `field`."""
    code, reason, details = refused(call, *args, **kw)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT"), details
    assert details["field"] == field, details
    return details


_counter = itertools.count()


def clock_now(world: World) -> int:
    """compute_now() in epoch ms, as the server's clock control reads it."""
    return world.root.admin("GetClock", apb.GetClockRequest()).now


def gpus(node: str, count: int = 8, model: str = "H100-SXM5-80GB", domains: int = 1) -> list[apb.Gpu]:
    per_domain = max(1, count // domains)
    return [
        apb.Gpu(uuid=f"GPU-{node}-{i}", model=model, memory_mib=81559, numa_node=0 if i < count // 2 else 1,
                nvlink_domain=f"{node}-nvl{i // per_domain}")
        for i in range(count)
    ]


@dataclass
class World:
    """An isolated tenant with a pool of nodes, a quota, a policy and a user token."""

    endpoint: str
    root: Client
    conninfo: str
    tenant: str = ""
    pool_id: str = ""
    user: Client | None = None
    user_id: str = ""
    nodes: list[apb.Node] = field(default_factory=list)
    # Creates wait this long for their answer unless they say otherwise (a lease pool's create
    # answers queued without one): tests written for either placer set it.
    wait_ms: int = 0
    _conn: psycopg.Connection | None = field(default=None, repr=False)
    _clients: list[Client] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._opened = OPENED.add(self)

    def identity(self, kind: str = "user", tenants: list[str] | None = None, **delegation: Any) -> tuple[str, Client]:
        ident = f"{kind}-{uuid.uuid4().hex[:10]}"
        req = apb.CreateIdentityRequest(id=ident, kind=kind, name=ident, tenant_ids=tenants or [self.tenant])
        if delegation:
            req.delegation.CopyFrom(apb.Delegation(**delegation))
        self.root.admin("CreateIdentity", req)
        token = self.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident)).secret
        client = Client(self.endpoint, token)
        self._clients.append(client)
        return ident, client

    def add_node(self, gpu_list: list[apb.Gpu] | None = None, name: str | None = None, **kw: Any) -> apb.Node:
        name = name or f"n{next(_counter):05d}"
        node = self.root.admin("RegisterNode", apb.RegisterNodeRequest(
            pool_id=self.pool_id, name=name, gpus=gpu_list if gpu_list is not None else gpus(name), **kw))
        self.nodes.append(node)
        return node

    def quota(self, limit: int, resource: str = "gpu") -> None:
        self.root.admin("SetQuota", apb.SetQuotaRequest(tenant_id=self.tenant, resource=resource, limit=limit))

    def policy(self, cedar: str) -> None:
        self.root.admin("PutPolicy", apb.PutPolicyRequest(tenant_id=self.tenant, cedar=cedar))

    def create(self, client: Client | None = None, *, key: str | None = None, count: int = 1,
               topology: str = "", duration: str = "1h", **kw: Any) -> pb.Reservation:
        return (client or self.user).res("Create", self.create_request(key=key, count=count, topology=topology,
                                                                        duration=duration, **kw))

    def create_request(self, *, key: str | None = None, count: int = 1, topology: str = "",
                       duration: str | None = "1h", **kw: Any) -> pb.CreateReservationRequest:
        req = pb.CreateReservationRequest(
            tenant_id=self.tenant, pool_id=kw.pop("pool_id", self.pool_id),
            devices=[pb.DeviceRequest(device_class=kw.pop("device_class", "gpu"), count=count, topology=topology,
                                      model=kw.pop("model", ""), profile=kw.pop("profile", ""))],
            idempotency_key=key or f"k-{uuid.uuid4().hex[:12]}", **kw)
        if duration is not None and "duration_ms" not in kw:
            req.duration = duration
        if self.wait_ms and not req.HasField("wait"):
            req.wait.timeout_ms = self.wait_ms
        return req

    def later(self, hours: float = 24) -> int:
        """Epoch ms `hours` after compute_now(): a start that keeps a reservation placed."""
        return self.sql("SELECT epoch_ms(compute_now())")[0][0] + int(hours * 3_600_000)

    def sql(self, query: str, params: Any = None) -> list[tuple]:
        """One statement in its own transaction, on the world's one connection."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.conninfo, autocommit=True)
        cur = self._conn.execute(query, params)
        return cur.fetchall() if cur.description else []

    def close(self) -> None:
        """Close the identities' channels and the SQL connection (not root's: the stack owns it)."""
        OPENED.discard(self._opened)
        for client in self._clients:
            client.close()
        if self._conn is not None:
            self._conn.close()


def make_world(endpoint: str, root: Client, conninfo: str, *, nodes: int = 2, quota: int = 64,
               policy: str | None = PERMISSIVE) -> World:
    w = World(endpoint, root, conninfo)
    w.tenant = f"t{uuid.uuid4().hex[:10]}"
    root.admin("CreateTenant", apb.CreateTenantRequest(id=w.tenant, name=w.tenant))
    w.pool_id = root.admin("CreatePool", apb.CreatePoolRequest(owner_tenant_id=w.tenant, name="p", region="eu-1")).id
    for _ in range(nodes):
        w.add_node()
    if quota:
        w.quota(quota)
    if policy:
        w.policy(policy)
    w.user_id, w.user = w.identity()
    return w


def offered_guest(world: World, *, quota: int = 64) -> World:
    """A second tenant (quota, permissive policy, a user) that `world`'s pool is offered to; its
    pool_id is that pool. The caller closes it."""
    guest = make_world(world.endpoint, world.root, world.conninfo, nodes=0, quota=quota)
    world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
    guest.pool_id = world.pool_id
    return guest


def get(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def eventually(world: World, rid: str, check: Any, seconds: float = 10, poll: float = 0.05) -> pb.Reservation:
    """Poll Get until `check(reservation)` holds; then a fresh read (the check may have looked at
    rows committed after the read it was given)."""
    deadline = time.monotonic() + seconds
    while True:
        r = get(world, rid)
        if check(r):
            return get(world, rid)
        assert time.monotonic() < deadline, f"timed out; last read: {r}"
        time.sleep(poll)
