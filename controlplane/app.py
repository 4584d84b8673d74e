"""Assembling the control plane: the gRPC server (API, reflection, health) and the workers."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from psycopg_pool import AsyncConnectionPool

from bettercompute.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    capacity_pb2,
    capacity_pb2_grpc,
    events_pb2,
    events_pb2_grpc,
    grants_pb2,
    grants_pb2_grpc,
    instances_pb2,
    instances_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
    providers_pb2,
    providers_pb2_grpc,
    reservations_pb2,
    reservations_pb2_grpc,
    usage_pb2,
    usage_pb2_grpc,
)
from controlplane import db, event_hub, iam, metrics
from controlplane.common import gc_pauses
from controlplane.api.admin import AdminServicer
from controlplane.api.capacity import CapacityServicer
from controlplane.api.events import EventsServicer, WebhooksServicer
from controlplane.api.handlers import GenericOnly
from controlplane.api.node_admin import NodeAdminServicer
from controlplane.api.interceptor import ApiInterceptor, server_options
from controlplane.api.reservations import ConfirmationsServicer, ReservationsServicer
from controlplane.api.vps import (
    InstancesServicer,
    ProjectsServicer,
    ProviderAccountsServicer,
    ReservationGrantsServicer,
    UsageServicer,
)
from controlplane.config import Settings
from controlplane.placement import lease
from controlplane.nodes import hosts
from controlplane.metal import deploy
from controlplane.placement.index_sync import CapacityIndex
from controlplane.reservations import queued, reconciler
from controlplane.runtime import Runtime
from controlplane.vps import lifecycle as grant_lifecycle
from controlplane.vps import metering, scan as provider_scan
from controlplane.webhooks import delivery
from controlplane.workers import drafts, pending, queue, report_retention

log = structlog.get_logger(__name__)

SERVICES = (
    reservations_pb2.DESCRIPTOR.services_by_name["Reservations"].full_name,
    reservations_pb2.DESCRIPTOR.services_by_name["Confirmations"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
    capacity_pb2.DESCRIPTOR.services_by_name["Capacity"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["NodeAdmin"].full_name,
    events_pb2.DESCRIPTOR.services_by_name["Events"].full_name,
    events_pb2.DESCRIPTOR.services_by_name["Webhooks"].full_name,
    providers_pb2.DESCRIPTOR.services_by_name["ProviderAccounts"].full_name,
    providers_pb2.DESCRIPTOR.services_by_name["Projects"].full_name,
    grants_pb2.DESCRIPTOR.services_by_name["ReservationGrants"].full_name,
    instances_pb2.DESCRIPTOR.services_by_name["Instances"].full_name,
    usage_pb2.DESCRIPTOR.services_by_name["Usage"].full_name,
)

LEASE_TASK = "placer-lease"

# The work queue's handlers, by kind (a kind without one is refused at insert).
WORK_HANDLERS = {"reservation": reconciler.reconcile, "metal": deploy.handle,
                 grant_lifecycle.KIND: grant_lifecycle.reconcile}


@dataclass
class App:
    server: grpc.aio.Server
    port: int
    pool: AsyncConnectionPool
    runtime: Runtime
    hub: event_hub.EventHub
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)
    metrics_server: metrics.MetricsServer | None = None  # its port: metrics_server.port

    async def stop(self, grace: float = 1.0) -> None:
        self.stopping.set()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        await self.server.stop(grace)
        # The lease worker drops this process's pool leases once it sees `stopping`, so another
        # replica takes them now rather than at their lapse: it gets the grace to do so before
        # anything is cancelled (a stop with no RPC in flight is otherwise over at once).
        leases = [t for t in self.tasks if t.get_name() == LEASE_TASK]
        if leases:
            await asyncio.wait(leases, timeout=grace)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.pool.close()


async def start_app(
    settings: Settings, conninfo: str, *, listen: str = "127.0.0.1:0", workers: bool = True
) -> App:
    lease.check_default(settings)
    pool = await db.open_pool(conninfo, size=settings.db_pool_size)
    iam.POLICIES.entries = max(1, settings.policy_cache_entries)
    iam.POLICIES.max_nesting = settings.max_policy_nesting
    capacity = CapacityIndex(pool) if settings.placement_index else None
    leases = lease.LeaseWorker(settings)
    rt = Runtime(pool, settings, metrics.Metrics(pool, settings.metrics_refresh_seconds), capacity, leases)
    leases.drain = lambda pool_id, holder, epoch: queued.drain(rt, pool_id, holder, epoch)
    server = grpc.aio.server(interceptors=[ApiInterceptor(pool, settings, rt.metrics)],
                             options=server_options(settings))
    served = GenericOnly(server)  # reflection (below) registers its one method: it needs the server itself
    reservations_pb2_grpc.add_ReservationsServicer_to_server(ReservationsServicer(rt), served)
    reservations_pb2_grpc.add_ConfirmationsServicer_to_server(ConfirmationsServicer(rt), served)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(rt), served)
    capacity_pb2_grpc.add_CapacityServicer_to_server(CapacityServicer(rt), served)
    nodes_pb2_grpc.add_NodeAdminServicer_to_server(NodeAdminServicer(rt), served)
    hub = event_hub.EventHub(conninfo, event_hub.StreamSlots(settings.watch_streams_per_identity,
                                                     settings.watch_streams_per_tenant))
    events_pb2_grpc.add_EventsServicer_to_server(EventsServicer(rt, hub), served)
    events_pb2_grpc.add_WebhooksServicer_to_server(WebhooksServicer(rt), served)
    providers_pb2_grpc.add_ProviderAccountsServicer_to_server(ProviderAccountsServicer(rt), served)
    providers_pb2_grpc.add_ProjectsServicer_to_server(ProjectsServicer(rt), served)
    grants_pb2_grpc.add_ReservationGrantsServicer_to_server(ReservationGrantsServicer(rt), served)
    instances_pb2_grpc.add_InstancesServicer_to_server(InstancesServicer(rt), served)
    usage_pb2_grpc.add_UsageServicer_to_server(UsageServicer(rt), served)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, served)
    reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        credentials = _server_credentials(settings, listen)
        port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    except (RuntimeError, OSError, ValueError) as exc:
        await pool.close()
        raise RuntimeError(f"cannot listen on {listen}: {exc}") from None
    if port == 0:
        await pool.close()
        raise RuntimeError(f"cannot listen on {listen}")
    await server.start()
    for name in (*SERVICES, ""):
        result = health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if asyncio.iscoroutine(result):
            await result
    app = App(server, port, pool, rt, hub, metrics_server=await metrics.serve(rt.metrics, settings.metrics_listen))
    app.tasks.append(asyncio.create_task(hub.run(app.stopping), name="event-hub"))  # Watch needs it in every role
    if capacity is not None:  # every role places (creates, repairs)
        app.tasks.append(asyncio.create_task(capacity.run(conninfo, app.stopping), name="capacity-index"))
    # Every role holds pool leases (the lease placer) and wakes its waiting creates.
    app.tasks.append(asyncio.create_task(leases.run(conninfo, app.stopping), name=LEASE_TASK))
    if workers:
        app.tasks.append(asyncio.create_task(pending.run(rt, conninfo, app.stopping), name="pending"))
        app.tasks.append(asyncio.create_task(queue.run(
            rt, conninfo, app.stopping, WORK_HANDLERS, concurrency=settings.work_concurrency), name="work-queue"))
        app.tasks.append(asyncio.create_task(delivery.run(rt, conninfo, app.stopping), name="webhooks"))
        app.tasks.append(asyncio.create_task(drafts.run(rt, app.stopping), name="draft-expiry"))
        app.tasks.append(asyncio.create_task(report_retention.run(rt, app.stopping), name="report-retention"))
        app.tasks.append(asyncio.create_task(hosts.run(rt.pool, settings.host_sync_seconds, app.stopping),
                                             name="capacity-hosts"))
        app.tasks.append(asyncio.create_task(provider_scan.run(rt, app.stopping), name="vps.reservations"))
        app.tasks.append(asyncio.create_task(metering.run(rt, app.stopping), name="metering"))
    log.info("control plane serving", port=port, workers=workers, tls=bool(settings.tls_cert))
    return app


def _server_credentials(settings: Settings, listen: str) -> grpc.ServerCredentials | None:
    """TLS from BC_TLS_CERT and BC_TLS_KEY (PEM files); None (plaintext) when neither is set."""
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ValueError("TLS needs both BC_TLS_CERT and BC_TLS_KEY")
    if not settings.tls_cert:
        if listen.rpartition(":")[0] not in _LOOPBACK:
            log.warning("the API serves plaintext on a non-loopback address; set BC_TLS_CERT and BC_TLS_KEY",
                        listen=listen)
        return None
    with open(settings.tls_key, "rb") as key, open(settings.tls_cert, "rb") as chain:
        return grpc.ssl_server_credentials([(key.read(), chain.read())])


_LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}


def collect_as_a_server(app: App, settings: Settings) -> None:
    """This process is the control plane: its collector freezes the survivors of each full
    collection and its event loop's stalls are logged (controlplane.common.gc_pauses). Not done
    in start_app: a process that embeds a control plane (the tests) keeps its collector as it is."""
    collections = gc_pauses.install(settings.gc_unfreeze_seconds, structlog.get_logger("controlplane.gc"))
    app.tasks.append(asyncio.create_task(gc_pauses.watch(collections), name="gc-pauses"))


async def run_forever(settings: Settings, conninfo: str, listen: str) -> None:
    app = await start_app(settings, conninfo, listen=listen)
    collect_as_a_server(app, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scheme = "TLS" if settings.tls_cert else "plaintext"
    print(f"control plane listening on {listen.rsplit(':', 1)[0]}:{app.port} ({scheme})", flush=True)
    if app.metrics_server is not None:
        print(f"metrics on {settings.metrics_listen.rsplit(':', 1)[0]}:{app.metrics_server.port}", flush=True)
    await stop.wait()
    await app.stop()
