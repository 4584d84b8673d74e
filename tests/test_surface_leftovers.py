"""Leftovers around the surface: the bearer token kept out of argv (BC_TOKEN, --token-file) for the
CLI and the MCP server, tenant ids that would read as tokens, and a release racing the reconciler's
expiry of a confirmation (one lock order: the reservation's row, then its confirmation)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from structlog.testing import capture_logs

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.support import World, clock_now, invalid, make_world, refused

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 60
SECOND = 1000
AGENT_POLICY = "permit(principal, action, resource) unless { context.delegated };"


# The bearer token out of argv: BC_TOKEN and --token-file -----------------------------------------

def _token(client: Any) -> str:
    return client.metadata[0][1].removeprefix("Bearer ")


def cli(tmp_path: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`better-compute ARGS` as a process, with no connection file and `env` added to its environment."""
    environ = dict(os.environ, BC_DATA_DIR=str(tmp_path / "no-dev"), PYTHONUNBUFFERED="1", **env)
    environ.pop("DATABASE_URL", None)
    if "BC_TOKEN" not in env:
        environ.pop("BC_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def no_token(world: World) -> list[str]:
    return ["--endpoint", world.endpoint, "--tenant", world.tenant, "--pool", world.pool_id]


def test_the_cli_takes_its_token_from_bc_token_or_a_token_file(world: World, tmp_path: pathlib.Path) -> None:
    rid = world.create().id
    token_file = tmp_path / "token"
    token_file.write_text(_token(world.user) + "\n")

    from_env = cli(tmp_path, *no_token(world), "get", rid, BC_TOKEN=_token(world.user))
    assert from_env.returncode == 0, from_env.stderr
    assert json.loads(from_env.stdout)["id"] == rid
    from_file = cli(tmp_path, *no_token(world), "get", rid, "--token-file", str(token_file))
    assert from_file.returncode == 0, from_file.stderr
    assert json.loads(from_file.stdout)["id"] == rid
    # The file, given on the command line, wins over the variable; the variable is really used.
    over_env = cli(tmp_path, "--token-file", str(token_file), *no_token(world), "get", rid, BC_TOKEN="bct_wrong")
    assert over_env.returncode == 0, over_env.stderr
    wrong = cli(tmp_path, *no_token(world), "get", rid, BC_TOKEN="bct_wrong")
    assert wrong.returncode == 1 and json.loads(wrong.stderr)["error"]["code"] == "UNAUTHENTICATED", wrong.stderr
    # An option after the command that the ones before it start with is still read as itself
    # (--to, beside --token and --token-file).
    usage = cli(tmp_path, *no_token(world), "--token-file", str(token_file), "usage", "--to", "2099-01-01T00:00:00Z")
    assert usage.returncode == 0 and "items" in json.loads(usage.stdout), usage.stderr
    # --token still works.
    assert cli(tmp_path, *no_token(world), "--token", _token(world.user), "get", rid).returncode == 0


DEAD = ["--endpoint", "127.0.0.1:1", "--tenant", "tenant1", "--pool", "pool_06h31j4ff8bcsn30075tfxe24g"]
BAD_TOKEN_FILES: dict[str, tuple[bytes | None, str]] = {
    "missing": (None, "No such file"),
    "empty": (b"", "is empty"),
    "a newline only": (b"\n", "is empty"),
    "two lines": (b"bct_one\nbct_two\n", "more than one line"),
    "not UTF-8": (b"bct_\xff\n", "not UTF-8"),
}


@pytest.mark.parametrize("content, reason", BAD_TOKEN_FILES.values(), ids=BAD_TOKEN_FILES.keys())
@pytest.mark.parametrize("command", [["get", "rsv_x"], ["mcp"]], ids=["cli", "mcp"])
def test_a_token_file_that_gives_no_token_is_a_usage_error_naming_the_option(
    tmp_path: pathlib.Path, command: list[str], content: bytes | None, reason: str,
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_bytes(content)
    done = cli(tmp_path, *command, *DEAD, "--token-file", str(path), BC_TOKEN="bct_not-this-one")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert f"--token-file {path}" in done.stderr and reason in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "unrecognized" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", [["get", "rsv_x"], ["mcp"]], ids=["cli", "mcp"])
def test_a_token_file_that_is_a_directory_or_given_with_token_is_a_usage_error(
    tmp_path: pathlib.Path, command: list[str],
) -> None:
    directory = cli(tmp_path, *command, *DEAD, "--token-file", str(tmp_path))
    assert directory.returncode == 2 and f"--token-file {tmp_path}" in directory.stderr, directory.stderr
    assert "Traceback" not in directory.stderr
    path = tmp_path / "token"
    path.write_text("bct_x\n")
    both = cli(tmp_path, *command, *DEAD, "--token", "bct_x", "--token-file", str(path))
    assert both.returncode == 2 and "--token and --token-file" in both.stderr, both.stderr


def list_as_agent(world: World, tmp_path: pathlib.Path, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Start `better-compute mcp ARGS` with `env` and call its list_reservations tool: the JSON it answers."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "controlplane.cli", "mcp", *args], cwd=str(REPO),
        env={"BC_DATA_DIR": str(tmp_path / "no-dev"), "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env},
    )
    answer: dict[str, Any] = {}

    async def session() -> None:
        with anyio.fail_after(TIMEOUT_S * 2):
            async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
                await client.initialize()
                result = await client.call_tool("list_reservations", {}, read_timeout_seconds=TIMEOUT_S)
                text = "".join(block.text for block in result.content if block.type == "text")
                assert not result.is_error, text
                answer.update(json.loads(text))

    anyio.run(session)
    return answer


def test_the_mcp_server_takes_its_token_from_bc_token_or_a_token_file(world: World, tmp_path: pathlib.Path) -> None:
    rid = world.create().id
    token_file = tmp_path / "token"
    token_file.write_text(_token(world.user) + "\n")
    from_env = list_as_agent(world, tmp_path, no_token(world), {"BC_TOKEN": _token(world.user)})
    assert [r["id"] for r in from_env["items"]] == [rid], from_env
    from_file = list_as_agent(world, tmp_path, [*no_token(world), "--token-file", str(token_file)], {})
    assert [r["id"] for r in from_file["items"]] == [rid], from_file


# Tenant ids that read as tokens -------------------------------------------------------------------

@pytest.mark.parametrize("tenant_id", ["bct_acme", "bct_AbCdEfGh12345678"])
def test_a_tenant_id_with_the_tokens_prefix_is_refused(world: World, tenant_id: str) -> None:
    """A bearer token starts with bct_: a tenant so named is logged as a token's prefix by the
    per-call log (the rest of it dropped) and is confusable with a secret wherever it appears."""
    invalid("id", world.root.admin, "CreateTenant", apb.CreateTenantRequest(id=tenant_id, name="x"))
    assert world.sql("SELECT count(*) FROM tenants WHERE id = %s", (tenant_id,)) == [(0,)]


def test_a_tenant_id_with_bct_elsewhere_is_still_a_tenant_id(world: World) -> None:
    for tenant_id in (f"acme-bct_{uuid.uuid4().hex[:6]}", f"bct-{uuid.uuid4().hex[:6]}", f"BCT_{uuid.uuid4().hex[:6]}"):
        assert world.root.admin("CreateTenant", apb.CreateTenantRequest(id=tenant_id, name="x")).id == tenant_id


# A release racing the expiry of its confirmation ---------------------------------------------------

@pytest.fixture
def timed(pg_uri: str) -> Iterator[World]:
    """A world whose control plane runs its workers and lets the test move compute_now()."""
    stack = module_stack(pg_uri, clock_control=True)
    server, root = next(stack)
    w = make_world(server.endpoint, root, server.conninfo)
    try:
        yield w
    finally:
        w.close()
        next(stack, None)


RACED = 40  # reservations released at once, per round
ROUNDS = 3


def test_releases_racing_the_expiry_of_their_confirmations_never_deadlock(timed: World) -> None:
    """The reconciler's expiry locked the confirmation and then the reservation; a release locks
    the reservation and then the confirmation. Released at the deadline while the reconciler
    expired them, the two deadlocked: PostgreSQL broke it after deadlock_timeout and one side ran
    again (the release's transaction retried, or the reconciler's work item failed and was
    retried). Both now take the reservation's row first: no deadlock, every release answers."""
    w = timed
    w.policy(AGENT_POLICY)
    _, agent = w.identity(kind="agent", person_identity_id=w.user_id,
                          confirm_actions=["compute:reservations:create"])
    deadlocks: list[dict] = []
    for _ in range(ROUNDS):
        deadlocks += _race_round(w, agent)
    assert deadlocks == [], deadlocks
    check_invariants(w.conninfo, w.tenant)


def _race_round(w: World, agent) -> list[dict]:
    """RACED requests held for confirmation, released all at once while the clock moves past their
    deadline (so the reconciler expires them meanwhile); the log lines of any deadlock."""
    held: list[str] = []
    deadline = 0
    for _ in range(RACED):
        _, reason, details = refused(agent.res, "Create", w.create_request(count=1))
        assert reason == "CONFIRMATION_REQUIRED", details
        held.append(details["reservationId"])
        deadline = max(deadline, int(details["expiresAt"]))
    start = threading.Barrier(RACED + 1)

    def release(rid: str) -> pb.Reservation:
        start.wait(30)
        return w.user.res("Release", pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=rid))

    def past_deadline() -> None:
        start.wait(30)
        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=deadline - clock_now(w) + SECOND))

    with capture_logs() as logs, ThreadPoolExecutor(RACED + 1) as pool:
        clock = pool.submit(past_deadline)
        answers = [f.result(timeout=120) for f in [pool.submit(release, rid) for rid in held]]
        clock.result(timeout=60)
        final = _settled(w, held)
    assert {a.state for a in answers} <= {"expired", "cancelled"}, [a.state for a in answers]
    assert set(final) == set(held) and set(final.values()) <= {"expired", "cancelled"}, final
    assert w.sql("SELECT count(*) FROM confirmations WHERE reservation_id = ANY(%s)"
                 " AND state IN ('pending', 'approved')", (held,)) == [(0,)]
    return [e for e in logs if e.get("sqlstate") == "40P01" or "eadlock" in str(e.get("error", ""))]


def _settled(w: World, held: list[str], seconds: float = 60) -> dict[str, str]:
    """The reservations' states once the reconciler has handled every item of theirs that is due
    (so a deadlock on its side is logged before the test looks)."""
    deadline = time.monotonic() + seconds
    while w.sql("SELECT count(*) FROM work_items WHERE subject = ANY(%s) AND run_at <= compute_now()",
                (held,)) != [(0,)]:
        assert time.monotonic() < deadline, "the reconciler never handled the confirmation deadlines"
        time.sleep(0.05)
    return dict(w.sql("SELECT id, state FROM reservations WHERE id = ANY(%s)", (held,)))


def test_releases_racing_the_offboarding_of_their_agents_never_deadlock(world: World) -> None:
    """Offboarding withdrew the agent's open confirmations (locking them) before it locked the
    agent's reservations, the other way round from a release: released while its agent was
    offboarded, a held request deadlocked the two. Offboarding now locks the rows first."""
    world.policy(AGENT_POLICY)
    deadlocks: list[dict] = []
    for _ in range(ROUNDS):
        deadlocks += _offboarding_round(world)
    assert deadlocks == [], deadlocks
    check_invariants(world.conninfo, world.tenant)


def _offboarding_round(w: World) -> list[dict]:
    """RACED agents with a request held for confirmation, each offboarded while its request is
    released; the log lines of any deadlock."""
    held: list[tuple[str, str, str]] = []  # (agent, its held request, its successor)
    for _ in range(RACED):
        agent_id, agent = w.identity(kind="agent", person_identity_id=w.user_id,
                                     confirm_actions=["compute:reservations:create"])
        _, reason, details = refused(agent.res, "Create", w.create_request(count=1))
        assert reason == "CONFIRMATION_REQUIRED", details
        successor, _ = w.identity()  # one each: offboardings naming one successor take turns
        held.append((agent_id, details["reservationId"], successor))
    start = threading.Barrier(2 * RACED)

    def release(rid: str) -> pb.Reservation:
        start.wait(30)
        return w.user.res("Release", pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=rid))

    def offboard(agent_id: str, successor: str) -> apb.OffboardIdentityResponse:
        start.wait(30)
        return w.root.admin("OffboardIdentity", apb.OffboardIdentityRequest(
            identity_id=agent_id, successor_identity_id=successor))

    with capture_logs() as logs, ThreadPoolExecutor(2 * RACED) as pool:
        calls = [pool.submit(release, rid) for _, rid, _ in held] + [pool.submit(offboard, a, s) for a, _, s in held]
        answers = [f.result(timeout=120) for f in calls]
    assert {a.state for a in answers[:RACED]} <= {"expired", "cancelled"}, [a.state for a in answers[:RACED]]
    rids = [rid for _, rid, _ in held]
    assert w.sql("SELECT count(*) FROM confirmations WHERE reservation_id = ANY(%s)"
                 " AND state IN ('pending', 'approved')", (rids,)) == [(0,)]
    return [e for e in logs if e.get("sqlstate") == "40P01" or "eadlock" in str(e.get("error", ""))]
