"""Leftovers of the CLI and `make dev` that a user met, each pinned by a test: `better-compute` as a
real process against a real control plane (or, for pure helpers, the client's own functions)."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import usage_pb2 as upb
from controlplane.client.errors import UsageError
from controlplane.client.times import fmt_duration, parse_duration
from tests.support import World
from tests.test_cli import REPO, _iso_in, _ms, _token, cli, tty  # noqa: F401  (cli, tty: fixtures)
from tests.test_hostile_surface import DEAD, assert_usage_error
from tests.test_hostile_surface import cli as surface_cli

HOUR_MS = 3_600_000


# Compound durations ------------------------------------------------------------------------------


def test_compound_durations_are_read_as_people_type_them() -> None:
    assert parse_duration("--for", "1h30m") == 90 * 60_000
    assert parse_duration("--for", "2d12h") == 60 * HOUR_MS
    assert parse_duration("--for", "90m") == 90 * 60_000
    assert parse_duration("--for", "1h30m15s") == 5_415_000
    assert parse_duration("--for", "1w2d") == 9 * 24 * HOUR_MS
    assert parse_duration("--for", "250ms") == 250
    assert parse_duration("--for", "7200000") == 2 * HOUR_MS  # a bare number: milliseconds, as the API
    assert parse_duration("--step", "90", bare_ms=60_000) == 90 * 60_000


def test_every_duration_list_prints_is_read_back_to_the_same_length() -> None:
    """`list` shows the two largest units: whatever it prints reads back, to what it shows."""
    for ms in (1, 999, 1000, 59_999, 60_000, 5_400_000, 5_415_000, 86_399_999, 216_000_000, 3 * 86_400_000 + 1,
               400 * 86_400_000 + 7 * HOUR_MS):
        shown = fmt_duration(ms)
        read = parse_duration("--for", shown)
        assert fmt_duration(read) == shown, (ms, shown, read)


@pytest.mark.parametrize("text", ["1h1h", "30m1h", "h", "-1h", "1.5.h", "1.5h", "", " ", "1H", "1h30", "8 hours",
                                  "٨h", "1e3h", "9999999999999h", "99999999999999", "999999999999d", "+1h"])
def test_garbage_durations_are_a_usage_error_naming_the_option(text: str) -> None:
    with pytest.raises(UsageError, match="^--by "):
        parse_duration("--by", text)


def test_compound_durations_work_wherever_the_cli_takes_one(cli, tty, world: World) -> None:
    start = _iso_in(3)
    placed = cli("reserve", "--gpus", "1", "--for", "1h30m", "--start", start).json
    assert placed["during"]["end"] - placed["during"]["start"] == 90 * 60_000
    assert placed["request"]["duration"] == "5400000ms"

    listed = tty("list")
    assert listed.code == 0, listed
    [row] = [line.split() for line in listed.out.splitlines() if placed["id"][:12] in line]
    shown = row[-2]
    assert shown == "1h30m"
    again = cli("reserve", "--gpus", "1", "--for", shown, "--start", _iso_in(6)).json  # what list prints
    assert again["during"]["end"] - again["during"]["start"] == 90 * 60_000

    extended = cli("extend", placed["id"], "--by", "1h30m").json
    assert extended["reservation"]["during"]["end"] == _ms(start) + 3 * HOUR_MS
    before = int(time.time() * 1000)
    extended = cli("extend", placed["id"], "--until", "+4h30m").json
    assert extended["reservation"]["during"]["end"] >= before + 4 * HOUR_MS + 30 * 60_000

    leased = cli("reserve", "--gpus", "1", "--lease", "1m30s").json
    assert leased["request"]["leaseSeconds"] == 90

    later = cli("reserve", "--gpus", "1", "--for", "2d12h", "--start", "+1d1h").json
    assert later["during"]["end"] - later["during"]["start"] == 60 * HOUR_MS

    buckets = cli("capacity", "timeline", "--from", start, "--to", "+1d", "--step", "1h30m").json["buckets"]
    assert buckets[0]["end"] - buckets[0]["start"] == 90 * 60_000

    preview = cli("capacity", "--preview", "--gpus", "1", "--for", "1h30m", "--earliest", "--horizon", "1d12h").json
    assert preview["fits"] is True

    joined = cli("nodes", "join-token", "cli-compound", "--ttl", "1h30m", token=_token(world.root)).json
    assert joined["expiresAt"] - time.time() * 1000 > 80 * 60_000


def test_garbage_durations_exit_2_naming_the_option(cli) -> None:
    for args, flag in (
        (("reserve", "--gpus", "1", "--for", "1h1h"), "--for"),
        (("reserve", "--gpus", "1", "--for", "-1h"), "--for"),
        (("reserve", "--gpus", "1", "--for", "999999999999d"), "--for"),
        (("reserve", "--gpus", "1", "--lease", "h"), "--lease"),
        (("reserve", "--gpus", "1", "--start", "+1.5.h"), "--start"),
        (("capacity", "--preview", "--gpus", "1", "--earliest", "--horizon", "1d1d"), "--horizon"),
        (("extend", "rsv_x", "--by", "1.5.h"), "--by"),
        (("extend", "rsv_x", "--until", "+h"), "--until"),
        (("capacity", "timeline", "--step", "30m1h"), "--step"),
        (("nodes", "join-token", "n", "--ttl", "1h1h"), "--ttl"),
    ):
        run = cli(*args)
        assert run.code == 2 and flag in run.err and not run.out, (args, run)
        assert "Traceback" not in run.err, run.err


# --json as the spec shows its objects ------------------------------------------------------------

INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
         FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def spec_shaped(descriptor: Descriptor, obj: Any, path: str = "") -> None:
    """`obj` is the JSON of a `descriptor` message as the spec shows it: every field without
    presence there (at its zero value if need be), every 64-bit integer a JSON number."""
    assert isinstance(obj, dict), (path, obj)
    for field in descriptor.fields:
        where = f"{path}.{field.json_name}"
        if field.json_name not in obj:
            assert field.has_presence, f"{where} is missing"
            continue
        value = obj[field.json_name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            assert isinstance(value, dict), where
        elif field.is_repeated:
            assert isinstance(value, list), where
            for i, item in enumerate(value):
                _check_value(field, item, f"{where}[{i}]")
        else:
            _check_value(field, value, where)


def _check_value(field: FieldDescriptor, value: Any, where: str) -> None:
    if field.message_type is not None:
        if field.message_type.full_name != "google.protobuf.Struct":
            spec_shaped(field.message_type, value, where)
    elif field.type in INT64:
        assert isinstance(value, int) and not isinstance(value, bool), f"{where} is {value!r}, not a number"


def test_json_has_numbers_and_zero_values_as_the_spec_shows_for_every_command(cli, world: World) -> None:
    root = _token(world.root)
    start = _iso_in(2)
    placed = cli("reserve", "--gpus", "2", "--for", "1h", "--start", start).json
    spec_shaped(pb.Reservation.DESCRIPTOR, placed)
    assert placed["during"] == {"start": _ms(start), "end": _ms(start) + HOUR_MS}  # numbers, as the spec's
    assert isinstance(placed["version"], int) and placed["conditions"] == []

    spec_shaped(pb.Reservation.DESCRIPTOR, cli("get", placed["id"]).json)
    spec_shaped(pb.ListReservationsResponse.DESCRIPTOR, cli("list").json)
    assert cli("list", "--state", "active").json == {"items": [], "nextCursor": ""}
    refused = cli("extend", placed["id"], "--until", str(_ms(start))).json  # it already reaches that time
    spec_shaped(pb.ExtendReservationResponse.DESCRIPTOR, refused)
    assert refused["extended"] is False
    timeline = cli("capacity", "timeline", "--from", start, "--to", "+1d").json
    spec_shaped(cpb.TimelineResponse.DESCRIPTOR, timeline)
    assert {"start": timeline["buckets"][-1]["start"], "end": timeline["buckets"][-1]["end"], "booked": 0,
            "free": 16} == timeline["buckets"][-1]  # booked: 0, as the spec's timeline shows it
    spec_shaped(cpb.RollupResponse.DESCRIPTOR, cli("capacity").json)
    spec_shaped(cpb.PreviewResponse.DESCRIPTOR, cli("capacity", "--preview", "--gpus", "64").json)
    spec_shaped(upb.QueryUsageResponse.DESCRIPTOR, cli("usage").json)
    [event] = [json.loads(line) for line in cli("watch", "--count", "1").out.splitlines()]
    spec_shaped(epb.Event.DESCRIPTOR, event)
    assert isinstance(event["id"], int) and isinstance(event["time"], int)
    spec_shaped(pb.Reservation.DESCRIPTOR, cli("release", placed["id"]).json)

    joined = cli("nodes", "join-token", "cli-json", token=root).json
    spec_shaped(npb.JoinToken.DESCRIPTOR, joined)
    node_id = world.nodes[0].id
    spec_shaped(npb.ListNodeCertificatesResponse.DESCRIPTOR, cli("nodes", "certificates", node_id, token=root).json)
    spec_shaped(npb.RevokeCertificatesResponse.DESCRIPTOR,
                cli("nodes", "revoke", node_id, "--reason", "json", token=root).json)
    readmitted = cli("nodes", "readmit", node_id, token=root).json
    spec_shaped(npb.ReadmitNodeResponse.DESCRIPTOR, readmitted)
    assert readmitted == {"readmitted": True}


# nodes join-token on a terminal -----------------------------------------------------------------


def test_join_token_on_a_terminal_is_readable_and_json_on_a_pipe(cli, tty, world: World) -> None:
    root = _token(world.root)
    shown = tty("nodes", "join-token", "tty-node", "--role", "node-tenant", "--ttl", "30m", token=root)
    assert shown.code == 0, shown
    assert "{" not in shown.out and '"secret"' not in shown.out  # not the raw JSON
    heading, secret, *rows = [line.split() for line in shown.out.splitlines()]
    assert heading[:2] == ["join", "token"] and "once" in " ".join(heading)
    assert len(secret) == 1 and secret[0].startswith("bcj_")  # alone on its line, to copy
    assert rows[:3] == [["node", "tty-node"], ["role", "node-tenant"], ["pool", world.pool_id]]
    label, day, clock, zone, in_, left, *_ = rows[3]
    expires = datetime.datetime.fromisoformat(f"{day}T{clock}+00:00").timestamp()
    assert (label, zone, in_) == ("expires", "UTC", "(in") and left[:3] in ("29m", "30m"), rows[3]
    assert time.time() + 28 * 60 < expires <= time.time() + 30 * 60, rows[3]  # in local time, minutes shown
    secret = secret[0]

    # The secret works: it enrols a node (shown once, as the JSON's would).
    from tests.test_pki import NodeKeys, _enrol_with
    assert _enrol_with(world.conninfo, secret, NodeKeys().csr()).node_id.startswith("node_")

    piped = cli("nodes", "join-token", "pipe-node", token=root).json  # scripts: JSON, as before
    assert piped["secret"].startswith("bcj_") and piped["nodeName"] == "pipe-node"
    forced = tty("--json", "nodes", "join-token", "json-node", token=root)
    assert json.loads(forced.out)["nodeName"] == "json-node"


def test_the_other_node_commands_on_a_terminal_are_readable(tty, world: World) -> None:
    root = _token(world.root)
    from tests.test_pki import NodeKeys, _enrol_with
    secret = json.loads(tty("--json", "nodes", "join-token", "tty-pki", token=root).out)["secret"]
    node_id = _enrol_with(world.conninfo, secret, NodeKeys().csr()).node_id

    listed = tty("nodes", "certificates", node_id, token=root)
    assert listed.code == 0 and "{" not in listed.out and "BEGIN CERTIFICATE" not in listed.out, listed
    header, *rows = [line.split() for line in listed.out.splitlines() if line.strip()]
    assert header == ["SERIAL", "USAGE", "ROLE", "NOT", "AFTER", "REVOKED"]
    assert sorted(row[1] for row in rows) == ["signing", "tls"] and all(row[-1] == "-" for row in rows)

    done = tty("nodes", "revoke", node_id, "--reason", "tty", token=root)
    assert done.code == 0 and done.out.startswith("revoked 2 certificates:"), done
    again = tty("nodes", "revoke", node_id, "--reason", "tty", token=root)
    assert again.code == 0 and again.out.startswith("nothing revoked"), again
    assert tty("nodes", "readmit", node_id, token=root).out.startswith("readmitted: ")
    assert tty("nodes", "readmit", node_id, token=root).out.startswith("not revoked: nothing changed")


# make dev and a revoked node ----------------------------------------------------------------------


def test_dev_says_which_nodes_did_not_connect_and_how_to_readmit_a_revoked_one(world: World) -> None:
    import asyncio

    import grpc

    from bettercompute.v1 import nodes_pb2_grpc
    from controlplane.devtools.dev import _wait_connected

    root = _token(world.root)
    with grpc.insecure_channel(world.endpoint) as channel:
        nodes_pb2_grpc.NodeAdminStub(channel).RevokeCertificates(
            npb.RevokeCertificatesRequest(node_id=world.nodes[1].id, reason="stolen rack"),
            metadata=(("authorization", f"Bearer {root}"),), timeout=30)
    names = [world.nodes[0].name, world.nodes[1].name, "never-there"]

    async def wait() -> bool:
        async with grpc.aio.insecure_channel(world.endpoint) as channel:
            return await _wait_connected(channel, root, world.pool_id, names, asyncio.Event(),
                                         conninfo=world.conninfo, timeout_s=0.2)

    with pytest.raises(RuntimeError) as failed:
        asyncio.run(wait())
    message = str(failed.value)
    assert message.startswith("only 0 of 3 nodes connected in 0.2 s; not connected: "), message
    assert (f"{world.nodes[1].name} ({world.nodes[1].id}) is revoked (stolen rack)" in message
            and f"`better-compute nodes readmit {world.nodes[1].id}`" in message), message
    assert f"{world.nodes[0].name} ({world.nodes[0].id}) is " in message  # not heard from: its connectivity
    assert "never-there never enrolled" in message


def test_dev_starts_without_a_revoked_node_and_it_joins_once_readmitted() -> None:
    """A node revoked and not readmitted cannot enrol: dev gave up after 90 s ("only 7 of 8 nodes
    connected"), and with it down there was no API to readmit the node with. dev now starts
    without it, says so with the command, and the node enrols once an operator readmits it."""
    import grpc

    from bettercompute.v1 import admin_pb2, admin_pb2_grpc
    from tests.test_dev import cli as dev_cli
    from tests.test_dev import running_dev, scratch_dir

    with scratch_dir() as scratch:
        data_dir = scratch / "dev"
        with running_dev(data_dir, "first") as dev:
            node_id = (data_dir / "sandbox" / "sim-007" / "var" / "lib" / "bcd" / "node-id").read_text().strip()
            code, _, err = dev_cli(dev, "nodes", "revoke", node_id, "--reason", "left the rack")
            assert code == 0, err
            assert dev.stop() == 0, dev.log()

        with running_dev(data_dir, "second") as dev:  # ready within the start timeout, not after 90 s
            log = dev.log()
            assert "node revoked: it stays out of the fleet until readmitted" in log, log
            assert f"better-compute nodes readmit {node_id}" in log
            assert f"revoked     sim-007 ({node_id}) stays out of the fleet" in log  # the banner
            code, readmitted, err = dev_cli(dev, "nodes", "readmit", node_id)
            assert code == 0 and readmitted["readmitted"] is True, err

            auth = (("authorization", f"Bearer {dev.connection['rootToken']}"),)
            deadline = time.monotonic() + 120  # nodesim retries its enrolment with a backoff of up to 30 s
            with grpc.insecure_channel(dev.connection["endpoint"]) as channel:
                admin = admin_pb2_grpc.AdminStub(channel)
                while time.monotonic() < deadline:
                    nodes = admin.ListNodes(admin_pb2.ListNodesRequest(pool_id=dev.connection["poolId"]),
                                            metadata=auth, timeout=30).items
                    if any(n.id == node_id and n.connectivity == "connected" for n in nodes):
                        break
                    time.sleep(0.5)
                else:
                    pytest.fail(f"the readmitted node did not connect\n{dev.log()}")
            assert dev.stop() == 0, dev.log()


# A careless or hostile user ------------------------------------------------------------------------


@pytest.mark.parametrize(("token", "source"), [
    ("tøken", "--token"), ("a\nb", "--token"), ("bct_ x", "--token"), ("t" * 20_000, "--token"),
], ids=["not-ascii", "newline", "space", "longer-than-grpc-carries"])
def test_a_token_no_request_can_carry_is_a_usage_error(tmp_path: pathlib.Path, token: str, source: str) -> None:
    """gRPC refused it as INTERNAL "Invalid metadata" or RESOURCE_EXHAUSTED (exit 1)."""
    flags = [arg if arg != "t" else token for arg in DEAD]
    assert_usage_error(surface_cli(tmp_path, *flags, "get", "rsv_x"), source)


def test_a_token_from_the_environment_or_a_file_that_no_request_can_carry_is_a_usage_error(
        tmp_path: pathlib.Path) -> None:
    no_token = [arg for arg in DEAD if arg not in ("--token", "t")]
    env = dict(os.environ, BC_DATA_DIR=str(tmp_path / "no-dev"), BC_TOKEN="tøken")
    env.pop("DATABASE_URL", None)
    done = subprocess.run([sys.executable, "-m", "controlplane.cli", *no_token, "get", "rsv_x"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert_usage_error(done, "$BC_TOKEN")

    huge = tmp_path / "huge-token"
    with huge.open("wb") as out:  # sparse: 2 GiB a reader would hold in memory whole
        out.truncate(2 * 1024**3)
    assert_usage_error(surface_cli(tmp_path, *no_token, "--token-file", str(huge), "get", "rsv_x"), "larger than a token")
    accented = tmp_path / "accented-token"
    accented.write_text("tøken\n")
    assert_usage_error(surface_cli(tmp_path, *no_token, "--token-file", str(accented), "get", "rsv_x"), "printable ASCII")
    conn = tmp_path / "connection.json"
    conn.write_text(json.dumps({"endpoint": "127.0.0.1:1", "token": "t\tx", "tenantId": "tenant1"}))
    assert_usage_error(surface_cli(tmp_path, "--connection", str(conn), "get", "rsv_x"), "token")


@pytest.mark.parametrize("content", [b"", b"not a certificate\n", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"],
                         ids=["empty", "text", "broken-pem"])
@pytest.mark.parametrize("command", [["get", "rsv_x"], ["mcp"]], ids=["cli", "mcp"])
def test_a_ca_file_without_a_certificate_is_a_usage_error(tmp_path: pathlib.Path, content: bytes,
                                                          command: list[str]) -> None:
    """gRPC logged "Could not load any root certificate" and the call failed UNAVAILABLE (exit 1)."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(content)
    conn = tmp_path / "connection.json"  # the MCP server takes its CA from there
    conn.write_text(json.dumps({"endpoint": "127.0.0.1:1", "token": "t", "tenantId": "tenant1", "ca": str(ca)}))
    assert_usage_error(surface_cli(tmp_path, *command, "--connection", str(conn)), "holds no PEM certificate")
    if command != ["mcp"]:
        assert_usage_error(surface_cli(tmp_path, *DEAD, "--ca", str(ca), *command), "holds no PEM certificate")


@pytest.mark.parametrize("endpoint", ["127.0.0.1:99999", "127.0.0.1:0", "[::1]:70000", "localhost:65536"])
@pytest.mark.parametrize("command", [["get", "rsv_x"], ["mcp"]], ids=["cli", "mcp"])
def test_an_endpoint_whose_port_is_no_tcp_port_is_a_usage_error(tmp_path: pathlib.Path, endpoint: str,
                                                                command: list[str]) -> None:
    """gRPC dialled 127.0.0.1:99999 as port 34463 (modulo 65536), bearer token and all."""
    flags = [endpoint if arg == "127.0.0.1:1" else arg for arg in DEAD]
    head, rest = (["mcp", *flags], []) if command == ["mcp"] else (flags, command)
    assert_usage_error(surface_cli(tmp_path, *head, *rest), "the port must be 1 to 65535")
    conn = tmp_path / "connection.json"
    conn.write_text(json.dumps({"endpoint": endpoint, "token": "t", "tenantId": "tenant1"}))
    assert_usage_error(surface_cli(tmp_path, *command, "--connection", str(conn)), "endpoint")


def test_an_agent_is_told_which_argument_the_client_refused(world: World, tmp_path: pathlib.Path) -> None:
    """The request builders the MCP tools share with the CLI read durations and times now; their
    refusal named the CLI's option (`--for`) and no field, where the API's named `duration`."""
    from tests.test_mcp import Call, run_agent

    async def script(call: Call) -> None:
        failed, booked = await call("reserve_gpus", gpus=1, duration="1h30m", waitSeconds=5)
        assert not failed and booked["reservation"]["request"]["duration"] == "5400000ms", booked
        for tool, arguments, field in (
            ("reserve_gpus", {"gpus": 1, "duration": "1h1h"}, "duration"),
            ("reserve_gpus", {"gpus": 1, "start": "+1.5.h"}, "start"),
            ("preview_capacity", {"gpus": 1, "earliest": True, "horizon": "-1d"}, "horizon"),
            ("extend_reservation", {"reservationId": booked["reservation"]["id"], "by": "h"}, "by"),
            ("extend_reservation", {"reservationId": booked["reservation"]["id"], "until": "soon"}, "until"),
        ):
            failed, answer = await call(tool, **arguments)
            assert failed and answer["code"] == "INVALID_INPUT", (tool, answer)
            assert answer["details"] == {"field": field} and answer["message"].startswith(f"{field} "), answer
            assert "--" not in answer["message"], answer

    run_agent(world, tmp_path, _token(world.user), script)


@pytest.mark.parametrize("option", ["--connection", "--token-file", "--ca", "mcp --connection"])
def test_a_file_name_longer_than_the_system_allows_is_a_usage_error(tmp_path: pathlib.Path, option: str) -> None:
    """exists() raised ENAMETOOLONG instead of answering: a traceback, exit 1."""
    name = str(tmp_path / ("p" * 5000))
    if option == "mcp --connection":
        done = surface_cli(tmp_path, "mcp", "--connection", name)
    elif option == "--token-file":
        done = surface_cli(tmp_path, *[a for a in DEAD if a not in ("--token", "t")], option, name, "get", "rsv_x")
    else:
        done = surface_cli(tmp_path, *DEAD, option, name, "get", "rsv_x")
    assert_usage_error(done, "File name too long")


def test_a_data_directory_name_longer_than_the_system_allows_is_a_usage_error(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, BC_DATA_DIR=str(tmp_path / ("d" * 5000)))
    env.pop("DATABASE_URL", None)
    done = subprocess.run([sys.executable, "-m", "controlplane.cli", "get", "rsv_x"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert_usage_error(done, "File name too long")


@pytest.mark.parametrize("moment", ["١٢٣٤٥٦٧٨٩٠١٢٣", "１２３４５６７８９０１２３"], ids=["arabic-indic", "fullwidth"])
def test_a_moment_in_digits_of_another_script_is_a_usage_error(tmp_path: pathlib.Path, moment: str) -> None:
    """int() reads them: --start ١٢٣٤٥٦٧٨٩٠١٢٣ booked a window in 2009."""
    assert_usage_error(surface_cli(tmp_path, *DEAD, "reserve", "--gpus", "1", "--start", moment), "--start")
    assert_usage_error(surface_cli(tmp_path, *DEAD, "extend", "rsv_x", "--until", moment), "--until")
    assert_usage_error(surface_cli(tmp_path, *DEAD, "usage", "--from", moment), "--from")


def test_a_bad_relative_time_is_quoted_as_typed(tmp_path: pathlib.Path) -> None:
    for typed in ("+", "++1h", "+1h1h"):
        done = surface_cli(tmp_path, *DEAD, "reserve", "--gpus", "1", "--start", typed)
        assert_usage_error(done, f"--start {typed!r}: ")


@pytest.mark.parametrize("count", ["0", "-1"])
def test_dev_with_no_simulated_nodes_is_a_usage_error(tmp_path: pathlib.Path, count: str) -> None:
    """nodesim refused --sim 0 and exited, and dev went on: "fleet connected nodes=0", no fleet."""
    env = dict(os.environ, BC_DATA_DIR=str(tmp_path / "dev"))
    env.pop("DATABASE_URL", None)
    process = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "dev", "--listen", "127.0.0.1:0",
                                "--sim", count], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # it started after all: Ctrl-C, so it stops what it started
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    assert process.returncode == 2 and "--sim must be at least 1" in err, (process.returncode, err[-2000:])
    assert not (tmp_path / "dev" / "pgdata").exists()  # refused before anything started


def test_dev_on_a_port_beyond_65535_is_a_usage_error(tmp_path: pathlib.Path) -> None:
    """gRPC bound 127.0.0.1:99999 as port 34463 and dev said it was ready there."""
    env = dict(os.environ, BC_DATA_DIR=str(tmp_path / "dev"))
    env.pop("DATABASE_URL", None)
    process = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "dev", "--listen", "127.0.0.1:99999",
                                "--sim", "1"], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # it started after all: Ctrl-C, so it stops what it started
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    assert process.returncode == 2 and "--listen 127.0.0.1:99999: the port must be" in err, err[-2000:]
