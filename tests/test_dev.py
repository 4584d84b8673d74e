"""`better-compute dev` end to end: a real process, the embedded PostgreSQL, real gRPC clients.

It starts, seeds the demo, places a reservation, stops cleanly on Ctrl-C (the database with it),
and a second run on the same data directory reuses the pool, the tokens and the nodes'
certificates and keeps the reservation; a revoked token is minted anew on the next run. The client
CLI is exercised as a real process against a running `dev`.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import psutil
import pytest

from bench.stack import free_port
from bettercompute.v1 import admin_pb2, admin_pb2_grpc, providers_pb2, providers_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import reservations_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
CLI_TIMEOUT_S = 60
LIVE_STATES = {"placed", "binding", "active"}


@dataclass
class Dev:
    process: subprocess.Popen[bytes]
    data_dir: pathlib.Path
    log_path: pathlib.Path
    connection: dict[str, str]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def postmaster_pid(self) -> int:
        return int((self.data_dir / "pgdata" / "postmaster.pid").read_text().split()[0])

    def stop(self) -> int:
        """Ctrl-C, then the exit code; fails (after killing it) if it does not exit in time."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"dev did not exit within {STOP_TIMEOUT_S}s of SIGINT\n{self.log()}")

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.connection["endpoint"])


@contextmanager
def scratch_dir() -> Iterator[pathlib.Path]:
    """A temp dir of our own, not pytest's numbered ones: a concurrent pytest session resets
    their parent to mode 0700, and the embedded PostgreSQL runs as another user."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="bc-test-dev-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _dev_env(data_dir: pathlib.Path, provider_listen: str = "") -> dict[str, str]:
    env = dict(os.environ, BC_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    env.pop("DATABASE_URL", None)
    env.pop("BC_LISTEN", None)
    env.pop("BC_PROVIDERSIM_LISTEN", None)
    if provider_listen:
        env["BC_PROVIDERSIM_LISTEN"] = provider_listen
    return env


@contextmanager
def running_dev(data_dir: pathlib.Path, run: str, provider_listen: str = "") -> Iterator[Dev]:
    """`python -m controlplane.cli dev --listen 127.0.0.1:0` until connection.json appears (the
    simulated provider on `provider_listen` when given, as `make dev` keeps it on one port).

    On the way out the process is stopped (SIGINT, then kill) unless the test already did.
    """
    log_path = data_dir.parent / f"dev-{data_dir.name}-{run}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "dev", "--listen", "127.0.0.1:0"],
            cwd=REPO,
            env=_dev_env(data_dir, provider_listen),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    dev = Dev(process, data_dir, log_path, {})
    try:
        dev.connection = _wait_for_connection(dev)
        yield dev
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_for_connection(dev: Dev) -> dict[str, str]:
    path = dev.data_dir / "connection.json"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if dev.process.poll() is not None:
            pytest.fail(f"dev exited ({dev.process.returncode}) before it was ready\n{dev.log()}")
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.1)
    pytest.fail(f"no {path} within {START_TIMEOUT_S}s\n{dev.log()}")


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def scratch() -> Iterator[pathlib.Path]:
    with scratch_dir() as path:
        yield path


def test_dev_places_a_reservation_stops_cleanly_and_reuses_its_data(scratch: pathlib.Path) -> None:
    data_dir = scratch / "dev"
    # One provider port for every run, as `make dev` has: the later runs find the demo's provider
    # account stored and the control plane scans it as it starts (they failed while the provider
    # was started after the control plane).
    provider = f"127.0.0.1:{free_port()}"
    # Starting in an hour: the reservation stays placed (it reaches binding only at its start).
    start_ms = int((time.time() + 3600) * 1000)
    with running_dev(data_dir, "first", provider) as dev:
        conn = dev.connection
        assert set(conn) >= {"endpoint", "token", "rootToken", "tenantId", "poolId", "gatewayEndpoint", "sandbox"}
        assert conn["tenantId"] == "acme" and conn["poolId"].startswith("pool_")
        with dev.channel() as channel:
            reservations = reservations_pb2_grpc.ReservationsStub(channel)
            created = reservations.Create(
                pb.CreateReservationRequest(
                    tenant_id=conn["tenantId"],
                    pool_id=conn["poolId"],
                    devices=[pb.DeviceRequest(device_class="gpu", count=4, topology="nvlink-all")],
                    duration="8h",
                    start=start_ms,
                    idempotency_key="test-dev-first",
                    wait=pb.Wait(timeout_ms=10_000),
                ),
                metadata=_auth(conn["token"]),
                timeout=30,
            )
            nodes = admin_pb2_grpc.AdminStub(channel).ListNodes(
                admin_pb2.ListNodesRequest(pool_id=conn["poolId"]),
                metadata=_auth(conn["rootToken"]),
                timeout=30,
            )
            # providersim runs too: its demo reservation is recorded and bound to the demo pool.
            provided = providers_pb2_grpc.ProviderAccountsStub(channel).ListReservations(
                providers_pb2.GetProviderAccountRequest(tenant_id="root", account_id=conn["providerAccountId"]),
                metadata=_auth(conn["rootToken"]), timeout=30)
        assert [(r.reservation_id, r.state, r.total, r.pool_id) for r in provided.items] == [
            ("demo-vm-reservation", "ready", 8, conn["poolId"])]
        assert created.state == "placed", created
        assert [len(a.device_ids) for a in created.allocations] == [4]
        assert sorted(n.name for n in nodes.items) == [f"sim-{i:03d}" for i in range(8)]
        # Enrolled nodesim nodes, as their Hello reported them.
        assert all(n.gpu_count == 8 and n.connectivity == "connected" for n in nodes.items)
        assert all(n.labels["fabric.domain"] for n in nodes.items)
        # Two NVLink fabrics of four nodes each, so a gang can be tried (README "Gangs").
        fabrics: dict[str, list[str]] = {}
        for n in sorted(nodes.items, key=lambda n: n.name):
            fabrics.setdefault(n.labels["fabric.domain"], []).append(n.name)
        assert sorted(fabrics.values()) == [[f"sim-{i:03d}" for i in range(4)], [f"sim-{i:03d}" for i in range(4, 8)]]
        assert all(n.labels["bc.dev/cap.devices.limits"] for n in nodes.items)

        postmaster = dev.postmaster_pid()
        assert _alive(postmaster)
        assert dev.stop() == 0, dev.log()
        assert not _alive(postmaster), "the embedded PostgreSQL outlived dev"
        assert not (data_dir / "pgdata" / "postmaster.pid").exists()
        assert not (data_dir / "connection.json").exists(), "a stale connection file was left"

    # Every node enrolled with a join token; the token files were private from the start.
    assert [bool(t["joinToken"]) for t in _join_tokens(data_dir)] == [True] * 8
    for name in ("tokens.json", "join-tokens.json"):
        assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600, name

    with running_dev(data_dir, "second", provider) as again:
        assert again.connection["poolId"] == conn["poolId"]
        assert again.connection["providerAccountId"] == conn["providerAccountId"], "the provider account was made anew"
        # The tokens are reused, not minted anew; nodes with a certificate get no join token.
        assert (again.connection["token"], again.connection["rootToken"]) == (conn["token"], conn["rootToken"])
        assert [t["joinToken"] for t in _join_tokens(data_dir)] == [""] * 8
        with again.channel() as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            live = {ident: admin.ListTokens(admin_pb2.ListTokensRequest(identity_id=ident),
                                            metadata=_auth(conn["rootToken"]), timeout=30).items
                    for ident in ("root", "alice")}
            assert {ident: len(items) for ident, items in live.items()} == {"root": 1, "alice": 1}
        with again.channel() as channel:
            kept = reservations_pb2_grpc.ReservationsStub(channel).Get(
                pb.GetReservationRequest(tenant_id="acme", reservation_id=created.id),
                metadata=_auth(again.connection["token"]),
                timeout=30,
            )
            nodes = admin_pb2_grpc.AdminStub(channel).ListNodes(
                admin_pb2.ListNodesRequest(pool_id=conn["poolId"]),
                metadata=_auth(again.connection["rootToken"]),
                timeout=30,
            )
        assert kept.id == created.id and kept.state == "placed", kept
        assert len(nodes.items) == 8, "the fleet was registered twice"
        assert all(n.connectivity == "connected" for n in nodes.items)
        # Revoked (by prefix, without the secret): the next run mints alice a new one.
        with again.channel() as channel:
            admin_pb2_grpc.AdminStub(channel).RevokeTokens(admin_pb2.RevokeTokensRequest(prefix=conn["token"][:12]),
                                                           metadata=_auth(conn["rootToken"]), timeout=30)
        assert again.stop() == 0, again.log()

    with running_dev(data_dir, "third", provider) as third:
        assert third.connection["rootToken"] == conn["rootToken"]
        assert third.connection["token"] != conn["token"]
        with third.channel() as channel:
            mine = reservations_pb2_grpc.ReservationsStub(channel).Get(
                pb.GetReservationRequest(tenant_id="acme", reservation_id=created.id),
                metadata=_auth(third.connection["token"]), timeout=30)
        assert mine.id == created.id
        assert stat.S_IMODE((data_dir / "tokens.json").stat().st_mode) == 0o600
        assert third.stop() == 0, third.log()


def _join_tokens(data_dir: pathlib.Path) -> list[dict[str, str]]:
    return json.loads((data_dir / "join-tokens.json").read_text())


# The client CLI against one running dev ---------------------------------------------------------


@pytest.fixture(scope="module")
def dev() -> Iterator[Dev]:
    with scratch_dir() as scratch, running_dev(scratch / "dev", "cli") as running:
        yield running


def cli(dev: Dev, *args: str) -> tuple[int, Any, str]:
    """Run `better-compute ARGS` as a process; the exit code, the JSON answer and stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "controlplane.cli", *args],
        cwd=REPO,
        env=_dev_env(dev.data_dir),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    answer = json.loads(done.stdout) if done.returncode == 0 else None
    return done.returncode, answer, done.stderr


def test_cli_reserve_get_list_release(dev: Dev) -> None:
    code, placed, err = cli(dev, "reserve", "--gpus", "4", "--topology", "nvlink-all")
    assert code == 0, err
    assert placed["state"] in LIVE_STATES and placed["id"].startswith("rsv_")
    assert placed["tenantId"] == "acme" and placed["poolId"] == dev.connection["poolId"]
    assert placed["idempotencyKey"].startswith("cli-")  # generated when --key is absent
    assert placed["request"]["duration"] == "3600000ms"  # --for defaults to 1h
    assert placed["request"]["devices"] == [
        {"class": "gpu", "count": 4, "topology": "nvlink-all", "model": "H100-SXM5-80GB", "profile": ""}]

    code, got, err = cli(dev, "get", placed["id"])
    assert code == 0, err
    assert got["id"] == placed["id"] and got["state"] in LIVE_STATES

    code, listed, err = cli(dev, "list", "--connection", str(dev.data_dir / "connection.json"))
    assert code == 0, err
    assert placed["id"] in [item["id"] for item in listed["items"]]

    # The hold reaches the node: active, with the CDI spec on disk in the nodesim sandbox.
    deadline = time.monotonic() + 30
    while got["state"] != "active" and time.monotonic() < deadline:
        time.sleep(0.2)
        code, got, err = cli(dev, "get", placed["id"])
    assert got["state"] == "active", got
    alloc = got["allocations"][-1]
    assert got["binding"]["envFile"] == f"/run/bcd/allocations/{alloc['id']}.env" and got["binding"]["attested"]
    specs = list(pathlib.Path(dev.connection["sandbox"]).glob(f"*/etc/cdi/bcd-{alloc['id']}.json"))
    assert len(specs) == 1, specs

    code, released, err = cli(dev, "release", placed["id"])
    assert code == 0, err
    assert released["id"] == placed["id"] and released["state"] == "released"

    live_filter = [arg for state in sorted(LIVE_STATES) for arg in ("--state", state)]
    code, live, err = cli(dev, "list", *live_filter)
    assert code == 0, err
    assert placed["id"] not in [item["id"] for item in live["items"]]


def test_cli_reserves_a_gang_of_two_8_gpu_nodes_of_one_fabric_and_it_goes_active(dev: Dev) -> None:
    code, placed, err = cli(dev, "reserve", "--gpus", "8", "--gang", "2", "--topology-key", "fabric.domain")
    assert code == 0, err
    assert placed["request"]["gang"] == {"size": 2, "topologyKey": "fabric.domain"}
    assert len(placed["allocations"]) == 2
    got = placed
    deadline = time.monotonic() + 30
    while got["state"] != "active" and time.monotonic() < deadline:
        time.sleep(0.2)
        code, got, err = cli(dev, "get", placed["id"])
    assert got["state"] == "active", got
    assert [a["state"] for a in got["allocations"]] == ["bound", "bound"]
    with dev.channel() as channel:
        nodes = admin_pb2_grpc.AdminStub(channel).ListNodes(
            admin_pb2.ListNodesRequest(pool_id=dev.connection["poolId"]),
            metadata=_auth(dev.connection["rootToken"]), timeout=30).items
    fabric = {n.id: n.labels["fabric.domain"] for n in nodes}
    assert len({fabric[a["nodeId"]] for a in got["allocations"]}) == 1
    code, released, err = cli(dev, "release", placed["id"])
    assert code == 0 and released["state"] == "released", err


def test_cli_reserve_with_a_key_is_idempotent_and_cancel_withdraws_it(dev: Dev) -> None:
    # An absolute start: `--start +2h` would name another window, so another request, on a retry.
    start = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(days=2)
    args = ("reserve", "--gpus", "1", "--for", "1h", "--start", start.isoformat(), "--key", "cli-1")
    code, first, err = cli(dev, *args)
    assert code == 0, err
    assert first["state"] == "placed" and first["idempotencyKey"] == "cli-1"
    assert first["during"]["start"] == int(start.timestamp() * 1000)
    code, again, err = cli(dev, *args)
    assert code == 0, err
    assert again["id"] == first["id"]

    code, cancelled, err = cli(dev, "cancel", first["id"])
    assert code == 0, err
    assert cancelled["state"] == "cancelled"


def test_cli_prints_the_spec_code_and_exits_1_on_errors(dev: Dev) -> None:
    code, _, err = cli(dev, "get", "rsv_" + "0" * 52)
    assert code == 1
    assert json.loads(err)["error"]["code"] == "NOT_FOUND"

    code, _, err = cli(dev, "reserve", "--gpus", "1", "--for", "soon")
    assert code == 2 and "--for 'soon'" in err  # not a duration: the client's usage error
    code, _, err = cli(dev, "reserve", "--gpus", "1", "--for", "0s")  # a duration the API refuses
    assert code == 1
    error = json.loads(err)["error"]
    assert error["code"] == "INVALID_INPUT" and error["details"]["field"] == "duration"

    code, _, err = cli(dev, "reserve", "--gpus", "1", "--key", "k", "--for", "1h")
    assert code == 0, err
    code, _, err = cli(dev, "reserve", "--gpus", "2", "--key", "k", "--for", "1h")
    assert code == 1
    error = json.loads(err)["error"]
    assert error["code"] == "CONFLICT" and error["details"]["reservationId"].startswith("rsv_")

    _set_gpu_quota(dev, 0)
    try:
        code, _, err = cli(dev, "reserve", "--gpus", "1", "--for", "1h")
    finally:
        _set_gpu_quota(dev, 64)
    assert code == 1
    error = json.loads(err)["error"]
    assert error["code"] == "QUOTA_EXCEEDED" and error["message"]


def test_cli_without_a_connection_says_how_to_get_one(scratch: pathlib.Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "controlplane.cli", "list"],
        cwd=REPO,
        env=_dev_env(scratch),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert done.returncode == 2
    assert "make dev" in done.stderr and "--endpoint" in done.stderr


def _set_gpu_quota(dev: Dev, limit: int) -> None:
    with dev.channel() as channel:
        admin_pb2_grpc.AdminStub(channel).SetQuota(
            admin_pb2.SetQuotaRequest(tenant_id="acme", resource="gpu", limit=limit),
            metadata=_auth(dev.connection["rootToken"]),
            timeout=30,
        )
