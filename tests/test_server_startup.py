"""How the servers start: a malformed BC_* variable is refused as a usage error naming it, before
anything starts. Real processes, as `serve`, `gateway` and `dev` run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

SERVE = ["-m", "controlplane.cli", "serve", "--listen", "127.0.0.1:0"]
GATEWAY = ["-m", "gateway", "--listen", "127.0.0.1:0", "--enrol-listen", "127.0.0.1:0"]


@pytest.mark.parametrize("argv, env, named", [
    (SERVE, {"BC_PLACER_BATCH": "abc"}, "BC_PLACER_BATCH must be a whole number, not 'abc'"),
    (SERVE, {"BC_PENDING_RETRY_SECONDS": "soon"}, "BC_PENDING_RETRY_SECONDS must be a number"),
    (SERVE, {"BC_WEBHOOK_ALLOW": "10.0.0.0/33"}, "BC_WEBHOOK_ALLOW must list CIDR networks"),
    (GATEWAY, {"BC_NODE_GRACE_SECONDS": "half a minute"}, "BC_NODE_GRACE_SECONDS must be a number"),
    (GATEWAY, {"BC_NODE_CERT_HOURS": "1d"}, "BC_NODE_CERT_HOURS must be a number"),
    (GATEWAY, {"BC_NODE_MESSAGES_BURST": "lots"}, "BC_NODE_MESSAGES_BURST must be a whole number"),
    (["-m", "controlplane.cli", "dev", "--sim", "1"], {"BC_DB_POOL_SIZE": "16.5"},
     "BC_DB_POOL_SIZE must be a whole number, not '16.5'"),
], ids=["serve-int", "serve-float", "serve-networks", "gateway-float", "gateway-pki", "gateway-int", "dev"])
def test_a_malformed_variable_is_a_usage_error_naming_it(database: str, argv: list[str], env: dict[str, str],
                                                          named: str, tmp_path: pathlib.Path) -> None:
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DATABASE_URL": database, "BC_DATA_DIR": str(tmp_path), **env})
    assert done.returncode == 2, done.stderr
    assert named in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, env, named", [
    (["-m", "controlplane.cli", "serve", "--listen", "127.0.0.1:99999"], {}, "--listen 127.0.0.1:99999: the port"),
    (["-m", "controlplane.cli", "serve"], {"BC_LISTEN": "127.0.0.1:70000"}, "BC_LISTEN 127.0.0.1:70000: the port"),
    (SERVE, {"BC_METRICS_LISTEN": "127.0.0.1:65536"}, "BC_METRICS_LISTEN 127.0.0.1:65536: the port"),
    (["-m", "gateway", "--listen", "127.0.0.1:0"], {"BC_GATEWAY_ENROL_LISTEN": "[::1]:99999"},
     "BC_GATEWAY_ENROL_LISTEN [::1]:99999: the port"),
    ([*GATEWAY, "--metrics-listen", "127.0.0.1:123456"], {}, "--metrics-listen 127.0.0.1:123456: the port"),
], ids=["serve-flag", "serve-env", "serve-metrics", "gateway-enrol-env", "gateway-metrics-flag"])
def test_a_listen_port_beyond_65535_is_a_usage_error(database: str, argv: list[str], env: dict[str, str],
                                                      named: str, tmp_path: pathlib.Path) -> None:
    """gRPC binds such a port modulo 65536 (99999 serves on 34463): the server would run where
    nobody looks for it."""
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DATABASE_URL": database, "BC_DATA_DIR": str(tmp_path), **env})
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "must be 0 (a free one) to 65535" in done.stderr
    assert "Traceback" not in done.stderr

