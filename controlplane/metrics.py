"""Prometheus metrics of the control plane and the gateway, served over HTTP at /metrics.

Each process (each App or Gateway, so several in one test process never collide) has its own
CollectorRegistry, never the library's global one. Counters and histograms move where the events
happen: the API interceptor (every RPC), the placer (plan and commit), the report judge, the
webhook worker. What lives in the database (reservations by state, the work queue) is read at
scrape time by one cheap query each, at most once per Settings.metrics_refresh_seconds however
often anyone scrapes: between refreshes a scrape gets the last values.

The endpoint is plain HTTP/1.0 on the process's event loop (no thread): GET /metrics, nothing else.
The README's "Metrics" section lists every metric.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from controlplane import db

log = structlog.get_logger(__name__)

# RPCs and placements: from a millisecond to a minute (Watch streams count their whole life).
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STATES = ("draft", "awaiting-confirmation", "pending", "queued", "placed", "binding", "active", "denied",
           "released", "failed", "cancelled", "expired")
_RESERVATIONS = "SELECT state, count(*) AS n FROM reservations GROUP BY state"
# Due: live items whose run_at has come (oldest by run_at); dead: given up (oldest by dead_at).
_WORK = """
SELECT count(w.id) FILTER (WHERE w.dead_at IS NULL AND w.run_at <= t.now) AS due,
       count(w.id) FILTER (WHERE w.dead_at IS NULL AND w.run_at > t.now) AS scheduled,
       count(w.id) FILTER (WHERE w.dead_at IS NOT NULL) AS dead,
       extract(epoch FROM t.now - min(w.run_at) FILTER (WHERE w.dead_at IS NULL AND w.run_at <= t.now)) AS due_age,
       extract(epoch FROM t.now - min(w.dead_at)) AS dead_age
FROM (SELECT compute_now() AS now) t
LEFT JOIN work_items w ON true
GROUP BY t.now
"""


def reason_class(reason: str) -> str:
    """A label value for a rejection reason (attest's fixed texts): lower case words joined by '-'."""
    return re.sub(r"[^a-z]+", "-", reason.lower()).strip("-")[:40] or "other"


class RpcMetrics:
    """What both the control plane and the gateway count: RPCs by method and code, and their latency."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = Counter("bc_rpcs", "RPCs served, by full method name and result code (OK or the"
                            " domain error code)", ["method", "code"], registry=self.registry)
        self.rpc_seconds = Histogram("bc_rpc_duration_seconds", "Time to serve an RPC, by method and code",
                                     ["method", "code"], buckets=_BUCKETS, registry=self.registry)

    def rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpcs.labels(method, code).inc()
        self.rpc_seconds.labels(method, code).observe(seconds)

    async def refresh(self) -> None:
        """Bring the values read from elsewhere up to date before a scrape."""


class Metrics(RpcMetrics):
    """The control plane's metrics."""

    def __init__(self, pool: Any = None, refresh_seconds: float = 5.0) -> None:
        super().__init__()
        self.placement_seconds = Histogram(
            "bc_placement_duration_seconds", "From the placer's plan to its commit (locks and lost races"
            " included), by outcome: placed or nofit", ["outcome"], buckets=_BUCKETS, registry=self.registry)
        self.reports = Counter("bc_reports_judged", "Node reports judged by the reservation worker: verdict"
                               " accepted or rejected, and the rejection's reason class", ["verdict", "reason"],
                               registry=self.registry)
        self.webhooks = Counter("bc_webhook_deliveries", "Webhook delivery attempts by outcome: delivered,"
                                " failed (retried later) or dead (the last attempt failed)", ["outcome"],
                                registry=self.registry)
        self.placer_statements = Counter(
            "bc_placer_batch_statements", "Statements (round trips to PostgreSQL, BEGIN and COMMIT included) the"
            " lease placer's batches sent; divided by bc_placer_batch_reservations_total: round trips per create",
            registry=self.registry)
        self.placer_reservations = Counter(
            "bc_placer_batch_reservations", "Queued reservations the lease placer's batches decided, by outcome:"
            " placed or pending", ["outcome"], registry=self.registry)
        self.work_queries = Counter(
            "bc_work_queue_queries", "Queries the work queue runner sent, by query: claim (take a due item) and"
            " next_due (read when the next item is due); an item due later costs none until it is due",
            ["query"], registry=self.registry)
        self.drafts = Counter(
            "bc_create_drafts", "New drafts Reservations.Create wrote, by how: ahead (checked against the pool as"
            " the tenant saw it before and inserted with the facts read: one round trip) or after_read (checked"
            " against the facts read, then inserted)", ["how"], registry=self.registry)
        self._pool = pool
        self._refresh_seconds = refresh_seconds
        self._refreshed = float("-inf")
        self._lock = asyncio.Lock()
        self._snapshot: dict[str, Any] = {}
        self.registry.register(_Snapshot(self))

    def placement(self, started: float, placed: bool) -> None:
        self.placement_seconds.labels("placed" if placed else "nofit").observe(time.perf_counter() - started)

    def placer_batch(self, statements: int, placed: int, pending: int) -> None:
        self.placer_statements.inc(statements)
        self.placer_reservations.labels("placed").inc(placed)
        self.placer_reservations.labels("pending").inc(pending)

    def draft_written(self, ahead: bool) -> None:
        self.drafts.labels("ahead" if ahead else "after_read").inc()

    def report_judged(self, ok: bool, reason: str) -> None:
        self.reports.labels(*(("accepted", "") if ok else ("rejected", reason_class(reason)))).inc()

    def webhook(self, outcome: str) -> None:
        self.webhooks.labels(outcome).inc()

    async def refresh(self) -> None:
        if self._pool is None:
            return
        async with self._lock:  # concurrent scrapes share one refresh
            if time.monotonic() - self._refreshed < self._refresh_seconds:
                return
            try:
                async with db.read_only(self._pool) as conn:
                    await conn.execute("SET LOCAL statement_timeout = 5000")  # a scrape never waits long
                    states = {r["state"]: r["n"] for r in await (await conn.execute(_RESERVATIONS)).fetchall()}
                    work = await (await conn.execute(_WORK)).fetchone()
            except Exception:
                log.exception("metrics refresh failed; serving the last values")
                return
            self._snapshot = {"states": states, "work": work}
            self._refreshed = time.monotonic()


class _Snapshot:
    """The values read from the database at the last refresh, as gauges."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        snapshot = self.metrics._snapshot
        if not snapshot:
            return
        states = GaugeMetricFamily("bc_reservations", "Reservations by state (every state, zero included)",
                                   labels=["state"])
        for state in dict.fromkeys((*_STATES, *snapshot["states"])):  # a state added later shows too
            states.add_metric([state], snapshot["states"].get(state, 0))
        yield states
        work = snapshot["work"]
        depth = GaugeMetricFamily("bc_work_queue_items", "Work queue items: due (run_at has come),"
                                  " scheduled (later) and dead (given up after the last attempt)", labels=["state"])
        age = GaugeMetricFamily("bc_work_queue_oldest_age_seconds", "Age of the oldest due item (since its run_at)"
                                " and of the oldest dead one (since it died); 0 when there is none",
                                labels=["state"])
        for state in ("due", "scheduled", "dead"):
            depth.add_metric([state], work[state])
        for state in ("due", "dead"):
            age.add_metric([state], float(work[f"{state}_age"] or 0))
        yield depth
        yield age


class GatewayMetrics(RpcMetrics):
    """The gateway's metrics: its RPCs and the nodes whose sessions this process holds."""

    def __init__(self, connected: Callable[[], int]) -> None:
        super().__init__()
        Gauge("bc_gateway_connected_nodes", "Nodes with a session held by this gateway process",
              registry=self.registry).set_function(connected)


class MetricsServer:
    """GET /metrics on `listen` (host:port; port 0 picks a free one, see `port`)."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        self.server = await asyncio.start_server(self._handle, host.strip("[]") or "127.0.0.1", int(port))
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("metrics serving", host=host, port=self.port)
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            parts = head.split(b"\r\n", 1)[0].split(b" ")
            if len(parts) == 3 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                await self.metrics.refresh()
                await _answer(writer, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
            else:
                await _answer(writer, 404, b"not found: GET /metrics\n", "text/plain")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str) -> None:
    reason = {200: "OK", 404: "Not Found"}[status]
    writer.write(f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()


async def serve(metrics: RpcMetrics, listen: str) -> MetricsServer | None:
    """The metrics endpoint on `listen`, or None when `listen` is empty (metrics off)."""
    if not listen:
        return None
    server = MetricsServer(metrics)
    await server.start(listen)
    return server


