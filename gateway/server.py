"""Assembling a gateway: the CA and a server certificate, the two TLS listeners, the LISTEN hub,
the unreachable sweeper and the certificate renewal."""

from __future__ import annotations

import asyncio
import pathlib
import signal
from dataclasses import dataclass, field

import grpc
import psycopg
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2_grpc
from controlplane import db
from controlplane.common import gc_pauses
from controlplane.metrics import GatewayMetrics, MetricsServer
from controlplane.metrics import serve as serve_metrics
from controlplane.nodes import connectivity
from controlplane.pki import enrolment, store
from gateway import sweeper
from gateway.config import GatewaySettings
from gateway.hub import Hub
from gateway.interceptor import GatewayInterceptor
from gateway.refusals import Refusals
from gateway.servicer import NodeGatewayServicer
from gateway.session import SessionRunner
from gateway.throttle import Throttle
from gateway.tls import ServerTls

log = structlog.get_logger("gateway")
ENROL_PEERS_KEPT = 100_000  # addresses whose refused enrolments are remembered (gateway.throttle)
GC_LOG = structlog.get_logger("gateway.gc")  # the pause log's name, as before it moved to controlplane.common


@dataclass
class Gateway:
    server: grpc.aio.Server
    port: int  # mutual TLS: Session, Renew
    enrol_port: int  # server-only TLS: Enrol
    pool: AsyncConnectionPool
    ca: store.Ca
    hub: Hub
    stopping: asyncio.Event
    runner: SessionRunner
    stop_db_seconds: float  # GatewaySettings.stop_db_seconds: what `stop` gives the sessions' release
    tasks: list[asyncio.Task] = field(default_factory=list)
    metrics_server: MetricsServer | None = None  # its port: metrics_server.port

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving, then release this gateway's sessions within stop_db_seconds of database
        time: past it they are left registered, as a crash leaves them, and each node is judged
        by its grace; the process stops either way."""
        self.stopping.set()
        self.runner.closing = True
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        await self.server.stop(grace)
        try:
            await asyncio.wait_for(self.runner.release_all(), self.stop_db_seconds)
        except (asyncio.TimeoutError, psycopg.Error) as exc:  # a pool's timeout is a psycopg.Error too
            log.warning("sessions left registered: the database did not answer in time",
                        error=repr(exc), seconds=self.stop_db_seconds)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.pool.close()


async def start_gateway(settings: GatewaySettings, conninfo: str, *, listen: str | None = None,
                        enrol_listen: str | None = None) -> Gateway:
    collections = gc_pauses.install(settings.gc_unfreeze_seconds, GC_LOG)
    pool = await db.open_pool(conninfo, size=settings.db_pool_size)
    ca = await enrolment.load_ca(pool, settings.pki)
    server_tls = ServerTls(pool, ca, settings.pki, settings.hosts)
    await server_tls.refresh()
    hub, stopping = Hub(), asyncio.Event()
    tasks = [asyncio.create_task(hub.listen(conninfo, stopping), name="gateway-listen")]
    await asyncio.wait_for(hub.listening.wait(), timeout=30)

    metrics = GatewayMetrics(lambda: len({s.node_id for s in hub.sessions()}))
    server = grpc.aio.server(interceptors=[GatewayInterceptor(metrics)], options=server_options(settings))
    liveness = connectivity.Liveness(pool, settings.node_grace_seconds, settings.node_seen_write_fraction)
    runner = SessionRunner(pool, hub, settings.gateway_id, liveness,
                           Throttle(settings.node_messages_per_second, settings.node_messages_burst),
                           settings.node_unsent_acks, settings.node_unjudged_reports,
                           Throttle(settings.node_free_messages_per_second, settings.node_free_messages_burst))
    renewals = Throttle(settings.node_renewals_per_hour / 3600, settings.node_renewals_burst)
    refusals = Refusals(settings.refused_certificates, settings.refused_certificate_seconds)
    enrolments = Throttle(settings.enrol_refusals_per_minute / 60, settings.enrol_refusals_burst, keep=ENROL_PEERS_KEPT)
    node_pb2_grpc.add_NodeGatewayServicer_to_server(
        NodeGatewayServicer(pool, ca, settings.pki, runner, renewals, refusals, enrolments), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_secure_port(listen or settings.listen, server_tls.credentials(require_client_auth=True))
    enrol_port = server.add_secure_port(enrol_listen or settings.enrol_listen,
                                        server_tls.credentials(require_client_auth=False))
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    tasks.append(asyncio.create_task(
        sweeper.run(liveness, settings.sweep_seconds, stopping), name="gateway-sweeper"))
    tasks.append(asyncio.create_task(server_tls.keep_fresh(stopping), name="gateway-tls"))
    tasks.append(asyncio.create_task(gc_pauses.watch(collections), name="gateway-gc"))
    log.info("gateway serving", port=port, enrol_port=enrol_port, gateway=settings.gateway_id,
             node_grace_seconds=settings.node_grace_seconds)
    return Gateway(server, port, enrol_port, pool, ca, hub, stopping, runner, settings.stop_db_seconds, tasks,
                   await serve_metrics(metrics, settings.metrics_listen))


def server_options(settings: GatewaySettings) -> list[tuple[str, int]]:
    """gRPC's per-connection costs, which thousands of idle node sessions multiply
    (docs/benchmarks-fleet.md): the TLS record buffer, BDP pings, and channelz's bookkeeping of
    every socket and call (nothing here serves channelz)."""
    return [("grpc.tsi.max_frame_size", settings.tls_frame_bytes),
            ("grpc.http2.bdp_probe", int(settings.http2_bdp_probe)),
            ("grpc.enable_channelz", 0)]


def _host(listen: str) -> str:
    host = listen.rpartition(":")[0]
    return "127.0.0.1" if host in {"", "0.0.0.0", "[::]", "::", "*"} else host


async def run_forever(settings: GatewaySettings, conninfo: str, listen: str, enrol_listen: str,
                      write_ca: str | None = None) -> None:
    gateway = await start_gateway(settings, conninfo, listen=listen, enrol_listen=enrol_listen)
    if write_ca:
        pathlib.Path(write_ca).write_bytes(gateway.ca.pem)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"gateway listening on {_host(listen)}:{gateway.port} (sessions, mutual TLS);"
          f" enrol on {_host(enrol_listen)}:{gateway.enrol_port} (TLS)", flush=True)
    if gateway.metrics_server is not None:
        print(f"metrics on {_host(settings.metrics_listen)}:{gateway.metrics_server.port}", flush=True)
    await stop.wait()
    await gateway.stop()
