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

What held (kept here so it stays held):

- (filled in below)
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc
from controlplane.pki import admin
from controlplane.pki.config import PkiSettings
from gateway.config import GatewaySettings
from tests.test_gateway import GatewayThread, Node, enrolled, eventually, heartbeat, hello, node_row, pool_id  # noqa: F401
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
