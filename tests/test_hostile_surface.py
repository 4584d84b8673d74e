"""A hostile caller against the surfaces around the API: the `better-compute` CLI and its connection
file, and the MCP server an agent drives. Whatever it is given, the CLI exits 0, 1 (a failed call,
the spec's error on stderr) or 2 (usage), never with a traceback; every MCP tool failure is the
spec's code and message as JSON, never a crash of the tool."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 60
# Nothing listens there: a command refused before any call never gets that far.
DEAD = ["--endpoint", "127.0.0.1:1", "--token", "t", "--tenant", "tenant1", "--pool",
        "pool_06h31j4ff8bcsn30075tfxe24g"]


def cli(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, BC_DATA_DIR=str(tmp_path / "no-dev"), PYTHONUNBUFFERED="1")
    env.pop("DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def assert_usage_error(done: subprocess.CompletedProcess[str], mentions: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and mentions in done.stderr, done.stderr
    assert not done.stdout, done.stdout


# The connection file ------------------------------------------------------------------------------

CONNECTION_FILES: dict[str, Any] = {
    "a JSON list": "[]",
    "a JSON string": '"127.0.0.1:50051"',
    "a number for the endpoint": json.dumps({"endpoint": 50051, "token": "t", "tenantId": "tenant1"}),
    "a list for the token": json.dumps({"endpoint": "127.0.0.1:1", "token": ["t"], "tenantId": "tenant1"}),
    "an object for the tenant": json.dumps({"endpoint": "127.0.0.1:1", "token": "t", "tenantId": {"id": "x"}}),
}


@pytest.mark.parametrize("content", CONNECTION_FILES.values(), ids=CONNECTION_FILES.keys())
@pytest.mark.parametrize("command", [["get", "rsv_x"], ["mcp"]], ids=["cli", "mcp"])
def test_a_connection_file_that_is_no_object_of_strings_is_a_usage_error(
    tmp_path: pathlib.Path, content: str, command: list[str]
) -> None:
    path = tmp_path / "connection.json"
    path.write_text(content)
    assert_usage_error(cli(tmp_path, *command, "--connection", str(path)), "connection file")


@pytest.mark.parametrize("command", [["get", "rsv_x"], ["mcp"]], ids=["cli", "mcp"])
def test_a_connection_path_that_is_a_directory_is_a_usage_error(tmp_path: pathlib.Path, command: list[str]) -> None:
    assert_usage_error(cli(tmp_path, *command, "--connection", str(tmp_path)), "connection file")


def test_an_unreadable_ca_of_the_connection_file_stops_the_mcp_server_with_a_usage_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "connection.json"
    path.write_text(json.dumps({"endpoint": "127.0.0.1:1", "token": "t", "tenantId": "tenant1",
                                "ca": str(tmp_path / "no-such-ca.pem")}))
    assert_usage_error(cli(tmp_path, "mcp", "--connection", str(path)), "no-such-ca.pem")
