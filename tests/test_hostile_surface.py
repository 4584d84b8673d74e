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
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import Client, ServerThread, World, eventually, make_world
from tests.test_cli import connection_flags, on_a_terminal
from tests.test_mcp import Call, _token, run_agent
from tests.test_pki import Enrolled
from tests.test_reports import enrolled_node, report

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


# Numbers beyond the request's fields --------------------------------------------------------------

OUT_OF_RANGE = {
    "gpus beyond 32 bits": (["reserve", "--gpus", "99999999999", "--wait", "0"], "--gpus"),
    "gang beyond 32 bits": (["reserve", "--gpus", "1", "--gang", "99999999999", "--wait", "0"], "--gang"),
    "start beyond 64 bits": (["reserve", "--gpus", "1", "--start", "99999999999999999999", "--wait", "0"], "--start"),
    "start in the year 1, local time": (["reserve", "--gpus", "1", "--start", "0001-01-01", "--wait", "0"], "--start"),
    "wait of infinity": (["reserve", "--gpus", "1", "--wait", "inf"], "--wait"),
    "wait of not a number": (["reserve", "--gpus", "1", "--wait", "nan"], "--wait"),
    "preview gpus beyond 32 bits": (["capacity", "--preview", "--gpus", "99999999999"], "--gpus"),
    "extend until beyond 64 bits": (["extend", "rsv_x", "--until", "99999999999999999999"], "--until"),
    "timeline to beyond 64 bits": (["capacity", "timeline", "--to", "99999999999999999999"], "--to"),
    "usage from beyond 64 bits": (["usage", "--from", "99999999999999999999"], "--from"),
    "list limit beyond 32 bits": (["list", "--limit", "99999999999"], "--limit"),
    "watch after beyond 64 bits": (["watch", "--after", "99999999999999999999"], "--after"),
    "timeline step beyond 32 bits": (["capacity", "timeline", "--step", "999999999999w"], "--step"),
    "timeline step of bare minutes beyond 32 bits": (["capacity", "timeline", "--step", "99999999999"], "--step"),
    # Not sent, but -1 read as "stop after the first event".
    "watch count below 0": (["watch", "--count", "-1"], "--count"),
}


@pytest.mark.parametrize(("args", "flag"), OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_a_number_beyond_its_field_is_a_usage_error(tmp_path: pathlib.Path, args: list[str], flag: str) -> None:
    assert_usage_error(cli(tmp_path, *DEAD, *args), flag)


def test_an_agent_passing_numbers_beyond_their_fields_reads_invalid_input(world: World, tmp_path: pathlib.Path) -> None:
    async def script(call: Call) -> None:
        for tool, arguments in (
            ("reserve_gpus", {"gpus": 2**40, "waitSeconds": 0}),
            ("reserve_gpus", {"gpus": 1, "start": "99999999999999999999", "waitSeconds": 0}),
            ("reserve_gpus", {"gpus": 1, "start": "0001-01-01", "waitSeconds": 0}),
            ("preview_capacity", {"gpus": 1, "gang": 2**40}),
            ("preview_capacity", {"gpus": 2**40}),
            ("extend_reservation", {"reservationId": "rsv_x", "until": "99999999999999999999"}),
        ):
            failed, answer = await call(tool, **arguments)
            assert failed and answer["code"] == "INVALID_INPUT", (tool, arguments, answer)
        # A wait too long to count in milliseconds is still a wait: the server's cap answers.
        failed, booked = await call("reserve_gpus", gpus=1, waitSeconds=1e308)
        assert not failed and booked["status"] in ("placed", "binding", "active"), booked

    run_agent(world, tmp_path, _token(world.user), script)


# Text that is not UTF-8 ---------------------------------------------------------------------------

NOT_UTF8 = os.fsdecode(b"\xff\xfe")  # argv bytes of another encoding, as Python hands them over


@pytest.mark.parametrize("args", [
    ["get", "rsv_" + NOT_UTF8],
    ["reserve", "--gpus", "1", "--for", NOT_UTF8, "--wait", "0"],
    ["watch", "--subject", NOT_UTF8, "--count", "1"],
    ["nodes", "join-token", NOT_UTF8],
    ["--token", NOT_UTF8, "get", "rsv_x"],
    ["mcp", "--token", NOT_UTF8],
], ids=["get", "reserve", "watch", "join-token", "token", "mcp"])
def test_an_argument_that_is_not_utf8_is_a_usage_error(tmp_path: pathlib.Path, args: list[str]) -> None:
    head, rest = (["mcp", *DEAD], args[1:]) if args[0] == "mcp" else (DEAD, args)
    assert_usage_error(cli(tmp_path, *head, *rest), "not UTF-8")


@pytest.mark.parametrize("command", [["get", "rsv_x"], ["mcp"]], ids=["cli", "mcp"])
def test_a_connection_file_with_a_lone_surrogate_is_a_usage_error(tmp_path: pathlib.Path, command: list[str]) -> None:
    path = tmp_path / "connection.json"
    path.write_text('{"endpoint": "127.0.0.1:1", "token": "t", "tenantId": "\\udc80"}')
    assert_usage_error(cli(tmp_path, *command, "--connection", str(path)), "not UTF-8")


@pytest.mark.parametrize("ttl", ["0", "999ms", "0s"])
def test_a_join_token_ttl_under_a_second_is_a_usage_error_not_the_default_hour(tmp_path: pathlib.Path, ttl: str) -> None:
    # Sent as 0 seconds, it would be the server's default: a token that lives an hour.
    assert_usage_error(cli(tmp_path, *DEAD, "nodes", "join-token", "n1", "--ttl", ttl), "--ttl")


# What a terminal shows -----------------------------------------------------------------------------

# Escape sequences and rich markup a node writes into the binding a person's terminal shows: clear the
# screen, set the window title, a hyperlink to its own site (OSC 8), and markup for one.
HOSTILE_TEXT = ("/run/x.env\x1b[2J\x1b]0;owned\x07\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"
                "[link=http://evil.example/]here[/link]\x9b2J")


@pytest.fixture
def node_world(clock_stack: tuple[ServerThread, Client]) -> Iterator[World]:
    server, root = clock_stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=0)
    yield w
    w.close()


@pytest.fixture
def node(node_world: World) -> Enrolled:
    """An enrolled, connected node with eight GPUs (as tests/test_reports.py sets one up)."""
    return enrolled_node(node_world)


def raw_tty(world: World, tmp_path: pathlib.Path, *args: str) -> bytes:
    """The bytes `better-compute ARGS` writes to a pseudo-terminal, escape sequences and all."""
    env = dict(os.environ, BC_DATA_DIR=str(tmp_path / "no-dev"), TERM="xterm-256color", COLUMNS="400", TZ="UTC")
    code, screen, _ = on_a_terminal([*connection_flags(world), *args], env, columns=400)
    assert code == 0, screen
    return screen


def test_a_node_cannot_write_escape_sequences_or_markup_to_a_persons_terminal(
    node_world: World, node: Enrolled, tmp_path: pathlib.Path
) -> None:
    world = node_world
    r = world.create(count=2, duration="8h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    report(node, world, alloc, "bound", env_file=HOSTILE_TEXT)
    assert eventually(world, r.id, lambda x: x.state == "active").binding.env_file == HOSTILE_TEXT  # kept as signed

    screen = raw_tty(world, tmp_path, "get", r.id)
    assert r.id.encode() in screen and b"/run/x.env" in screen
    for sequence in (b"\x1b[2J", b"\x1b]0;", b"\x1b]8;", b"\x07", "\x9b".encode()):
        assert sequence not in screen, (sequence, screen)
    assert b"/run/x.env\\x1b[2J\\x1b]0;owned" in screen  # spelled out, so a person sees something is off
    assert b"[link=http://evil.example/]here[/link]" in screen  # markup shown as text, not obeyed


def test_an_agent_passing_arguments_of_the_wrong_type_reads_invalid_input_naming_the_field(
    world: World, tmp_path: pathlib.Path
) -> None:
    async def script(call: Call) -> None:
        for tool, arguments, field in (
            ("reserve_gpus", {"gpus": "two"}, "gpus"),
            ("reserve_gpus", {"gpus": 1.5}, "gpus"),
            ("reserve_gpus", {}, "gpus"),
            ("get_reservation", {"reservationId": 5}, "reservationId"),
            ("list_reservations", {"states": "placed"}, "states"),
            ("extend_reservation", {"reservationId": ["rsv_x"], "by": "1h"}, "reservationId"),
        ):
            failed, answer = await call(tool, **arguments)
            assert failed and answer["code"] == "INVALID_INPUT", (tool, arguments, answer)
            assert answer["details"]["field"] == field and answer["message"].startswith(field), answer

    run_agent(world, tmp_path, _token(world.user), script)
