"""Bounded storage of node reports, against a hostile node over a real session (mutual TLS, real
certificates and signatures, the real gateway, the real reservation worker).

A node may send about 50 messages a second. Its reports about an allocation that ended (released
or failed) are never judged, and every one was a row kept for ever: one genuine-but-hostile node
could write millions a day. Now an allocation holds at most node_unjudged_reports unjudged reports
(the rest are dropped, logged at a bounded rate), the worker keeps only what judging needs of the
judged ones, and the retention sweep deletes the reports of ended allocations after the window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Iterator

import psycopg
import pytest
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2 as pb
from controlplane import bootstrap
from controlplane.app import WORK_HANDLERS
from controlplane.config import Settings
from controlplane.nodes import reports
from controlplane.pki import attest
from controlplane.workers import pending, queue, report_retention
from gateway.config import GatewaySettings
from tests.nodes_support import ControlPlane
from tests.test_gateway import GatewayThread, Node, Session, binding, cdi_names, connected, cp  # noqa: F401
from tests.test_hostile_queue import release as release_reservation
from tests.test_hostile_spot import advance, waiting_for_a_lock
from tests.test_pki import sql
from tests.support import Client, ServerThread, World, clock_now, get, make_world

CAP = 8
_SEQUENCE = itertools.count(1)


@pytest.fixture
def gw(database: str) -> Iterator[GatewayThread]:
    """The gateway with the per-node throttle off (the flood goes as fast as the node sends) and a
    small cap of unjudged reports per allocation."""
    gateway = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=0,
                                                          node_unjudged_reports=CAP))
    try:
        yield gateway
    finally:
        gateway.stop()


def report(node: Node, conninfo: str, allocation_id: str, kind: str, devices: list[str] | None = None
           ) -> pb.NodeMessage:
    """The node's signed report about the allocation, newer than all it sent before (bound: naming
    the allocation's devices, or `devices`)."""
    body = pb.Report(node_id=node.node_id, sequence=next(_SEQUENCE), time=int(time.time() * 1000))
    if kind == "bound":
        body.bound.CopyFrom(pb.AllocationBound(allocation_id=allocation_id,
                                               cdi_devices=devices or cdi_names(conninfo, allocation_id)))
    else:
        body.released.CopyFrom(pb.AllocationReleased(allocation_id=allocation_id, reason="unassigned"))
    return node.report(body.SerializeToString())


def send(session: Session, messages: list[pb.NodeMessage]) -> list[int]:
    """Send the reports; their acks' outcomes, in order."""
    for message in messages:
        session.send(message)
    return [session.recv("report_ack", timeout=60).outcome for _ in messages]


def rows(conninfo: str, allocation_id: str) -> int:
    return sql(conninfo, "SELECT count(*) AS n FROM node_reports WHERE allocation_id = %s", (allocation_id,))[0]["n"]


def active(gw: GatewayThread, cp: ControlPlane, node: Node, session: Session) -> tuple[str, str]:  # noqa: F811
    """A reservation the node bound over its session; (reservation id, allocation id)."""
    rid, aid = binding(cp)
    assert send(session, [report(node, gw.conninfo, aid, "bound")]) == [pb.REPORT_STORED]
    cp.drain()
    assert cp.get(rid).state == "active"
    return rid, aid


def release(cp: ControlPlane, rid: str) -> None:  # noqa: F811
    release_reservation(cp.world, rid)
    cp.drain()


def test_thousands_of_reports_about_an_ended_allocation_leave_a_bounded_number_of_rows(
        gw: GatewayThread, cp: ControlPlane) -> None:  # noqa: F811
    node, session = connected(gw, cp.pool_id, "hostile")
    rid, aid = active(gw, cp, node, session)
    evidence = sql(gw.conninfo, "SELECT bound_report, bound_sig FROM allocations WHERE id = %s", (aid,))[0]
    release(cp, rid)
    assert sql(gw.conninfo, "SELECT state FROM allocations WHERE id = %s", (aid,))[0]["state"] == "released"
    sent = 2000
    with capture_logs() as logs:
        outcomes = send(session, [report(node, gw.conninfo, aid, kind)
                                  for kind in itertools.islice(itertools.cycle(["released", "bound"]), sent)])
    assert outcomes == [pb.REPORT_STORED] * CAP + [pb.REPORT_IGNORED] * (sent - CAP)
    cp.drain()  # nothing judges them: the allocation ended
    assert rows(gw.conninfo, aid) == 1 + CAP  # its judged bound report, and the cap
    dropped = [e for e in logs if e["event"].startswith("node reports dropped")]
    assert len(dropped) == 1 and dropped[0]["allocation_id"] == aid and dropped[0]["cap"] == CAP
    # The evidence its binding relied on is on the allocation, untouched.
    assert sql(gw.conninfo, "SELECT bound_report, bound_sig FROM allocations WHERE id = %s", (aid,))[0] == evidence
    # The node still binds, releases and binds again its other allocations as before.
    rid2, aid2 = active(gw, cp, node, session)
    assert send(session, [report(node, gw.conninfo, aid2, "released")]) == [pb.REPORT_STORED]
    cp.drain()
    assert any(c.reason == "BindingLost" for c in cp.get(rid2).conditions)
    assert send(session, [report(node, gw.conninfo, aid2, "bound")]) == [pb.REPORT_STORED]
    cp.drain()
    again = cp.get(rid2)
    assert again.state == "active" and not any(c.reason == "BindingLost" for c in again.conditions)
    session.close()


def test_a_live_allocations_judged_reports_are_pruned_to_what_judging_needs(
        gw: GatewayThread, cp: ControlPlane) -> None:  # noqa: F811
    """A node releasing and binding a live allocation in a loop: every report is judged and
    accepted, and each was a row kept for ever. Now only the newest JUDGED_KEPT judged ones stay
    (and the newest accepted per certificate and kind), and a replay of a report pruned long ago
    is still refused, even past more rejected reports than are kept: the newest accepted one per
    certificate and kind stays."""
    node, session = connected(gw, cp.pool_id, "flapper")
    rid, aid = active(gw, cp, node, session)
    first = sql(gw.conninfo, "SELECT body, key_id, signature FROM node_reports WHERE allocation_id = %s", (aid,))[0]
    for _ in range(15):
        batch = [report(node, gw.conninfo, aid, kind) for kind in ("released", "bound") * 3]
        assert send(session, batch) == [pb.REPORT_STORED] * len(batch)
        cp.drain()
        assert rows(gw.conninfo, aid) <= reports.JUDGED_KEPT + 2
    verdicts = sql(gw.conninfo, "SELECT verdict FROM node_reports WHERE allocation_id = %s", (aid,))
    assert {v["verdict"] for v in verdicts} == {"accepted"}
    assert cp.get(rid).state == "active"
    # More rejected reports than are kept (bound, naming devices not the allocation's: the binding
    # is lost): the newest accepted ones stay all the same.
    for _ in range(3):
        wrong = [report(node, gw.conninfo, aid, "bound", ["bcd.dev/gpu=GPU-X"]) for _ in range(CAP)]
        assert send(session, wrong) == [pb.REPORT_STORED] * CAP
        cp.drain()
    assert any(c.reason == "BindingLost" for c in cp.get(rid).conditions)
    assert rows(gw.conninfo, aid) <= reports.JUDGED_KEPT + 2
    # A compromised gateway stores the node's first bound report again: still a replay.
    sql(gw.conninfo, "INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)"
                     " VALUES (%s, %s, 'bound', %s, %s, %s)", (node.node_id, aid, first["body"], first["key_id"],
                                                              first["signature"]))
    sql(gw.conninfo, "SELECT wake_reservation(%s)", (rid,))
    cp.drain()
    newest = sql(gw.conninfo, "SELECT verdict FROM node_reports WHERE allocation_id = %s ORDER BY id DESC LIMIT 1",
                 (aid,))
    assert newest == [{"verdict": f"rejected: {attest.REPLAYED}"}]
    assert any(c.reason == "BindingLost" for c in cp.get(rid).conditions)  # the replay bound nothing
    session.close()


def test_the_retention_sweep_deletes_the_reports_of_allocations_ended_past_the_window(
        gw: GatewayThread, cp: ControlPlane) -> None:  # noqa: F811
    node, session = connected(gw, cp.pool_id, "sweep")
    ended_rid, ended = active(gw, cp, node, session)
    release(cp, ended_rid)
    assert send(session, [report(node, gw.conninfo, ended, "released") for _ in range(3)]) == [pb.REPORT_STORED] * 3
    _, live = active(gw, cp, node, session)
    recent_rid, recent = active(gw, cp, node, session)
    release(cp, recent_rid)
    window_s = cp.server.app.runtime.settings.report_retention_hours * 3600
    # The window passes for the first two allocations' reports (wall-clock: received_at).
    sql(gw.conninfo, "UPDATE node_reports SET received_at = received_at - %s * interval '1 second'"
                     " WHERE allocation_id = ANY(%s)", (window_s + 60, [ended, live]))
    evidence = sql(gw.conninfo, "SELECT bound_report FROM allocations WHERE id = %s", (ended,))[0]["bound_report"]
    assert cp.server.call(report_retention.expire(cp.server.app.runtime)) == 4
    assert rows(gw.conninfo, ended) == 0
    assert rows(gw.conninfo, live) == 1  # a live allocation's stay, however old
    assert rows(gw.conninfo, recent) == 1  # ended within the window
    assert sql(gw.conninfo, "SELECT bound_report FROM allocations WHERE id = %s", (ended,))[0]["bound_report"] \
        == evidence
    session.close()


# The pending retry's clock (not node reports: the second task of the same review) --------------

@pytest.fixture
def one_node(database: str) -> Iterator[tuple[ServerThread, World]]:
    """A control plane with clock control and no background workers (the test runs the pending
    retry itself), a tenant and a pool of one 8-GPU node."""
    server = ServerThread(database, Settings(database_url=database, clock_control=True), workers=False)
    root = Client(server.endpoint, bootstrap.ensure_root(database))
    w = make_world(server.endpoint, root, database, nodes=1)
    try:
        yield server, w
    finally:
        w.close()
        root.close()
        server.stop()


def test_a_pending_retry_that_waited_for_its_locks_places_the_window_at_the_clock_under_them(
        one_node: tuple[ServerThread, World]) -> None:
    """The retry planned at the clock read when it began; while it waited for the locks the clock
    moved on two minutes, and the re-placed window began two minutes before its placement. Now, as
    inline create and the lease batch do, it reads the clock once the locks are held."""
    server, w = one_node
    first = w.create(count=8)
    waiting = w.create(count=8)
    assert waiting.state == "pending", waiting.state
    release_reservation(w, first.id)
    while server.call(queue.run_one(server.app.runtime, WORK_HANDLERS)):
        pass
    with psycopg.connect(w.conninfo) as blocker, blocker.transaction():
        blocker.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (waiting.id,))
        retry = asyncio.run_coroutine_threadsafe(pending.retry_pool(server.app.runtime, w.pool_id), server.loop)
        waiting_for_a_lock(w)  # the retry planned, took the pool lock, and waits for the row
        advance(w, 120_000)
        placed_from = clock_now(w)
    assert retry.result(60) == 1
    placed = get(w, waiting.id)
    assert placed.state in ("placed", "binding"), placed.state
    assert placed.during.start >= placed_from, placed_from - placed.during.start
    assert placed.during.end == placed.during.start + 3_600_000
