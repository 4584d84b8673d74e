"""README.md's examples, driven as a new user would: `better-compute` as a real process against a
real control plane. Each test pins a promise of the README that the walkthrough found broken."""

from __future__ import annotations

import datetime
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from k8s.deviceplugin.v1beta1 import api_pb2 as dp
from nodesim.deviceplugin import PLUGIN_DIR
from tests.support import World, make_world
from tests.test_cli import ANSI, _env, cli, connection_flags, on_a_terminal  # noqa: F401  (cli: fixture)
from tests.test_dev import cli as dev_cli
from tests.test_dev import REPO, START_TIMEOUT_S, STOP_TIMEOUT_S, _alive, _dev_env, running_dev, scratch_dir
from tests.test_e2e import Fleet, Stack, stack  # noqa: F401  (stack: fixture)
from tests.test_kubernetes_binding import Kubelet, kubernetes_world, registrations


@pytest.fixture
def world(stack: Stack) -> Iterator[World]:  # noqa: F811
    """A tenant with a pool of two 8-GPU nodes (registered, no daemon) on the real processes."""
    w = make_world(stack.endpoint, stack.root, stack.conninfo, nodes=2)
    yield w
    w.close()


@pytest.fixture
def kube_world(stack: Stack) -> Iterator[World]:  # noqa: F811
    """A tenant whose own pool has policy.kubernetes and no nodes until a fleet joins it."""
    w = kubernetes_world(stack)
    yield w
    w.close()


@pytest.fixture
def relative_fleet(stack: Stack, kube_world: World, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:  # noqa: F811
    """One nodesim node whose --sandbox is a path relative to the working directory and below it,
    as make dev's `.dev/sandbox` (nodesim inherits the working directory)."""
    fleet = Fleet(stack, kube_world, 1)
    monkeypatch.chdir(fleet.sandbox.parent)
    fleet.sandbox = pathlib.Path(fleet.sandbox.name)
    try:
        fleet.start("--kubelet-retry", "0.2")
        yield fleet
    finally:
        fleet.stop()


def test_list_on_an_80_column_terminal_keeps_state_gpus_and_window(cli, world: World,  # noqa: F811
                                                                   tmp_path: pathlib.Path) -> None:
    """README, "The CLI": on a terminal `list` is the table ID STATE GPUS START DURATION POOL, the
    ids cut short (`rsv_3rg7wvdm434v…`). On a terminal of the usual 80 columns the full ids left no
    room: rich squeezed STATE, GPUS and DURATION to an ellipsis or dropped them."""
    start = (datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(hours=30)).isoformat()
    placed = cli("reserve", "--gpus", "4", "--for", "8h", "--start", start).json

    env = dict(_env(tmp_path), TERM="xterm-256color", COLUMNS="80", TZ="UTC")
    code, screen, err = on_a_terminal([*connection_flags(world), "list"], env, columns=80)
    assert code == 0, err
    lines = [line for line in ANSI.sub("", screen.decode(errors="replace")).splitlines() if line.strip()]
    assert all(len(line) <= 80 for line in lines), lines
    header, *rows = [line.split() for line in lines]
    assert header == ["ID", "STATE", "GPUS", "START", "DURATION", "POOL"]
    (row,) = rows
    shown_id, *middle, shown_pool = row
    assert middle == ["placed", "4", *start[:16].split("T"), "UTC", "8h"]
    assert shown_id.endswith("…") and placed["id"].startswith(shown_id.removesuffix("…"))
    assert world.pool_id.startswith(shown_pool.removesuffix("…"))


def test_a_node_whose_sandbox_is_a_relative_path_serves_its_device_plugins(relative_fleet: Fleet) -> None:
    """README, "Kubernetes workers": each simulated node serves the kubelet device plugin API in
    `<sandbox>/<node>/var/lib/kubelet/device-plugins/` and registers with the kubelet there. make
    dev runs nodesim with `--sandbox .dev/sandbox`, a relative path, and the plugin's socket address
    `unix://.dev/sandbox/...` is read by gRPC as the absolute `//.dev/sandbox/...`: binding it
    failed, so no plugin ever registered."""
    fleet = relative_fleet
    assert not fleet.sandbox.is_absolute()
    kubelet = Kubelet(fleet.sandbox.absolute() / fleet.names[0] / PLUGIN_DIR)
    channel = path = None
    try:
        registered = registrations(kubelet)["bcd.dev/gpu"]
        channel, stub, path = kubelet.plugin(registered.endpoint)
        assert stub.GetDevicePluginOptions(dp.Empty(), timeout=10).get_preferred_allocation_available
    finally:
        if channel is not None:
            channel.close()
        if path is not None:
            path.close()
        kubelet.stop()


def test_dev_runs_again_after_a_node_was_revoked_and_readmitted() -> None:
    """README: `nodes revoke` (a revoked node cannot enrol again until readmitted), `nodes readmit`,
    and "Run it again and it reuses .dev: the pool, the nodes' certificates and the reservations
    are kept". dev gave join tokens only to nodes without a valid certificate file, so a readmitted
    node kept its revoked certificate, had no token, never connected, and the second run gave up
    ("only 7 of 8 nodes connected"). It now re-provisions such a node a token (its
    `<sandbox>/<node>/join-token`), and the node enrols with new certificates."""
    with scratch_dir() as scratch:
        data_dir = scratch / "dev"
        node_id_file = data_dir / "sandbox" / "sim-007" / "var" / "lib" / "bcd" / "node-id"
        with running_dev(data_dir, "first") as dev:
            node_id = node_id_file.read_text().strip()
            code, revoked, err = dev_cli(dev, "nodes", "revoke", node_id, "--reason", "walkthrough")
            assert code == 0 and revoked["serials"], err
            code, readmitted, err = dev_cli(dev, "nodes", "readmit", node_id)
            assert code == 0 and readmitted["readmitted"], err
            assert dev.stop() == 0, dev.log()

        with running_dev(data_dir, "second") as dev:  # ready: every node connected
            assert "join tokens re-provisioned to revoked nodes" in dev.log()
            code, certificates, err = dev_cli(dev, "nodes", "certificates", node_id)
            assert code == 0, err
            live = [c for c in certificates["items"] if not c.get("revoked")]
            assert sorted(c["usage"] for c in live) == ["signing", "tls"]
            assert node_id_file.read_text().strip() == node_id
            assert dev.stop() == 0, dev.log()


def test_ctrl_c_while_dev_waits_for_its_fleet_stops_it_at_once() -> None:
    """README: dev "runs until Ctrl-C (or SIGTERM), which stops the fleet, the gateway, the control
    plane and the database". While it waited for its nodes to connect (up to 90 s), Ctrl-C was
    noted and ignored until the wait ended. On a new data directory the nodes have no certificates
    yet and enrol first (dev no longer waits for a revoked node, which never connects); Ctrl-C
    during that wait now stops it, every process with it."""
    with scratch_dir() as scratch:
        data_dir = scratch / "dev"
        data_dir.mkdir()
        log_path = scratch / "dev-waiting.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "dev", "--listen", "127.0.0.1:0"],
                                       cwd=REPO, env=_dev_env(data_dir), stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while "nodesim running" not in log_path.read_text(errors="replace"):  # now it waits for them
                assert process.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
                time.sleep(0.1)
            postmaster = int((data_dir / "pgdata" / "postmaster.pid").read_text().split()[0])
            process.send_signal(signal.SIGINT)
            try:
                code = process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail("dev did not stop on Ctrl-C while it waited for its fleet\n"
                            + log_path.read_text(errors="replace"))
            text = log_path.read_text(errors="replace")
            assert code == 130, text
            assert "dev interrupted during start-up" in text and "fleet connected" not in text
            assert not _alive(postmaster), "the embedded PostgreSQL outlived dev"
            assert not (data_dir / "connection.json").exists()
        finally:
            if process.poll() is None:  # let it stop its own processes, however late
                process.send_signal(signal.SIGINT)
                process.wait(timeout=180)


def test_a_reader_that_goes_away_ends_the_cli_quietly(world: World, tmp_path: pathlib.Path) -> None:
    """`better-compute list --json | head`: when standard output's reader is gone the CLI stops as a
    tool killed by SIGPIPE does (exit 141), with no BrokenPipeError traceback on standard error."""
    for _ in range(3):
        world.create(count=1, start=world.later())
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the CLI writes anything
    try:
        done = subprocess.run([sys.executable, "-m", "controlplane.cli", *connection_flags(world), "list", "--json"],
                              cwd=REPO, env=_env(tmp_path), stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)
