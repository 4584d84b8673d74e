"""The MCP `preview_capacity` tool (issue 11): an agent asks where a reservation would go, or its
earliest start, booking nothing."""

from __future__ import annotations

import pathlib

from tests.support import World
from tests.test_mcp import Call, _token, run_agent


def test_an_agent_previews_capacity(world: World, tmp_path: pathlib.Path) -> None:
    world.create(count=8, duration="1h")
    world.create(count=8, duration="2h")

    async def script(call: Call) -> None:
        failed, now = await call("preview_capacity", gpus=8)
        assert not failed and now["fits"] is False and now["filters"][0]["filter"] == "free", now
        failed, soonest = await call("preview_capacity", gpus=8, earliest=True, horizon="1d")
        assert not failed and soonest["fits"] is True and len(soonest["members"]) == 1, soonest
        failed, gang = await call("preview_capacity", gpus=8, gang=2, earliest=True)
        assert not failed and gang["fits"] and int(gang["start"]) > int(soonest["start"]), gang
        failed, bad = await call("preview_capacity", gpus=8, earliest=True, horizon="61d")
        assert failed and bad["code"] == "INVALID_INPUT" and bad["details"]["field"] == "horizonMs"

    run_agent(world, tmp_path, _token(world.user), script)
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,))[0][0] == 2
