"""README.md's examples, driven as a new user would: `better-compute` as a real process against a
real control plane. Each test pins a promise of the README that the walkthrough found broken."""

from __future__ import annotations

import datetime
import pathlib

from tests.support import World
from tests.test_cli import ANSI, _env, cli, connection_flags, on_a_terminal  # noqa: F401  (cli: fixture)


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
