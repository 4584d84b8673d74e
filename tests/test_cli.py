"""`better-compute` as a real process against a real control plane: JSON on a pipe, tables on a
pseudo-terminal, exit codes 0/1/2, and every command end to end (reserve, get, list, extend, renew,
release, cancel, capacity timeline, watch, confirmations)."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import pathlib
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import World

REPO = pathlib.Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 60
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
DELEGATED_ONLY_WITH_CONFIRMATION = "permit(principal, action, resource) unless { context.delegated };"


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def json(self) -> Any:
        assert self.code == 0, (self.code, self.err)
        return json.loads(self.out)

    @property
    def error(self) -> dict[str, Any]:
        assert self.code == 1, (self.code, self.out, self.err)
        return json.loads(self.err)["error"]


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
    # An empty data directory: no connection file is found unless a test names one.
    env = dict(os.environ, BC_DATA_DIR=str(tmp_path / "no-dev"), PYTHONUNBUFFERED="1")
    env.pop("DATABASE_URL", None)
    return env


def connection_flags(world: World, token: str | None = None) -> list[str]:
    return ["--endpoint", world.endpoint, "--token", token or _token(world.user),
            "--tenant", world.tenant, "--pool", world.pool_id]


def _readable(fd: int, seconds: float) -> bool:
    """Whether `fd` has something to read within `seconds` (poll: any descriptor number)."""
    waiting = select.poll()
    waiting.register(fd, select.POLLIN)
    return bool(waiting.poll(int(seconds * 1000)))


def _token(client: Any) -> str:
    return client.metadata[0][1].removeprefix("Bearer ")


@pytest.fixture
def cli(world: World, tmp_path: pathlib.Path):
    """Run `better-compute ARGS` on pipes, with the world's user connection before the command."""

    def run(*args: str, token: str | None = None, connect: bool = True) -> Run:
        flags = connection_flags(world, token) if connect else []
        done = subprocess.run(
            [sys.executable, "-m", "controlplane.cli", *flags, *args],
            cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        )
        return Run(done.returncode, done.stdout, done.stderr)

    return run


@pytest.fixture
def tty(world: World, tmp_path: pathlib.Path):
    """Run `better-compute ARGS` with stdout on a pseudo-terminal 160 columns wide; the screen text."""

    def run(*args: str, token: str | None = None) -> Run:
        env = dict(_env(tmp_path), TERM="xterm-256color", COLUMNS="160", TZ="UTC")
        code, screen, err = on_a_terminal([*connection_flags(world, token), *args], env, columns=160)
        return Run(code, ANSI.sub("", screen.decode(errors="replace")), err)

    return run


def on_a_terminal(args: list[str], env: dict[str, str], *, columns: int) -> tuple[int, bytes, str]:
    """Run `better-compute ARGS` with stdout on a pseudo-terminal `columns` wide: (exit code, the
    bytes it wrote there, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "controlplane.cli", *args], cwd=REPO, env=env,
                               stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    screen = b""
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _readable(master, 1.0):
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(master)
    code = process.wait(timeout=CLI_TIMEOUT_S)
    err = process.stderr.read().decode() if process.stderr else ""
    return code, screen, err


def _iso_in(hours: float) -> str:
    moment = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(hours=hours)
    return moment.isoformat()


def _ms(iso: str) -> int:
    return int(datetime.datetime.fromisoformat(iso).timestamp() * 1000)


# JSON on a pipe ---------------------------------------------------------------------------------


def test_reserve_get_list_and_timeline_answer_json_on_a_pipe(cli, world: World) -> None:
    start = _iso_in(3)
    placed = cli("reserve", "--gpus", "2", "--for", "2h", "--start", start).json
    assert placed["state"] == "placed" and placed["id"].startswith("rsv_")
    assert placed["idempotencyKey"].startswith("cli-")
    assert placed["during"] == {"start": _ms(start), "end": _ms(start) + 2 * 3_600_000}

    assert cli("get", placed["id"]).json["id"] == placed["id"]
    assert placed["id"] in [r["id"] for r in cli("list").json["items"]]
    assert cli("list", "--state", "active").json["items"] == []  # an empty page is still a list

    timeline = cli("capacity", "timeline", "--from", start, "--to", "+6h", "--step", "30m").json
    assert timeline["poolId"] == world.pool_id and timeline["allocatable"] == 16
    buckets = timeline["buckets"]
    assert buckets[0]["start"] == _ms(start)
    assert [b["end"] - b["start"] for b in buckets[:4]] == [1_800_000] * 4
    assert [b["booked"] for b in buckets[:4]] == [2, 2, 2, 2]  # the two GPUs for the 2-hour window
    assert buckets[4]["booked"] == 0 and buckets[4]["free"] == 16


def test_the_connection_options_work_after_the_command_and_from_a_file(cli, world: World, tmp_path: pathlib.Path) -> None:
    placed = cli("reserve", "--gpus", "1", *connection_flags(world), connect=False).json
    assert placed["poolId"] == world.pool_id
    conn_file = tmp_path / "connection.json"
    conn_file.write_text(json.dumps({"endpoint": world.endpoint, "token": _token(world.user),
                                     "tenantId": world.tenant, "poolId": world.pool_id}))
    assert cli("get", placed["id"], "--connection", str(conn_file), connect=False).json["id"] == placed["id"]


def test_extend_until_a_relative_time_and_by_a_duration(cli) -> None:
    placed = cli("reserve", "--gpus", "1", "--for", "1h", "--start", _iso_in(2)).json
    before = int(time.time() * 1000)
    answer = cli("extend", placed["id"], "--until", "+12h").json
    after = int(time.time() * 1000)
    assert answer["extended"] is True
    end = answer["reservation"]["during"]["end"]
    assert before + 12 * 3_600_000 <= end <= after + 12 * 3_600_000

    answer = cli("extend", placed["id"], "--by", "30m", "--key", "ext-2").json
    assert answer["extended"] is True and answer["reservation"]["during"]["end"] == end + 1_800_000
    # An until the reservation already reaches changes nothing.
    answer = cli("extend", placed["id"], "--until", str(end)).json
    assert answer["extended"] is False


def test_renew_moves_the_lease_and_needs_one(cli) -> None:
    leased = cli("reserve", "--gpus", "1", "--lease", "10m").json
    first = leased["leaseDeadline"]
    renewed = cli("renew", leased["id"]).json
    assert renewed["id"] == leased["id"] and renewed["leaseDeadline"] >= first

    plain = cli("reserve", "--gpus", "1").json
    run = cli("renew", plain["id"])
    assert run.error["code"] == "INVALID_STATE"


def test_cancel_release_and_the_spec_error_on_stderr(cli) -> None:
    later = cli("reserve", "--gpus", "1", "--start", _iso_in(5)).json
    assert cli("cancel", later["id"]).json["state"] == "cancelled"

    now = cli("reserve", "--gpus", "1").json
    assert cli("release", now["id"]).json["state"] == "released"
    error = cli("cancel", now["id"]).error  # released is terminal: nothing to withdraw
    assert error["code"] == "INVALID_STATE" and error["message"]
    assert error["details"]["reservationId"] == now["id"]

    error = cli("get", "rsv_" + "0" * 52).error
    assert error["code"] == "NOT_FOUND"


def test_usage_errors_exit_2(cli) -> None:
    for args in (
        ("extend", "rsv_x"),  # neither --until nor --by
        ("extend", "rsv_x", "--until", "+1h", "--by", "1h"),
        ("extend", "rsv_x", "--until", "tomorrow-ish"),
        ("reserve", "--gpus", "1", "--start", "soon"),
        ("capacity", "--gpus", "1"),  # the reserve flags go with --preview
        ("confirmations", "maybe", "conf_x"),
        ("no-such-command",),
    ):
        run = cli(*args)
        assert run.code == 2, (args, run)
        assert run.err and not run.out, (args, run)


# Watch ------------------------------------------------------------------------------------------


def test_watch_filters_resumes_from_an_id_and_prints_events_as_they_happen(cli, world: World, tmp_path: pathlib.Path) -> None:
    first = cli("reserve", "--gpus", "1", "--start", _iso_in(4)).json
    second = cli("reserve", "--gpus", "1", "--start", _iso_in(5)).json

    [placed] = [json.loads(line) for line in cli(
        "watch", "--type", "reservation.placed", "--subject", f"reservation/{first['id']}", "--count", "1").out.splitlines()]
    assert placed["type"] == "reservation.placed" and placed["data"]["state"] == "placed"
    resumed = [json.loads(line) for line in cli(
        "watch", "--after", str(placed["id"]), "--type", "reservation.placed", "--count", "1").out.splitlines()]
    assert [(e["subject"], e["id"] > placed["id"]) for e in resumed] == [(f"reservation/{second['id']}", True)]

    # Live: a watcher started before the change prints it when it happens.
    watcher = subprocess.Popen(
        [sys.executable, "-m", "controlplane.cli", *connection_flags(world), "watch", "--after", str(resumed[0]["id"]),
         "--type", "reservation.cancelled", "--count", "1"],
        cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert cli("cancel", second["id"]).json["state"] == "cancelled"
        out, err = watcher.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0, err
    [event] = [json.loads(line) for line in out.splitlines()]
    assert (event["type"], event["subject"]) == ("reservation.cancelled", f"reservation/{second['id']}")


# Delegated confirmation -------------------------------------------------------------------------


def test_a_person_approves_an_agents_held_request_with_confirmations_approve(cli, world: World) -> None:
    world.policy(DELEGATED_ONLY_WITH_CONFIRMATION)
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                              confirm_actions=["compute:reservations:create"])
    args = ("reserve", "--gpus", "2", "--start", _iso_in(6), "--key", "agent-cli")
    held = cli(*args, token=_token(agent)).error
    assert held["code"] == "CONFIRMATION_REQUIRED"
    confirmation_id = held["details"]["confirmationId"]

    # Only the person decides; the agent is refused.
    assert cli("confirmations", "approve", confirmation_id, token=_token(agent)).error["code"] == "ACCESS_DENIED"
    approved = cli("confirmations", "approve", confirmation_id).json
    assert approved["state"] == "approved" and approved["reservationId"] == held["details"]["reservationId"]

    placed = cli(*args, token=_token(agent)).json
    assert placed["id"] == held["details"]["reservationId"] and placed["state"] == "placed"


def test_on_a_terminal_the_agent_is_told_the_command_its_person_runs(tty, world: World) -> None:
    world.policy(DELEGATED_ONLY_WITH_CONFIRMATION)
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                              confirm_actions=["compute:reservations:create"])
    held = tty("reserve", "--gpus", "1", "--key", "agent-tty", token=_token(agent))
    assert held.code == 1 and held.err.startswith("error CONFIRMATION_REQUIRED:"), held
    [confirmation_id] = re.findall(r"confirmationId: (\S+)", held.err)
    assert f"better-compute confirmations approve {confirmation_id}" in held.err


def test_a_rejected_request_is_denied_on_retry(cli, world: World) -> None:
    world.policy(DELEGATED_ONLY_WITH_CONFIRMATION)
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                              confirm_actions=["compute:reservations:create"])
    args = ("reserve", "--gpus", "1", "--key", "agent-no", "--start", _iso_in(6))
    held = cli(*args, token=_token(agent)).error
    assert cli("confirmations", "reject", held["details"]["confirmationId"]).json["state"] == "rejected"
    assert cli(*args, token=_token(agent)).error["code"] == "ACCESS_DENIED"


# People on a terminal ---------------------------------------------------------------------------


def test_a_terminal_gets_a_table_a_summary_and_a_calendar(cli, tty, world: World) -> None:
    start = _iso_in(30)
    placed = cli("reserve", "--gpus", "4", "--for", "8h", "--start", start).json

    listed = tty("list")
    assert listed.code == 0, listed
    header, *rows = [line.split() for line in listed.out.splitlines() if line.strip()]
    assert header == ["ID", "STATE", "GPUS", "START", "DURATION", "POOL"]
    assert [placed["id"], "placed", "4"] + start[:16].split("T") + ["UTC", "8h", world.pool_id] in rows

    got = tty("get", placed["id"])
    assert got.code == 0, got
    lines = {line.split()[0]: line.split()[1:] for line in got.out.splitlines() if line.strip()}
    assert lines[placed["id"]] == ["placed"]
    assert lines["devices"] == ["4", "×", "gpu", "(any)"]
    end = datetime.datetime.fromisoformat(start) + datetime.timedelta(hours=8)
    # The end shows its date only when it falls on another day than the start.
    end_shown = [end.strftime("%H:%M")] if end.date().isoformat() == start[:10] else end.strftime("%Y-%m-%d %H:%M").split()
    assert lines["window"] == [start[:10], start[11:16], "UTC", "→", *end_shown, "UTC", "(8h)"]

    until = (datetime.datetime.fromisoformat(start) + datetime.timedelta(hours=10)).isoformat()
    calendar = tty("capacity", "timeline", "--from", start, "--to", until, "--step", "2h")
    assert calendar.code == 0, calendar
    assert f"{world.pool_id}: 16 GPUs allocatable, 2h per row" in calendar.out
    bars = [line.split() for line in calendar.out.splitlines() if "█" in line or "░" in line]
    # One row per bucket: booked as a solid bar, free as a light one, then the two numbers.
    assert [row[-3:] for row in bars] == [["████░░░░░░░░░░░░", "4", "12"]] * 4 + [["░" * 16, "0", "16"]]
    assert bars[0][:3] == [start[:10], start[11:16], "UTC"] and bars[1][0] != start[:10]  # the date once

    watched = tty("watch", "--subject", f"reservation/{placed['id']}", "--count", "1")
    assert watched.code == 0, watched
    [line] = [line.split() for line in watched.out.splitlines() if line.strip()]  # one event, one line
    assert line[4:6] == ["reservation.placed", f"reservation/{placed['id']}"] and "state=placed" in line

    # --json still prints JSON on a terminal.
    assert json.loads(tty("--json", "get", placed["id"]).out)["id"] == placed["id"]


def test_a_terminal_shows_the_error_for_people_and_a_spinner_while_reserve_waits(tty) -> None:
    missing = tty("get", "rsv_" + "0" * 52)
    assert missing.code == 1 and missing.out == ""
    assert missing.err.startswith("error NOT_FOUND: no such reservation")
    assert "reservationId: rsv_" in missing.err

    # 64 GPUs do not fit the two 8-GPU nodes: the reservation waits pending while the spinner runs.
    waiting = tty("reserve", "--gpus", "64", "--wait", "3")
    assert waiting.code == 0, waiting
    assert "reserving 64 GPUs: pending" in waiting.out and "0:00:0" in waiting.out
    assert "pending" in waiting.out.split("reserving 64 GPUs")[-1]


def test_a_large_pool_is_drawn_to_a_fixed_width() -> None:
    """64 GPUs are scaled to 40 columns, every row as wide, booked first."""
    from rich.console import Console

    from bettercompute.v1 import capacity_pb2 as cpb
    from controlplane.client.render import BAR_WIDTH, timeline

    hour = 3_600_000
    answer = cpb.TimelineResponse(pool_id="pool_x", allocatable=64, buckets=[
        cpb.TimelineBucket(start=i * hour, end=(i + 1) * hour, booked=booked, free=64 - booked)
        for i, booked in enumerate((0, 4, 63, 64))
    ])
    console = Console(width=120, record=True, color_system=None)
    console.print(timeline(answer))
    bars = [line.split()[-3] for line in console.export_text().splitlines() if "░" in line or "█" in line]
    assert [len(bar) for bar in bars] == [BAR_WIDTH] * 4
    assert [bar.count("█") for bar in bars] == [0, 2, 39, 40]
    assert all(bar == "█" * bar.count("█") + "░" * bar.count("░") for bar in bars)


def test_reserve_kubernetes_books_the_kubernetes_binding(cli, world: World) -> None:
    error = cli("reserve", "--gpus", "1", "--kubernetes").error  # the pool has no policy.kubernetes yet
    assert error["code"] == "INVALID_INPUT" and error["details"]["field"] == "binding"
    world.sql("UPDATE pools SET policy = policy || '{\"kubernetes\": true}' WHERE id = %s", (world.pool_id,))
    world.sql("UPDATE nodes SET labels = labels || jsonb_build_object('bc.dev/cap.binding.kubernetes',"
              " jsonb_build_object('value', 'true', 'source', 'system')) WHERE id = %s", (world.nodes[1].id,))
    placed = cli("reserve", "--gpus", "1", "--kubernetes").json
    assert placed["request"]["binding"] == "kubernetes"
    assert placed["allocations"][0]["nodeId"] == world.nodes[1].id  # the node whose daemon serves it
    assert cli("reserve", "--gpus", "1").json["request"]["binding"] == "hold"


def test_reserve_books_slots_of_a_shared_pool_with_class(cli, world: World) -> None:
    from bettercompute.v1 import admin_pb2 as apb

    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="ts", policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="time-slice")))).id
    world.add_node()
    placed = cli("reserve", "--gpus", "2", "--class", "gpu.slot").json
    assert placed["state"] == "placed" and placed["request"]["devices"][0]["class"] == "gpu.slot"
    assert all(":" in d for d in placed["allocations"][0]["deviceIds"])
    refused = cli("reserve", "--gpus", "1").error  # whole GPUs: the pool does not book them
    assert refused["code"] == "INVALID_INPUT" and refused["details"]["field"] == "devices[0].class"


def test_reserve_node_profile_books_the_node_binding(cli, world: World) -> None:
    from tests.test_node_profiles import register

    profile_id = register(world.root, 1, 2)
    error = cli("reserve", "--gpus", "8", "--node-profile", profile_id).error  # no policy.tenantRoot yet
    assert error["code"] == "INVALID_INPUT" and error["details"]["field"] == "binding"
    world.sql("UPDATE pools SET policy = policy || '{\"tenantRoot\": true}' WHERE id = %s", (world.pool_id,))
    error = cli("reserve", "--gpus", "8", "--node-profile", f"{profile_id}:9").error
    assert error["code"] == "NOT_FOUND" and error["details"]["field"] == "node.profileVersion"
    # The world's nodes were registered, never enrolled: not platform-trusted, so it waits.
    waiting = cli("reserve", "--gpus", "8", "--node-profile", f"{profile_id}:1", "--wait", "1").json
    assert waiting["request"]["binding"] == "node" and waiting["state"] == "pending"
    assert waiting["request"]["node"] == {"profileId": profile_id, "profileVersion": 1}
    for bad in (f"{profile_id}:x", f"{profile_id}:0", ":1"):
        run = cli("reserve", "--gpus", "8", "--node-profile", bad)
        assert run.code == 2 and "--node-profile" in run.err, (bad, run)
    run = cli("reserve", "--gpus", "8", "--node-profile", profile_id, "--kubernetes")
    assert run.code == 2 and "pick one" in run.err


def test_reserve_gang_books_one_node_per_member_sharing_the_label(cli, tty, world: World) -> None:
    racked = [world.add_node(labels={"rack": "r7"}) for _ in range(2)]
    placed = cli("reserve", "--gpus", "8", "--gang", "2", "--topology-key", "rack").json
    assert placed["request"]["gang"] == {"size": 2, "topologyKey": "rack"}
    assert sorted(a["nodeId"] for a in placed["allocations"]) == sorted(n.id for n in racked)
    assert [len(a["deviceIds"]) for a in placed["allocations"]] == [8, 8]
    error = cli("reserve", "--gpus", "8", "--gang", "1").error
    assert error["code"] == "INVALID_INPUT" and error["details"]["field"] == "gang.size"
    usage = cli("reserve", "--gpus", "8", "--topology-key", "rack")
    assert usage.code == 2 and "--topology-key needs --gang" in usage.err
    shown = tty("get", placed["id"])
    assert "2 nodes sharing one rack" in shown.out


# The operator's node commands ----------------------------------------------------------------


def test_nodes_join_token_certificates_revoke_and_readmit_with_roots_token(cli, world: World) -> None:
    root = _token(world.root)
    token = cli("nodes", "join-token", "cli-node-1", "--ttl", "30m", token=root).json
    assert token["secret"].startswith("bcj_") and token["nodeName"] == "cli-node-1"
    assert token["poolId"] == world.pool_id and token["role"] == "node"
    assert token["expiresAt"] - time.time() * 1000 < 31 * 60_000
    from tests.test_pki import NodeKeys, _enrol_with
    node_id = _enrol_with(world.conninfo, token["secret"], NodeKeys().csr()).node_id  # the token enrols a node
    certs = cli("nodes", "certificates", node_id, token=root).json["items"]
    assert certs and {c["usage"] for c in certs} == {"signing", "tls"}
    revoked = cli("nodes", "revoke", node_id, "--reason", "stolen laptop", token=root).json
    assert sorted(revoked["serials"]) == sorted(c["serial"] for c in certs)
    assert cli("nodes", "readmit", node_id, token=root).json["readmitted"] is True
    # A tenant's token is refused; a bad ttl is a usage error; revoke needs a node or a serial.
    assert cli("nodes", "join-token", "cli-node-2").error["code"] == "ACCESS_DENIED"
    assert cli("nodes", "join-token", "x", "--ttl", "soon", token=root).code == 2
    assert cli("nodes", "revoke", "--reason", "r", token=root).code == 2
