"""`better-compute mcp` driven by the `mcp` package's own client over stdio, against a real control
plane: the tools, and the delegated-confirmation loop for an agent identity."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from mcp import ClientSession, StdioServerParameters, stdio_client

from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World

REPO = pathlib.Path(__file__).resolve().parents[1]
CALL_TIMEOUT_S = 60
POLICY = "permit(principal, action, resource) unless { context.delegated };"

Call = Callable[..., Awaitable[tuple[bool, Any]]]


def _token(client: Any) -> str:
    return client.metadata[0][1].removeprefix("Bearer ")


def run_agent(world: World, tmp_path: pathlib.Path, token: str, script: Callable[[Call], Awaitable[None]]) -> None:
    """Start `better-compute mcp` with `token` and run `script(call)` against it as an MCP client;
    call(tool, **arguments) answers (is_error, the JSON the tool returned or its error)."""
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "controlplane.cli", "mcp", "--endpoint", world.endpoint, "--token", token,
              "--tenant", world.tenant, "--pool", world.pool_id],
        cwd=str(REPO),
        env={"BC_DATA_DIR": str(tmp_path / "no-dev"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )

    async def session() -> None:
        with anyio.fail_after(CALL_TIMEOUT_S * 4):
            async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
                await client.initialize()
                tools = {tool.name for tool in (await client.list_tools()).tools}
                assert tools >= {"reserve_gpus", "get_reservation", "list_reservations",
                                 "extend_reservation", "release_reservation"}, tools

                async def call(tool: str, **arguments: Any) -> tuple[bool, Any]:
                    result = await client.call_tool(tool, arguments, read_timeout_seconds=CALL_TIMEOUT_S)
                    text = "".join(block.text for block in result.content if block.type == "text")
                    if result.is_error:  # "Error executing tool NAME: " and the error as JSON
                        return True, json.loads(text.split(": ", 1)[1])
                    return False, json.loads(text)

                await script(call)

    anyio.run(session)


def _iso_in(hours: float) -> str:
    moment = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(hours=hours)
    return moment.isoformat()


def test_an_agent_books_reads_lists_extends_and_releases(world: World, tmp_path: pathlib.Path) -> None:
    async def script(call: Call) -> None:
        failed, booked = await call("reserve_gpus", gpus=2, topology="nvlink-all", duration="2h", waitSeconds=5)
        assert not failed, booked
        rid = booked["reservation"]["id"]
        assert booked["status"] in ("placed", "binding") and booked["idempotencyKey"].startswith("mcp-")
        assert booked["reservation"]["request"]["devices"] == [
            {"class": "gpu", "count": 2, "topology": "nvlink-all", "model": "H100-SXM5-80GB", "profile": ""}]

        # The same key answers the same reservation.
        failed, again = await call("reserve_gpus", gpus=2, topology="nvlink-all", duration="2h",
                                   idempotencyKey=booked["idempotencyKey"])
        assert not failed and again["reservation"]["id"] == rid

        failed, got = await call("get_reservation", reservationId=rid)
        assert not failed and got["id"] == rid
        failed, listed = await call("list_reservations")
        assert not failed and [r["id"] for r in listed["items"]] == [rid]

        end = got["during"]["end"]
        failed, extended = await call("extend_reservation", reservationId=rid, by="1h")
        assert not failed and extended["extended"] is True, extended
        assert extended["reservation"]["during"]["end"] == end + 3_600_000
        failed, bad = await call("extend_reservation", reservationId=rid)
        assert failed and bad["code"] == "INVALID_INPUT" and "exactly one of until" in bad["message"]

        failed, released = await call("release_reservation", reservationId=rid)
        assert not failed and released["state"] == "released"

        failed, missing = await call("get_reservation", reservationId="rsv_" + "0" * 52)
        assert failed and missing["code"] == "NOT_FOUND" and missing["details"]["reservationId"]

    run_agent(world, tmp_path, _token(world.user), script)


def test_an_agent_is_told_what_its_person_must_do_and_retries_once_approved(world: World, tmp_path: pathlib.Path) -> None:
    world.policy(POLICY)
    agent_id, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                                     confirm_actions=["compute:reservations:create"])

    async def script(call: Call) -> None:
        # A relative start: the retry must resend the held request, not compute a new window.
        failed, held = await call("reserve_gpus", gpus=2, duration="1h", start="+3h", waitSeconds=5)
        assert not failed, held
        assert held["status"] == "confirmation-required"
        confirmation_id, key = held["confirmationId"], held["idempotencyKey"]
        assert held["personMustRun"] == f"better-compute confirmations approve {confirmation_id}"
        assert key in held["next"] and held["reservationId"].startswith("rsv_") and int(held["expiresAt"]) > 0

        # Asked again before the person decided: the same confirmation.
        failed, still = await call("reserve_gpus", gpus=2, duration="1h", start="+3h", idempotencyKey=key)
        assert not failed and (still["status"], still["confirmationId"]) == ("confirmation-required", confirmation_id)

        approved = world.user.conf("Approve", pb.DecideConfirmationRequest(
            tenant_id=world.tenant, confirmation_id=confirmation_id))
        assert approved.state == "approved" and approved.agent_identity_id == agent_id

        # `+3h` computed now names another window (a different request under the same key,
        # CONFLICT): the held request is what is sent.
        failed, placed = await call("reserve_gpus", gpus=2, duration="1h", start="+3h", idempotencyKey=key)
        assert not failed, placed
        assert placed["status"] == "placed" and placed["reservation"]["id"] == held["reservationId"]
        assert placed["reservation"]["ownerIdentityId"] == agent_id

    run_agent(world, tmp_path, _token(agent), script)


def test_a_rejected_confirmation_is_an_error_the_agent_reads(world: World, tmp_path: pathlib.Path) -> None:
    world.policy(POLICY)
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                              confirm_actions=["compute:reservations:create"])

    async def script(call: Call) -> None:
        failed, held = await call("reserve_gpus", gpus=1, idempotencyKey="agent-rejected")
        assert not failed and held["status"] == "confirmation-required" and held["idempotencyKey"] == "agent-rejected"
        world.user.conf("Reject", pb.DecideConfirmationRequest(tenant_id=world.tenant,
                                                               confirmation_id=held["confirmationId"]))
        failed, denied = await call("reserve_gpus", gpus=1, idempotencyKey="agent-rejected")
        assert failed and denied["code"] == "ACCESS_DENIED"

    run_agent(world, tmp_path, _token(agent), script)


def test_without_a_token_the_server_does_not_start(tmp_path: pathlib.Path) -> None:
    done = subprocess.run([sys.executable, "-m", "controlplane.cli", "mcp", "--endpoint", "127.0.0.1:1"], cwd=REPO,
                          env=dict(os.environ, BC_DATA_DIR=str(tmp_path)), capture_output=True, text=True,
                          timeout=CALL_TIMEOUT_S)
    assert done.returncode == 2 and "--token" in done.stderr
