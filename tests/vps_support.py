"""Test support for provider accounts, grants, instances and metering: the simulated provider
(providersim's real gRPC server on a loopback port, on its own event loop), stubs for the vps
services, and a world with an account whose reservation is bound to the world's pool."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from bettercompute.provider.v1 import provider_pb2 as ppb
from bettercompute.provider.v1 import provider_pb2_grpc as ppb_grpc
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import grants_pb2 as gpb
from bettercompute.v1 import grants_pb2_grpc
from bettercompute.v1 import instances_pb2 as ipb
from bettercompute.v1 import instances_pb2_grpc
from bettercompute.v1 import providers_pb2 as vpb
from bettercompute.v1 import providers_pb2_grpc
from bettercompute.v1 import usage_pb2 as upb
from bettercompute.v1 import usage_pb2_grpc
from tests.conftest import module_stack
from tests.support import PERMISSIVE, Client, ServerThread, World, make_world, outcome  # noqa: F401 (outcome: re-exported)

HOUR = 3_600_000
MIN = 60_000
FLAVOR = "n2-standard-8"
SIM_ACCOUNT = "acct-1"


class SimThread:
    """providersim's server (the real one) on its own loop, with a Simulator stub to drive it."""

    def __init__(self) -> None:
        from providersim.server import serve

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        started = asyncio.run_coroutine_threadsafe(serve("127.0.0.1:0"), self.loop)
        self.server, self.port, self.state, self.stalls = started.result(10)
        self.endpoint = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.endpoint)
        self.sim = ppb_grpc.SimulatorStub(self.channel)
        self.provider = ppb_grpc.ProviderStub(self.channel)

    def put(self, name: str, total: int, *, account: str = SIM_ACCOUNT, flavor: str = FLAVOR,
            region: str = "eu-1") -> ppb.Reservation:
        return self.sim.PutReservation(ppb.PutReservationRequest(account=account, name=name, flavor=flavor,
                                                                 region=region, total=total))

    def delete(self, name: str, *, account: str = SIM_ACCOUNT) -> ppb.Reservation:
        return self.sim.DeleteReservation(ppb.DeleteReservationRequest(account=account, name=name))

    def faults(self, failure_rate: float = 0.0, stall_ms: int = 0) -> ppb.Faults:
        return self.sim.SetFaults(ppb.Faults(failure_rate=failure_rate, stall_ms=stall_ms))

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():  # its selector and self-pipe: no descriptors left behind
            self.loop.close()


class Stubs:
    """The vps services with a client's bearer token."""

    def __init__(self, client: Client) -> None:
        self._md = client.metadata
        self._stubs = {"accounts": providers_pb2_grpc.ProviderAccountsStub(client.channel),
                       "projects": providers_pb2_grpc.ProjectsStub(client.channel),
                       "grants": grants_pb2_grpc.ReservationGrantsStub(client.channel),
                       "instances": instances_pb2_grpc.InstancesStub(client.channel),
                       "usage": usage_pb2_grpc.UsageStub(client.channel)}

    def __call__(self, service: str, method: str, request: Any) -> Any:
        return getattr(self._stubs[service], method)(request, metadata=self._md, timeout=60)


@dataclass
class Vps:
    """A world whose pool has reservation `res-1` (total `total`) of an account bound to it."""

    world: World
    sim: SimThread
    root: Stubs
    user: Stubs
    account_id: str = ""
    reservation: str = "res-1"
    external: str = ""
    server: Any = None  # the ServerThread, where a test calls a domain function in its loop

    def put(self, total: int, name: str | None = None) -> ppb.Reservation:
        """The provider's reservation (res-1 unless named) now has `total` slots."""
        return self.sim.put(name or self.reservation, total, account=self.external)

    def gone(self, name: str | None = None) -> ppb.Reservation:
        """The provider stops reporting the reservation."""
        return self.sim.delete(name or self.reservation, account=self.external)

    def scan(self) -> list[vpb.ProviderReservation]:
        return list(self.root("accounts", "ScanReservations", vpb.GetProviderAccountRequest(
            tenant_id="root", account_id=self.account_id)).items)

    def grant_request(self, *, slots: int = 1, starts_at: int | None = None, ends_at: int | None = None,
                      tenant: str | None = None, key: str | None = None,
                      **kw: Any) -> gpb.CreateReservationGrantRequest:
        start = starts_at if starts_at is not None else self.now()
        return gpb.CreateReservationGrantRequest(
            tenant_id="root", account_id=kw.pop("account_id", self.account_id),
            reservation_id=kw.pop("reservation_id", self.reservation), grant_tenant_id=tenant or self.world.tenant,
            slots=slots, starts_at=start, ends_at=ends_at if ends_at is not None else start + 2 * HOUR,
            idempotency_key=key or f"g-{uuid.uuid4().hex[:12]}", **kw)

    def grant(self, **kw: Any) -> gpb.ReservationGrant:
        return self.root("grants", "Create", self.grant_request(**kw))

    def get_grant(self, grant_id: str, tenant: str | None = None, stubs: Stubs | None = None) -> gpb.ReservationGrant:
        return (stubs or self.user)("grants", "Get", gpb.GetReservationGrantRequest(
            tenant_id=tenant or self.world.tenant, grant_id=grant_id))

    def end(self, grant_id: str) -> gpb.ReservationGrant:
        return self.root("grants", "End", gpb.EndReservationGrantRequest(
            tenant_id="root", account_id=self.account_id, grant_id=grant_id))

    def instance(self, stubs: Stubs | None = None, tenant: str | None = None, **kw: Any) -> ipb.Instance:
        return (stubs or self.user)("instances", "Create", ipb.CreateInstanceRequest(
            tenant_id=tenant or self.world.tenant, pool_id=kw.pop("pool_id", self.world.pool_id),
            flavor=kw.pop("flavor", FLAVOR), name=kw.pop("name", f"vm-{uuid.uuid4().hex[:8]}"),
            idempotency_key=kw.pop("key", f"i-{uuid.uuid4().hex[:12]}"), **kw))

    def instance_call(self, method: str, instance_id: str, stubs: Stubs | None = None,
                      tenant: str | None = None) -> ipb.Instance:
        return (stubs or self.user)("instances", method, ipb.InstanceRequest(
            tenant_id=tenant or self.world.tenant, instance_id=instance_id))

    def usage(self, tenant: str | None = None, stubs: Stubs | None = None, **kw: Any) -> upb.QueryUsageResponse:
        return (stubs or self.user)("usage", "Query", upb.QueryUsageRequest(tenant_id=tenant or self.world.tenant,
                                                                            **kw))

    def now(self) -> int:
        return self.world.root.admin("GetClock", apb.GetClockRequest()).now

    def advance(self, ms: int) -> int:
        return self.world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=ms)).now


def make_vps(world: World, sim: SimThread, *, total: int = 4, external: str | None = None) -> Vps:
    world.root.admin("PutPolicy", apb.PutPolicyRequest(tenant_id="root", cedar=PERMISSIVE))
    external = external or f"acct-{uuid.uuid4().hex[:8]}"
    v = Vps(world, sim, Stubs(world.root), Stubs(world.user), external=external)
    v.account_id = v.root("accounts", "Create", vpb.CreateProviderAccountRequest(
        tenant_id="root", name=f"a-{uuid.uuid4().hex[:8]}", provider="sim", endpoint=sim.endpoint,
        external_account=external)).id
    sim.put(v.reservation, total, account=external)
    v.scan()
    v.root("accounts", "BindReservation", vpb.BindReservationRequest(
        tenant_id="root", account_id=v.account_id, reservation_id=v.reservation, pool_id=world.pool_id))
    return v


# The fixtures the vps test modules share: a module names them in its imports (and defines its own
# `stack` with `own_stack`, and `world` with `world_of`, where it needs other settings).

def own_stack(pg_uri: str, **extra: Any) -> Iterator[tuple[ServerThread, Client]]:
    """A control plane of the test's own (it moves the clock), metering every 0.2 s."""
    yield from module_stack(pg_uri, clock_control=True, metering_seconds=0.2, metering_settle_seconds=0,
                            provider_call_seconds=1, **extra)


def world_of(stack: tuple[ServerThread, Client], nodes: int = 0) -> Iterator[World]:
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=nodes)
    yield w
    w.close()


@pytest.fixture(scope="module")
def sim() -> Iterator[SimThread]:
    s = SimThread()
    yield s
    s.close()


@pytest.fixture
def v(world: World, sim: SimThread, stack: tuple[ServerThread, Client]) -> Vps:
    made = make_vps(world, sim, total=4)
    made.server = stack[0]
    return made


@pytest.fixture
def other(v: Vps) -> Iterator[tuple[World, Stubs]]:
    """Another tenant the pool is offered to."""
    w = make_world(v.world.endpoint, v.world.root, v.world.conninfo, nodes=0)
    v.world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=v.world.pool_id, tenant_id=w.tenant))
    yield w, Stubs(w.user)
    w.close()


def metered(v: Vps, meter: str, subject: str, before: int | None = None) -> float:
    """The world tenant's metered quantity of `meter` for `subject` (hours before `before`, if given)."""
    return v.world.sql("SELECT coalesce(sum(quantity), 0)::float8 FROM usage_records WHERE tenant_id = %s"
                       " AND meter = %s AND subject = %s AND (%s::bigint IS NULL OR hour < from_epoch_ms(%s))",
                       (v.world.tenant, meter, subject, before, before))[0][0]


def progress(v: Vps, source: str) -> int:
    """Where the meter of `source` has got to (epoch ms; 0 before its first pass)."""
    found = v.world.sql("SELECT epoch_ms(metered_until) FROM metering_progress WHERE source = %s", (source,))
    return found[0][0] if found else 0

