"""`better-compute capacity` shows the pool's rollup, and `capacity --preview` with the reserve
flags shows where a reservation would go (or why not), booking nothing (issue 11)."""

from __future__ import annotations

from tests.support import World
from tests.test_cli import cli, tty  # noqa: F401  (fixtures)


def test_capacity_shows_the_rollup(cli, world: World) -> None:  # noqa: F811
    world.create(count=3)
    world.create(count=2, start=world.later(2))
    out = cli("capacity").json
    assert out["total"] == {"allocatable": 16, "inUse": 3, "reserved": 2, "free": 13}
    assert out["models"][0]["model"] == "H100-SXM5-80GB" and out["ownInUse"] == 3


def test_capacity_preview_takes_the_reserve_flags(cli, world: World) -> None:  # noqa: F811
    out = cli("capacity", "--preview", "--gpus", "8", "--gang", "2", "--for", "2h").json
    assert out["fits"] and len(out["members"]) == 2
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,))[0][0] == 0
    out = cli("capacity", "--preview", "--gpus", "2", "--cpus", "4").json
    assert not out["fits"] and out["filters"][0]["reason"] == "needs label bc.dev/cap.devices.limits=*"
    world.create(count=8, duration="1h")
    world.create(count=8, duration="1h")
    out = cli("capacity", "--preview", "--gpus", "8", "--earliest", "--horizon", "2d").json
    assert out["fits"] and int(out["start"]) > world.later(0) - 3_600_000
    bad = cli("capacity", "--preview", "--gpus", "1", "--earliest", "--horizon", "61d").error
    assert bad["code"] == "INVALID_INPUT" and bad["details"]["field"] == "horizonMs"
    assert cli("capacity", "--gpus", "1").code == 2  # the reserve flags go with --preview


def test_reserve_earliest_books_the_earliest_window(cli, world: World) -> None:  # noqa: F811
    world.create(count=8, duration="1h")
    world.create(count=8, duration="3h")
    placed = cli("reserve", "--gpus", "8", "--for", "30m", "--earliest").json
    assert placed["state"] == "placed" and placed["request"]["startEarliest"]
    assert int(placed["request"]["start"]) > world.later(0)


def test_capacity_on_a_terminal(tty, world: World) -> None:  # noqa: F811
    world.create(count=3)
    shown = tty("capacity")
    assert shown.code == 0 and "13 of 16 GPUs free now" in shown.out
    shown = tty("capacity", "--preview", "--gpus", "9")
    assert "does not fit" in shown.out and "has fewer than 9 healthy GPUs" in shown.out
