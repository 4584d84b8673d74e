"""A gateway's liveness bookkeeping (controlplane.nodes.connectivity.Liveness): a heartbeat writes
no row while the stored `last_seen` trails by less than a fraction of the grace, a node whose
heartbeats keep arriving is never swept whatever its row says, and a node that stops is swept once
the grace has passed. Real nodes (enrolled, with a session and a hello through a real gateway),
the real database; the Liveness under test runs on the gateway's loop and pool."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from controlplane.nodes.connectivity import Liveness
from gateway.config import GatewaySettings
from tests.test_gateway import GatewayThread, connected, eventually, node_row, pool_id  # noqa: F401 - a fixture
from tests.test_pki import sql


@pytest.fixture
def quiet_gateway(database: str) -> Iterator[GatewayThread]:
    """A gateway whose own sweeper ran once at start and then waits an hour: only the Liveness
    under test writes `last_seen` or sweeps."""
    gw = GatewayThread(database, GatewaySettings(node_grace_seconds=3600, sweep_seconds=3600))
    try:
        yield gw
    finally:
        gw.stop()


def row_version(conninfo: str, node_id: str) -> tuple[str, object]:
    row = sql(conninfo, "SELECT xmin::text AS xmin, last_seen FROM nodes WHERE id = %s", (node_id,))[0]
    return row["xmin"], row["last_seen"]


def test_a_heartbeat_within_the_threshold_writes_no_row(quiet_gateway: GatewayThread, pool_id: str) -> None:  # noqa: F811
    gw = quiet_gateway
    node, session = connected(gw, pool_id, "gpu-01")
    liveness = Liveness(gw.gateway.pool, grace_seconds=3600, write_fraction=0.25)  # writes every 900 s
    gw.call(liveness.hello(node.node_id))
    assert gw.call(liveness.heartbeat(node.node_id, 0)) is True  # the session's first: its generation
    before = row_version(gw.conninfo, node.node_id)
    for _ in range(5):
        assert gw.call(liveness.heartbeat(node.node_id, 0)) is False
    gw.call(liveness.sweep())  # the stored time trails by far less than 900 s: nothing stored
    assert row_version(gw.conninfo, node.node_id) == before
    assert liveness.heard_at(node.node_id) is not None
    # A new applied generation is written at once (the control plane waits for it).
    assert gw.call(liveness.heartbeat(node.node_id, 4)) is True
    assert row_version(gw.conninfo, node.node_id)[0] != before[0]
    assert node_row(gw.conninfo, node.node_id)["applied_generation"] == 4
    session.close()


def test_the_sweeper_never_marks_a_node_whose_heartbeats_keep_arriving(
    quiet_gateway: GatewayThread, pool_id: str  # noqa: F811
) -> None:
    gw = quiet_gateway
    beating, s1 = connected(gw, pool_id, "gpu-01")
    silent, s2 = connected(gw, pool_id, "gpu-02")
    grace = 1.0
    liveness = Liveness(gw.gateway.pool, grace_seconds=grace, write_fraction=0.25)
    gw.call(liveness.hello(beating.node_id))
    stale = "UPDATE nodes SET last_seen = now() - interval '1 hour' WHERE id = ANY(%s)"
    swept: list[str] = []
    deadline = time.monotonic() + 30
    # Heartbeats keep coming for `beating` while both rows say an hour ago; sweeps run all along
    # (the first ones inside the start-up hold) until the silent node is swept.
    while silent.node_id not in swept:
        assert time.monotonic() < deadline, "the silent node was never swept"
        gw.call(liveness.heartbeat(beating.node_id, 0))
        sql(gw.conninfo, stale, ([beating.node_id, silent.node_id],))
        swept += gw.call(liveness.sweep())
        assert node_row(gw.conninfo, beating.node_id)["connectivity"] == "connected"
        time.sleep(0.05)
    assert beating.node_id not in swept
    # The sweep stored the freshest time of the beating node: the row no longer says an hour ago.
    age = sql(gw.conninfo, "SELECT extract(epoch FROM now() - last_seen)::float8 AS age FROM nodes WHERE id = %s",
              (beating.node_id,))[0]["age"]
    assert age < 60
    assert node_row(gw.conninfo, silent.node_id)["connectivity"] == "unreachable"
    s1.close()
    s2.close()


def test_a_node_that_stops_is_marked_unreachable_after_the_grace(
    quiet_gateway: GatewayThread, pool_id: str  # noqa: F811
) -> None:
    gw = quiet_gateway
    node, session = connected(gw, pool_id, "gpu-01")
    grace = 1.0
    liveness = Liveness(gw.gateway.pool, grace_seconds=grace, write_fraction=0.25)
    gw.call(liveness.hello(node.node_id))
    for _ in range(5):  # heartbeats for a while, stored by the rounds between them
        gw.call(liveness.heartbeat(node.node_id, 0))
        assert gw.call(liveness.sweep()) == []
        time.sleep(0.1)
    gw.call(liveness.heartbeat(node.node_id, 0))
    last_beat = time.monotonic()
    liveness.ended(node.node_id)  # its session ended: no more heartbeats
    deadline = last_beat + 30
    while not (swept := gw.call(liveness.sweep())):
        assert time.monotonic() < deadline, "the stopped node was never swept"
        time.sleep(0.05)
    assert swept == [node.node_id]
    assert time.monotonic() - last_beat >= grace
    assert node_row(gw.conninfo, node.node_id)["connectivity"] == "unreachable"
    assert liveness.heard_at(node.node_id) is None
    session.close()


def test_a_stopping_gateway_stores_each_nodes_last_heartbeat_and_releases_its_sessions_at_once(
    database: str, pool_id: str  # noqa: F811
) -> None:
    from tests.test_gateway import heartbeat

    gw = GatewayThread(database)  # the defaults: heartbeats write no row for 7.5 s
    try:
        node, session = connected(gw, pool_id, "gpu-01")
        liveness = gw.gateway.runner.liveness
        session.send(heartbeat(generation=0))
        # Written (the first heartbeat after a hello writes its row; applied_generation is 0 from
        # the start, so the row alone cannot tell the heartbeat was taken in).
        eventually(lambda: not liveness.writes(node.node_id, 0), what="the first heartbeat's write")
        first = liveness.heard_at(node.node_id)
        stored = node_row(gw.conninfo, node.node_id)["last_seen"]
        time.sleep(1.5)  # time passes between the two heartbeats (not a wait for nothing to happen)
        session.send(heartbeat(generation=0))
        eventually(lambda: liveness.heard_at(node.node_id) > first + 1, what="the second heartbeat")
        assert node_row(gw.conninfo, node.node_id)["last_seen"] == stored  # in memory only
        gw.stop()
        row = node_row(gw.conninfo, node.node_id)
        assert (row["last_seen"] - stored).total_seconds() >= 1.0  # the second heartbeat's time
        assert row["session_id"] is None and row["connectivity"] == "connected"
    finally:
        gw.stop()


def test_the_sweep_holds_after_start_and_while_sessions_wait_for_their_hello_never_longer_than_the_grace(
    quiet_gateway: GatewayThread, pool_id: str  # noqa: F811
) -> None:
    gw = quiet_gateway
    silent, session = connected(gw, pool_id, "gpu-01")
    now = [0.0]
    liveness = Liveness(gw.gateway.pool, grace_seconds=30, write_fraction=0.25, clock=lambda: now[0])
    stale = "UPDATE nodes SET last_seen = now() - interval '1 hour', connectivity = 'connected' WHERE id = %s"
    sql(gw.conninfo, stale, (silent.node_id,))
    assert gw.call(liveness.sweep()) == []  # up for less than the grace (a restart's reconnect storm)
    now[0] = 31.0
    token = liveness.arriving()  # a session came in; its hello is not in yet
    assert gw.call(liveness.sweep()) == []
    assert node_row(gw.conninfo, silent.node_id)["connectivity"] == "connected"
    liveness.arrived(token)
    assert gw.call(liveness.sweep()) == [silent.node_id]
    # A session that never says hello holds the sweep for the grace, no longer.
    sql(gw.conninfo, stale, (silent.node_id,))
    liveness.arriving()
    now[0] = 45.0
    assert gw.call(liveness.sweep()) == []
    now[0] = 62.0
    assert gw.call(liveness.sweep()) == [silent.node_id]
    session.close()
