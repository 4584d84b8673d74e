"""The Prometheus endpoints, scraped over HTTP from a real control plane and a real gateway after
real traffic: RPCs (one an error), a placement, node reports judged, the work queue, connected
nodes and webhook deliveries. Each server has its own registry, so the values are this test's."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bettercompute.node.v1 import node_pb2 as npb
from controlplane.webhooks import delivery
from gateway.config import GatewaySettings
from tests.conftest import module_stack
from tests.nodes_support import ControlPlane
from tests.support import ServerThread, make_world
from tests.test_gateway import GatewayThread, Node, _bound_body, binding, cdi_names, connected, eventually, sql
from tests.test_webhooks import LOOPBACK, Receiver, create_hook, deliveries, reserve
from tests.test_webhooks import eventually as until

REPO = pathlib.Path(__file__).resolve().parents[1]
CREATE = "/bettercompute.v1.Reservations/Create"
GET = "/bettercompute.v1.Reservations/Get"
ENROL = "/bettercompute.node.v1.NodeGateway/Enrol"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture
def cp(database: str) -> Iterator[ControlPlane]:
    """Workers on demand (drain); the database gauges refreshed at every scrape."""
    control = ControlPlane(database, metrics_listen="127.0.0.1:0", metrics_refresh_seconds=0)
    try:
        yield control
    finally:
        control.stop()


@pytest.fixture
def gateway(database: str) -> Iterator[GatewayThread]:
    gw = GatewayThread(database, GatewaySettings(metrics_listen="127.0.0.1:0"))
    try:
        yield gw
    finally:
        gw.stop()


def test_control_plane_and_gateway_metrics_move_with_real_traffic(cp: ControlPlane, gateway: GatewayThread) -> None:
    cp_port, gw_port = cp.server.app.metrics_server.port, gateway.gateway.metrics_server.port
    assert cp_port and gw_port and cp_port != gw_port
    cp0, gw0 = scrape(cp_port), scrape(gw_port)
    assert value(gw0, "bc_gateway_connected_nodes") == 0
    assert cp0[("bc_reservations", frozenset({("state", "active")}))] == 0  # read from the database: present
    assert cp0[("bc_work_queue_items", frozenset({("state", "dead")}))] == 0

    # The gateway: an enrolment refused, one that succeeds, a session held.
    with pytest.raises(grpc.RpcError):
        Node(gateway).enrol("not-a-join-token")
    node, session = connected(gateway, cp.pool_id, "gpu-01")
    gw1 = scrape(gw_port)
    assert moved(gw0, gw1, "bc_rpcs_total", method=ENROL, code="OK") == 1
    assert moved(gw0, gw1, "bc_rpcs_total", method=ENROL, code="UNAUTHENTICATED") == 1
    assert moved(gw0, gw1, "bc_rpc_duration_seconds_count", method=ENROL, code="OK") == 1
    assert value(gw1, "bc_gateway_connected_nodes") == 1

    # The control plane: a create placed and moved to binding, and an error.
    rid, aid = binding(cp)
    with pytest.raises(grpc.RpcError):
        cp.get("rsv_" + "0" * 26)
    cp1 = scrape(cp_port)
    assert moved(cp0, cp1, "bc_rpcs_total", method=CREATE, code="OK") == 1
    assert moved(cp0, cp1, "bc_rpcs_total", method=GET, code="NOT_FOUND") == 1
    assert moved(cp0, cp1, "bc_rpc_duration_seconds_count", method=CREATE, code="OK") == 1
    assert moved(cp0, cp1, "bc_rpc_duration_seconds_sum", method=CREATE, code="OK") > 0
    assert moved(cp0, cp1, "bc_placement_duration_seconds_count", outcome="placed") == 1
    assert value(cp1, "bc_reservations", state="binding") == 1

    # A report with a bad signature, then the good one: both stored, the worker judges them.
    bad = node.report(_bound_body(node.node_id, aid))
    bad.report.signature = bytes(64)
    session.send(bad)
    good = npb.Report.FromString(_bound_body(node.node_id, aid, cdi_names(gateway.conninfo, aid)))
    good.sequence += 1
    session.send(node.report(good.SerializeToString()))
    eventually(lambda: len(sql(gateway.conninfo, "SELECT 1 FROM node_reports WHERE allocation_id = %s", (aid,))) == 2,
               what="both reports stored")
    cp2 = scrape(cp_port)
    assert value(cp2, "bc_work_queue_items", state="due") >= 1  # the reports woke the reservation
    assert value(cp2, "bc_work_queue_oldest_age_seconds", state="due") >= 0
    cp.drain()
    cp3 = scrape(cp_port)
    assert cp.get(rid).state == "active"
    assert moved(cp2, cp3, "bc_reports_judged_total", verdict="accepted", reason="") == 1
    assert moved(cp2, cp3, "bc_reports_judged_total", verdict="rejected", reason="bad-signature") == 1
    assert (value(cp3, "bc_reservations", state="binding"), value(cp3, "bc_reservations", state="active")) == (0, 1)
    assert value(cp3, "bc_work_queue_items", state="due") == 0
    assert value(cp3, "bc_work_queue_oldest_age_seconds", state="due") == 0

    # A dead work item is its own series. (Killing a handler 20 times is the work queue's own
    # test; here the gauge reads the row the worker would have left.)
    sql(cp.conninfo, "INSERT INTO work_items (kind, subject, run_at, attempts, dead_at, last_error)"
                     " VALUES ('reservation', %s, compute_now(), 20, compute_now() - interval '90 seconds', 'x')",
        (rid,))
    cp4 = scrape(cp_port)
    assert value(cp4, "bc_work_queue_items", state="dead") == 1
    assert value(cp4, "bc_work_queue_oldest_age_seconds", state="dead") >= 90

    session.close()
    eventually(lambda: value(scrape(gw_port), "bc_gateway_connected_nodes") == 0, what="session released")


def test_the_endpoint_answers_only_get_metrics(cp: ControlPlane) -> None:
    port = cp.server.app.metrics_server.port
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
    assert exc.value.code == 404


def test_metrics_are_off_unless_asked_for(database: str) -> None:
    control = ControlPlane(database)
    try:
        assert control.server.app.metrics_server is None
    finally:
        control.stop()


@pytest.fixture
def hooks_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Any]]:
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=5,
                            metrics_listen="127.0.0.1:0", metrics_refresh_seconds=0)


def test_webhook_deliveries_are_counted_by_outcome(hooks_stack: tuple[ServerThread, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery, "POLICY", delivery.RetryPolicy(
        max_attempts=2, base_seconds=0.05, cap_seconds=0.1, poll_seconds=1))
    server, root = hooks_stack
    port = server.app.metrics_server.port
    world = make_world(server.endpoint, root, server.conninfo)
    flaky = Receiver(answer=lambda event, attempt: 500 if attempt == 1 else 200)
    down = Receiver(answer=lambda event, attempt: 503)
    try:
        before = scrape(port)
        good, bad = create_hook(world, flaky.url), create_hook(world, down.url)
        subject = reserve(world)
        until(lambda: any(d.state == "delivered" for d in deliveries(world, good).values()))
        until(lambda: any(d.state == "dead" for d in deliveries(world, bad).values()))
        after = scrape(port)
        assert len(flaky.of(subject)) == 2 and len(down.of(subject)) == 2
        assert moved(before, after, "bc_webhook_deliveries_total", outcome="delivered") == 1
        assert moved(before, after, "bc_webhook_deliveries_total", outcome="failed") == 2  # one per receiver
        assert moved(before, after, "bc_webhook_deliveries_total", outcome="dead") == 1
    finally:
        flaky.close()
        down.close()


@pytest.mark.parametrize("argv, env", [
    (["-m", "controlplane.cli", "serve", "--listen", "127.0.0.1:0"], {"BC_METRICS_LISTEN": "127.0.0.1:0"}),
    (["-m", "gateway", "--listen", "127.0.0.1:0", "--enrol-listen", "127.0.0.1:0", "--metrics-listen",
      "127.0.0.1:0"], {}),
], ids=["controlplane-env", "gateway-flag"])
def test_the_processes_serve_metrics_when_asked(database: str, argv: list[str], env: dict[str, str]) -> None:
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "DATABASE_URL": database, "BC_LOG_FORMAT": "json", **env})
    try:
        assert "listening on" in proc.stdout.readline()
        line = proc.stdout.readline()
        assert line.startswith("metrics on 127.0.0.1:"), line
        with urllib.request.urlopen(f"http://127.0.0.1:{int(line.rsplit(':', 1)[1])}/metrics", timeout=10) as r:
            assert b"# TYPE bc_rpcs_total counter" in r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
