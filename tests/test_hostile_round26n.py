"""Hostile review, round 26n: a node session over the gateway, tried as a hostile or broken node and
as faults would.

Holes found and fixed:

- **A node that reads nothing kept a superseded or revoked session alive, applying what it sent.**
  The session re-checked itself (newest session? certificate good?) in the loop that writes to
  the node; a node that reads none of its stream fills the window with a few hundred report acks,
  every write then waits, and no re-check ran: after a newer session took over (or the
  certificate was revoked) the old session's heartbeats, hellos, inventories and reports were
  still applied for as long as the node kept the stream open. The re-check now has a task of its
  own; its verdict stops the reader and releases the session before the node is told.
- **A gateway whose clock runs ahead let a session outlive its certificate.** The re-check at the
  certificate's end is timed by the gateway's clock, judged by the database's: when it came early
  the certificate was still good, and no re-check came after. A good re-check now arms the next
  at the end the database's clock gives.
- **A node opening session streams by the hundred cost a database read each, unpaced.** Streams
  are cheap to open on one connection; each read the node's certificate before the node's turn
  was looked at, and then waited its turn in a task of its own. The turn is now taken first (the
  node named by its TLS-verified certificate), and an open that would wait more than 10 s is
  refused (RESOURCE_EXHAUSTED, rate-limited, retryAfterSeconds); Renew is paced the same way
  before its read (a refused renewal read the certificate first).
- **A replaced session's hello or inventory landed over the newer session's.** Between a newer
  session registering (on any gateway) and the old one hearing of it, the old session's hello or
  inventory was applied after the newer one had spoken: a GPU list the machine no longer has,
  capabilities its daemon no longer advertises. They are now applied only while their session is
  the node's newest, read under the node's row lock that registering takes too (CONFLICT: the
  old session ends ABORTED).

What held (kept here so it stays held):

- A gateway process killed (-9) just after a node sent a bound report: the node sends it again on
  another gateway, it is stored once (STORED or REPLAYED), judged once, and the reservation is
  active; the node is connected on its new session, and a node of the dead gateway that never
  comes back is marked unreachable by the living gateway's sweep.
- A node's session moving from gateway A to B: the old session ends ABORTED; its unregister,
  A's sweeps (which store its last heartbeat once, then forget it) and A's shutdown leave B's
  session registered, the node connected and B's heartbeats applied.
- A certificate revoked by serial (not the node) while its inventory waits for the pool's lock:
  the session ends UNAUTHENTICATED and the inventory's wait is cancelled, none of it applied.
- A certificate revoked after it was read good but before its session joined the hub (its
  notification unheard): the session's own registration wakes it to check itself, and it ends.
- Heartbeats with an absurd applied generation (int64's bounds, negative, far ahead of the
  desired one) are stored as said and change nothing else: nothing that decides reads them.
"""

from __future__ import annotations

import dataclasses
import pathlib
import queue
import time
from collections.abc import Iterator

import grpc
import psycopg
import pytest

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc
from controlplane.pki import admin
from controlplane.pki.config import PkiSettings
from gateway.config import GatewaySettings
from tests.nodes_support import ControlPlane
from tests.test_gateway import (GatewayThread, Node, binding, cdi_names, connected, enrolled, eventually, inventory_waiting,  # noqa: F401
                                gateway, gateway_process, heartbeat, hello, join_token, node_row, pool_id)
from tests.test_pki import arun, sql


class Deaf:
    """A session whose node sends and never reads: once the gateway's writes fill the stream's
    window, every write the gateway makes waits for the node."""

    def __init__(self, node: Node) -> None:
        creds = grpc.ssl_channel_credentials(node.gateway.ca_pem, node.key_pem(), node.cert_pem)
        self.channel = grpc.secure_channel(node.gateway.endpoint, creds, options=[("grpc.http2.bdp_probe", 0)])
        self.outbox: queue.Queue[pb.NodeMessage | None] = queue.Queue()
        self.call = node_pb2_grpc.NodeGatewayStub(self.channel).Session(iter(self.outbox.get, None), timeout=300)

    def send(self, message: pb.NodeMessage) -> None:
        self.outbox.put(message)

    def close(self) -> None:
        self.outbox.put(None)
        self.call.cancel()
        self.channel.close()


def stalled(gw: GatewayThread, pool: str, name: str) -> tuple[Node, Deaf]:
    """A node that said hello, then sent reports whose acks (with the longest key id) are far more
    than its stream's window holds, reading none: the session's writer waits on the node."""
    node = enrolled(gw, pool, name)
    deaf = Deaf(node)
    deaf.send(hello(uuid=f"GPU-{name}"))
    for i in range(3000):
        deaf.send(pb.NodeMessage(report=pb.AttestedReport(body=b"\xff" + i.to_bytes(2, "big"), key_id="k" * 128)))
    deaf.send(heartbeat(41))  # read once every report before it was dealt with
    eventually(lambda: node_row(gw.conninfo, node.node_id)["applied_generation"] == 41, timeout=60,
               what="the reports dealt with")
    return node, deaf


def sessions_of(gw: GatewayThread, node_id: str) -> int:
    return len(gw.gateway.runner.hub.sessions(node_id))


@pytest.fixture
def quiet_gateway(database: str) -> Iterator[GatewayThread]:
    """Unthrottled, with room for every ack (the reader never waits for the writer)."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=0,
                                                     node_unsent_acks=100_000))
    try:
        yield gw
    finally:
        gw.stop()


def test_a_superseded_session_that_reads_nothing_ends_and_applies_nothing_more(
        quiet_gateway: GatewayThread, pool_id: str) -> None:
    gw = quiet_gateway
    node, old = stalled(gw, pool_id, "stall-new")
    try:
        new = node.session()
        assert new.recv() is not None  # registered: the old session must end
        eventually(lambda: sessions_of(gw, node.node_id) == 1, timeout=30, what="the old session ended")
        old.send(heartbeat(99))  # nobody reads it any more
        new.send(heartbeat(7))
        eventually(lambda: node_row(gw.conninfo, node.node_id)["applied_generation"] == 7, what="the new heartbeat")
        new.send(hello(uuid="GPU-stall-new", version="bcd fresh"))
        eventually(lambda: node_row(gw.conninfo, node.node_id)["daemon_version"] == "bcd fresh", what="the new hello")
        assert node_row(gw.conninfo, node.node_id)["applied_generation"] == 7
        new.close()
    finally:
        old.close()


def test_a_revoked_session_that_reads_nothing_ends_and_stores_nothing_more(
        quiet_gateway: GatewayThread, pool_id: str) -> None:
    gw = quiet_gateway
    node, deaf = stalled(gw, pool_id, "stall-revoked")
    try:
        arun(gw.conninfo, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "stolen"))
        eventually(lambda: sessions_of(gw, node.node_id) == 0, timeout=30, what="the revoked session ended")
        eventually(lambda: node_row(gw.conninfo, node.node_id)["session_id"] is None, what="unregistered")
        deaf.send(heartbeat(77))  # its reader is gone: nobody takes it in
        assert node_row(gw.conninfo, node.node_id)["applied_generation"] == 41
    finally:
        deaf.close()


def test_a_session_ends_when_the_databases_clock_says_its_certificate_ran_out(database: str, pool_id: str) -> None:
    """The gateway re-checks a session when its own clock says the certificate ran out; the
    database's clock judges. With the gateway's clock ahead (here: the database's record of the
    certificate moved 6 s later once the session began, which is the same to the check), the one re-check found the
    certificate good and none came after: the session outlived its certificate for ever."""
    gw = GatewayThread(database, GatewaySettings(pki=PkiSettings(node_cert_hours=10 / 3600)))
    try:
        node = enrolled(gw, pool_id, "skewed")
        session = node.session()
        assert session.recv() is not None  # identified: the gateway took the certificate's end
        sql(database, "UPDATE node_certs SET not_after = not_after + interval '6 seconds' WHERE node_id = %s",
            (node.node_id,))
        ended = session.ended(timeout=60)
        assert ended is not None and ended.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "expired" in ended.details()
        assert sql(database, "SELECT now() >= max(not_after) AS past FROM node_certs WHERE node_id = %s",
                   (node.node_id,))[0]["past"]
    finally:
        gw.stop()


def test_a_gateway_killed_with_a_report_in_flight_loses_nothing_and_applies_nothing_twice(
        database: str, tmp_path: pathlib.Path) -> None:
    """A real gateway process killed (-9) just after a node sent its bound report: the node, which
    keeps a report until its ack, reconnects to another gateway and sends it again. Stored once,
    judged once, the reservation active; the node connected on its new session; another node of
    the dead gateway that never comes back is marked unreachable by the living one."""
    cp = ControlPlane(database)
    proc, remote = gateway_process(database, tmp_path)
    other = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_grace_seconds=3, sweep_seconds=0.5))
    try:
        node, gone = Node(remote), Node(remote)
        node.enrol(join_token(database, cp.pool_id, "survivor"))
        gone.enrol(join_token(database, cp.pool_id, "gone"))
        session, lost = node.session(), gone.session()
        for n, s in ((node, session), (gone, lost)):
            assert s.recv() is not None
            s.send(hello(uuid=f"GPU-{n.node_id}"))
            eventually(lambda n=n: node_row(database, n.node_id)["connectivity"] == "connected", what="hello")
        rid, aid = binding(cp, count=4)
        owner = sql(database, "SELECT node_id FROM allocations WHERE id = %s", (aid,))[0]["node_id"]
        sender = node if owner == node.node_id else gone
        s_from = session if sender is node else lost
        body = pb.Report(node_id=sender.node_id, sequence=int(time.time() * 1000), time=int(time.time() * 1000),
                         bound=pb.AllocationBound(allocation_id=aid, cdi_devices=cdi_names(database, aid)))
        report = sender.report(body.SerializeToString())
        s_from.send(report)
        proc.kill()  # -9, the report in flight
        proc.wait(timeout=30)
        assert s_from.ended() is not None
        sender.gateway = other
        again = sender.session()
        assert again.recv() is not None
        again.send(hello(uuid=f"GPU-{sender.node_id}"))
        again.send(report)  # never acknowledged: sent again
        ack = again.recv("report_ack")
        assert ack.outcome in (pb.REPORT_STORED, pb.REPORT_REPLAYED)
        rows = sql(database, "SELECT body FROM node_reports WHERE allocation_id = %s", (aid,))
        assert [bytes(r["body"]) for r in rows] == [report.report.body]
        cp.drain()
        assert cp.get(rid).state == "active"
        row = node_row(database, sender.node_id)
        assert (row["connectivity"], row["session_gateway"]) == ("connected", other.settings.gateway_id)
        stranded = gone if sender is node else node

        def swept() -> bool:
            again.send(heartbeat(1))  # the survivor keeps talking
            return node_row(database, stranded.node_id)["connectivity"] == "unreachable"

        eventually(swept, timeout=30, what="the node of the dead gateway that never came back marked unreachable")
        assert node_row(database, sender.node_id)["connectivity"] == "connected"
        cp.check_invariants()
        again.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        other.stop()
        cp.stop()


def test_a_superseded_sessions_end_and_its_gateways_sweeps_leave_the_newer_session_alone(
        database: str, pool_id: str) -> None:
    """The node's session moves from gateway A to B. A's old session ends; its unregister, A's
    sweeps (which store its last heartbeat once, then forget it) and A's shutdown (which
    unregisters every session of A) leave B's session registered and the node connected."""
    a, b = (GatewayThread(database, dataclasses.replace(GatewaySettings(), node_grace_seconds=3, sweep_seconds=0.3))
            for _ in range(2))
    try:
        node = enrolled(a, pool_id, "mover")
        old = node.session()
        assert old.recv() is not None
        old.send(hello(uuid="GPU-mover"))
        old.send(heartbeat(3))
        eventually(lambda: node_row(database, node.node_id)["applied_generation"] == 3, what="heard on A")
        node.gateway = b
        new = node.session()
        assert new.recv() is not None
        ended = old.ended()
        assert ended is not None and ended.code() == grpc.StatusCode.ABORTED
        registered = node_row(database, node.node_id)["session_id"]

        def forgotten_by_a() -> bool:
            new.send(heartbeat(4))  # the node goes on talking, to B
            return a.gateway.runner.liveness.heard_at(node.node_id) is None

        eventually(forgotten_by_a, what="A's sweep storing the old session's last heartbeat and forgetting it")
        a.stop()  # unregisters A's sessions: none of this node's
        row = node_row(database, node.node_id)
        assert (row["session_id"], row["session_gateway"]) == (registered, b.settings.gateway_id)
        assert row["connectivity"] == "connected" and row["applied_generation"] == 4
        sql(database, "SELECT bump_desired(%s)", (node.node_id,))
        assert new.recv().generation == 1  # still served
        new.close()
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("generation", [2**63 - 1, -(2**63), -1, 10**12])
def test_a_heartbeat_with_an_absurd_applied_generation_is_stored_and_changes_nothing_else(
        quiet_gateway: GatewayThread, pool_id: str, generation: int) -> None:
    """The applied generation is the node's word about itself, read by nothing that decides:
    far ahead of the desired one, negative or int64's bounds, it is stored as said; the session
    goes on and the desired state it is pushed keeps its own generation."""
    gw = quiet_gateway
    node = enrolled(gw, pool_id, f"absurd-{abs(generation) % 997}")
    session = node.session()
    assert session.recv().generation == 0
    session.send(hello(uuid=f"GPU-absurd-{abs(generation) % 997}"))
    session.send(heartbeat(generation))
    eventually(lambda: node_row(gw.conninfo, node.node_id)["applied_generation"] == generation, what="stored")
    assert node_row(gw.conninfo, node.node_id)["desired_generation"] == 0
    sql(gw.conninfo, "SELECT bump_desired(%s)", (node.node_id,))
    assert session.recv().generation == 1
    session.close()


def test_a_node_opening_sessions_by_the_hundred_is_refused_before_any_database_read(
        database: str, pool_id: str) -> None:
    """Session streams are cheap to open (one connection, one handshake, a few bytes each), and each
    read the node's certificate from the database before the node's turn was looked at: a node
    opening hundreds at once cost a read each, and each then waited its turn in a task of its own.
    Now the turn is taken first (the node named by its certificate, which TLS verified against the
    CA), and an open that would wait long is refused (RESOURCE_EXHAUSTED, rate-limited)."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=0.001,
                                                     node_messages_burst=2))
    calls: list[Deaf] = []
    try:
        node = enrolled(gw, pool_id, "opener")
        before = gw.gateway.pool.get_stats()["requests_num"]
        calls = [Deaf(node) for _ in range(60)]

        def refused() -> list[Deaf]:
            return [c for c in calls if c.call.done() and c.call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]

        eventually(lambda: len(refused()) >= 58, what="the opens past the node's turn refused")
        assert all("rate-limited" in str(c.call.trailing_metadata()) or c.call.details() for c in refused())
        assert gw.gateway.pool.get_stats()["requests_num"] - before < 40  # not a read per refused open
    finally:
        for c in calls:
            c.close()
        gw.stop()


def test_a_certificate_revoked_while_its_inventory_waits_for_the_pool_applies_none_of_it(
        gateway: GatewayThread, pool_id: str) -> None:
    """Only the session's certificate is revoked (by serial, not the node) while its inventory waits
    for the pool's lock: the session ends UNAUTHENTICATED and the inventory is never applied (the
    inventory's own check reads the node's revocation only)."""
    node, session = connected(gateway, pool_id, "leaky", uuid="GPU-LEAKY")
    serial = sql(gateway.conninfo, "SELECT serial FROM node_certs WHERE node_id = %s AND usage = 'tls'",
                 (node.node_id,))[0]["serial"]
    stale = hello(uuid="GPU-AFTER").hello.inventory
    with inventory_waiting(gateway, pool_id, session, stale):
        arun(gateway.conninfo, lambda pool: admin.revoke_certificates(pool, "", serial, "key leaked"))
        ended = session.ended()
        assert ended is not None and ended.code() == grpc.StatusCode.UNAUTHENTICATED
        eventually(lambda: not sql(gateway.conninfo, "SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
                                                     " AND NOT granted"), what="the inventory's wait cancelled")
    stored = node_row(gateway.conninfo, node.node_id)["inventory"]
    assert sorted(g["uuid"] for g in stored["gpus"]) == [f"GPU-LEAKY-{i}" for i in range(4)]


def test_a_certificate_revoked_before_its_session_registered_ends_the_session(
        gateway: GatewayThread, pool_id: str) -> None:
    """The certificate was read good, then revoked before the session joined the gateway's hub: the
    revocation's notification came when no session of the node was there to hear it (written here
    without its notification, which stands for that). Held: the session's own registration wakes
    the node's sessions, itself included, so it checks itself once registered and ends."""
    node = enrolled(gateway, pool_id, "early")
    serial = sql(gateway.conninfo, "SELECT serial FROM node_certs WHERE node_id = %s AND usage = 'tls'",
                 (node.node_id,))[0]["serial"]
    with psycopg.connect(gateway.conninfo) as conn, conn.transaction():
        conn.execute("SELECT 1 FROM nodes WHERE id = %s FOR UPDATE", (node.node_id,))  # the registering waits
        session = node.session()
        eventually(lambda: sql(gateway.conninfo, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                                 " AND query LIKE '%%SET session_id%%'"),
                   what="the session registering")
        sql(gateway.conninfo, "INSERT INTO revocations (serial, reason) VALUES (%s, 'stolen')", (serial,))
    ended = session.ended()
    assert ended is not None and ended.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in ended.details()


def test_a_hello_or_inventory_of_a_session_a_newer_one_replaced_is_never_applied(
        gateway: GatewayThread, pool_id: str) -> None:
    """A newer session of the node registered (on another gateway) and its notification has not
    reached this gateway yet: it is written here without one, which stands for that window (the
    old session hears of it a moment later, and ends). Meanwhile what the old session sends was
    applied over what the newer one said: an inventory the machine no longer has. Now a hello or
    inventory is applied only while its session is the node's newest (read under the node's row
    lock, which registering a session takes too); otherwise the session ends ABORTED."""
    node, old = connected(gateway, pool_id, "replaced", uuid="GPU-NOW")
    sql(gateway.conninfo, "UPDATE nodes SET session_id = 'sess_newer', session_gateway = 'elsewhere' WHERE id = %s",
        (node.node_id,))
    old.send(pb.NodeMessage(inventory=hello(uuid="GPU-STALE").hello.inventory))
    old.send(hello(uuid="GPU-STALE", version="bcd stale"))
    ended = old.ended()
    assert ended is not None and ended.code() == grpc.StatusCode.ABORTED
    row = node_row(gateway.conninfo, node.node_id)
    assert sorted(g["uuid"] for g in row["inventory"]["gpus"]) == [f"GPU-NOW-{i}" for i in range(4)]
    assert row["daemon_version"] != "bcd stale" and row["session_id"] == "sess_newer"


