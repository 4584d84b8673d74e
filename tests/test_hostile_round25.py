"""Hostile review, round 25 (the lead's own): what the sixth round's reading of the event hub found.

- **A policy change while the hub was disconnected streamed a whole batch.** A Watch stream
  decides again before its next event when the hub hears `bc_access_changed` (PutPolicy,
  RemoveMembership: round 24d). A notification sent while the hub's LISTEN connection is down is
  lost, and the reconnect re-checked revoked tokens but not access: a stream in the middle of a
  batch read before the change streamed the rest of it (up to 500 events) under the old policy.
  Now a reconnect has every stream decide again before its next event (event_hub._handle).
- **A node's inventories could keep its pool locked most of the time.** Round 25a made a 16,640-atom
  rewrite take about 2 s instead of 18 under the pool's lock, but an inventory still cost the node
  one token at the gateway however long it held the lock: at 50 messages a second a node claiming
  fresh uuids again and again kept every placement of its pool waiting. Now a hello or inventory
  is also charged the time it held the pool's lock (gateway.throttle.WORK_SHARE: the node then
  waits nine times as long), so a node keeps its pool busy at most about a tenth of the time.
- **Concurrent CreateNodeProfile calls passed the cap together** (round 25e's note): each counted
  the profiles committed before it. Creates now take one lock before they count (root only; the
  cap is what bounds the profiles table).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import psycopg
import pytest
from psycopg.types.json import Jsonb
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2 as npb
from controlplane import db, errors
from controlplane.config import Settings
from controlplane.metal import profiles
from controlplane.runtime import Runtime
from gateway.config import GatewaySettings
from gateway.throttle import WORK_SHARE, Throttle, TokenBucket
from tests.support import Client, ServerThread, World
from tests.test_gateway import GatewayThread, connected, hello, pool_id  # noqa: F401 - fixture
from tests.test_hostile_round24d import denied_within_what_was_in_flight, slow_reader
from tests.test_listen import kill_listener
from tests.test_pki import sql


def test_a_policy_changed_while_the_hub_was_disconnected_is_decided_before_the_next_event(
        world: World, stack: tuple[ServerThread, Client]) -> None:
    """Attack: a member about to lose the events reads its stream slowly; the policy that refuses
    it commits while the hub listens to nothing (written here without its notification, as one
    sent during the gap is lost), then the hub reconnects. The batch read before must not keep
    coming."""
    server, _ = stack
    ident, channel, call = slow_reader(world)
    try:
        world.sql("""
            INSERT INTO policies (tenant_id, cedar) VALUES (%(tenant)s, %(cedar)s)
            ON CONFLICT (tenant_id) DO UPDATE SET cedar = EXCLUDED.cedar, version = policies.version + 1
            """, {"tenant": world.tenant, "cedar": "permit(principal, action, resource);\n"
                  f'forbid(principal == Identity::"{ident}", action == Action::"compute:events:read", resource);'})
        kill_listener(server.conninfo, "event-hub")
        denied_within_what_was_in_flight(call, "the policy")
    finally:
        call.cancel()
        channel.close()


# -- a node's inventories paced by the time they hold its pool ------------------------------------


def test_work_charged_to_a_bucket_is_waited_for_before_the_next_message() -> None:
    now = [100.0]
    bucket = TokenBucket(10, 5, clock=lambda: now[0])
    assert bucket.take() == 0.0
    bucket.charge(20)  # 4 left, 20 charged: 16 below zero
    assert round(bucket.take(), 3) == 1.7  # (1 + 16) / 10
    throttle = Throttle(10, 1)
    throttle.charge("n", 0.5)  # held its pool half a second: (1 / WORK_SHARE - 1) times that to wait,
    assert throttle.wait("n") == pytest.approx(0.5 * (1 / WORK_SHARE - 1) - 0.1, abs=0.01)  # less its token
    throttle.charge("m", 0.001)  # what a message's token pays for costs nothing more
    assert throttle.wait("m") == 0.0
    off = Throttle(0, 1)
    off.charge("n", 100.0)
    assert off.wait("n") == 0.0  # rate 0: off


def test_a_nodes_next_message_waits_for_the_time_its_inventory_held_the_pool(database: str, pool_id: str) -> None:
    """Attack: a node of a time-slice pool at 64 replicas sends inventories of fresh GPU uuids
    (each rewrites thousands of slots under the pool's lock). Before, its next message waited only
    for its token (at 1,000 a second, nothing); now about nine times as long as the lock was held."""
    sql(database, "UPDATE pools SET policy = %s WHERE id = %s",
        (Jsonb({"sharing": {"mode": "time-slice", "replicas": 64}}), pool_id))
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=1000,
                                                     node_messages_burst=1))
    try:
        node, session = connected(gw, pool_id, "heavy", gpus=64, uuid="OLD")
        time.sleep(1 / WORK_SHARE)  # whatever the hello was charged is paid off
        with capture_logs() as logs:
            sent = time.monotonic()
            session.send(npb.NodeMessage(inventory=hello(gpus=64, uuid="FRESH").hello.inventory))
            session.send(npb.NodeMessage(report=npb.AttestedReport(body=b"\xff", key_id=node.key_id)))
            ack = session.recv("report_ack", timeout=120)
            acked = time.monotonic() - sent
        assert ack is not None
        [took_ms] = [e["took_ms"] for e in logs if e["event"] == "inventory"]
        assert took_ms > 20, f"the inventory held the lock {took_ms} ms: too little to tell a wait from noise"
        assert acked >= took_ms / 1000 * (1 / WORK_SHARE) * 0.8, (acked, took_ms)
        session.close()
    finally:
        gw.stop()


# -- the node profiles' cap under concurrent creates -----------------------------------------------


def test_concurrent_profile_creates_never_pass_the_cap(database: str) -> None:
    cap = 3

    async def scenario() -> list[object]:
        pool = await db.open_pool(database, size=8)
        try:
            rt = Runtime(pool, Settings(database_url=database, node_profiles_max=cap))
            # Every create waits on the table at its first read, then all go on at once.
            async with await psycopg.AsyncConnection.connect(database) as holder:
                await holder.execute("LOCK TABLE node_profiles IN ACCESS EXCLUSIVE MODE")
                creates = asyncio.gather(*(profiles.create(rt, f"cap-{i}", "") for i in range(8)),
                                         return_exceptions=True)
                await asyncio.sleep(0.5)
            return await creates
        finally:
            await pool.close()

    outcomes = asyncio.run(scenario())
    made = [o for o in outcomes if isinstance(o, dict)]
    refused = [o for o in outcomes if isinstance(o, errors.QuotaExceeded)]
    assert len(made) == cap and len(refused) == 8 - cap, outcomes
    assert sql(database, "SELECT count(*) AS n FROM node_profiles")[0]["n"] == cap
