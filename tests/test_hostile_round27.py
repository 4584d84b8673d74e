"""Hostile review, round 27 (the lead's): enrolment tried by someone without a join token.

- **Guessing join tokens cost the gateway a transaction a guess, unpaced.** Enrol is the one
  gateway call without a client certificate, so nothing paced it: each call parsed the CSR bundle
  (two signatures checked) and ran a transaction looking the token up, as fast as one connection
  could send them. A refused enrolment (a wrong, spent or expired token; a bad CSR) now costs its
  peer address a token (`BC_ENROL_REFUSALS_PER_MINUTE`, `BC_ENROL_REFUSALS_BURST`), and an address
  with none left is refused QUOTA_EXCEEDED (`rate-limited`, `retryAfterSeconds`) before anything
  is parsed or read. Enrolments that succeed cost nothing, so a fleet behind one address enrols
  at its own pace. Real PostgreSQL, a real gateway over TLS, real CSRs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import grpc
import psycopg
import pytest
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc
from gateway.config import GatewaySettings
from gateway.tls import peer_address
from gateway.throttle import Throttle
from tests.support import rpc_error
from tests.test_gateway import GatewayThread, Node, connected, heartbeat, join_token, node_row, pool_id  # noqa: F401
from tests.test_gateway import eventually as until
from controlplane.pki.config import PkiSettings
from tests.test_pki import NodeKeys

BURST = 3


@pytest.fixture
def paced(database: str) -> Iterator[GatewayThread]:
    """A gateway allowing three refused enrolments per address, and one more an hour."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), enrol_refusals_per_minute=1 / 60,
                                                     enrol_refusals_burst=BURST))
    try:
        yield gw
    finally:
        gw.stop()


def _enrol(gw: GatewayThread, token: str, csr: bytes | None = None) -> pb.EnrolResponse:
    with grpc.secure_channel(gw.enrol_endpoint, grpc.ssl_channel_credentials(gw.ca_pem)) as ch:
        return node_pb2_grpc.NodeGatewayStub(ch).Enrol(
            pb.EnrolRequest(join_token=token, csr_pem=csr if csr is not None else NodeKeys().csr()), timeout=10)


def _refused(gw: GatewayThread, token: str, csr: bytes | None = None) -> tuple[grpc.StatusCode, str, dict]:
    with pytest.raises(grpc.RpcError) as refused:
        _enrol(gw, token, csr)
    return rpc_error(refused)


def test_an_address_guessing_join_tokens_is_refused_before_any_read(paced: GatewayThread, pool_id: str) -> None:
    good = join_token(paced.conninfo, pool_id, "honest")
    assert _refused(paced, "bcj_guess1")[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert _refused(paced, good, b"not a csr")[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT")
    assert _enrol(paced, good).node_id  # a success costs nothing: the address still has one refusal left
    assert _refused(paced, "bcj_guess2")[1] == "UNAUTHENTICATED"
    # Out of refusals: refused at once, with join_tokens locked (a read would wait past the deadline)
    # and a valid token too (the address is paced, not the token).
    another = join_token(paced.conninfo, pool_id, "later")
    with psycopg.connect(paced.conninfo) as holder:
        holder.execute("LOCK TABLE join_tokens IN ACCESS EXCLUSIVE MODE")
        for token in ("bcj_guess3", another):
            code, reason, details = _refused(paced, token)
            assert (code, reason, details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED",
                                                         "rate-limited")
            assert 3000 <= int(details["retryAfterSeconds"]) <= 3600
        holder.rollback()
    with psycopg.connect(paced.conninfo) as conn:
        spent = conn.execute("SELECT node_id FROM join_tokens WHERE node_id IS NOT NULL").fetchall()
    assert len(spent) == 1  # the refused valid token was not spent


def test_a_fleet_enrolling_from_one_address_is_not_paced(paced: GatewayThread, pool_id: str) -> None:
    nodes = [Node(paced) for _ in range(BURST * 3)]
    for i, node in enumerate(nodes):
        node.enrol(join_token(paced.conninfo, pool_id, f"fleet-{i}"))
    assert len({n.node_id for n in nodes}) == BURST * 3
    # and a lost answer asked again with the spent token is answered, not counted as refused
    token = join_token(paced.conninfo, pool_id, "retry")
    keys = NodeKeys()
    first = _enrol(paced, token, keys.csr())
    for _ in range(BURST + 1):
        assert _enrol(paced, token, keys.csr()).node_id == first.node_id


def test_the_refusal_memory_is_bounded() -> None:
    """Addresses by the hundred thousand (an IPv6 attacker's) cannot grow the gateway's memory: past
    `keep` buckets the full ones go, then the oldest."""
    throttle = Throttle(rate=1 / 3600, burst=2, keep=3)
    for key in ("a", "a", "b", "c"):
        throttle.debit(key)
    assert throttle.due("a") > 3000 and throttle.due("b") == 0.0  # b has one token left
    throttle.debit("d")  # a fourth address: the oldest ("a", none full) is forgotten
    assert throttle.due("a") == 0.0 and len(throttle._buckets) == 3
    throttle.debit("d")
    assert throttle.due("d") > 3000


class _Peer:
    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


@pytest.mark.parametrize("peer, address", [
    ("ipv4:10.1.2.3:5555", "10.1.2.3"),
    ("ipv6:[2001:db8:1:2:aaaa::7]:443", "2001:db8:1:2::/64"),  # one host has a /64 to rotate through
    ("ipv6:%5B2001:db8:1:2:bbbb::9%5D:443", "2001:db8:1:2::/64"),  # as newer gRPC writes it
    ("ipv6:[::ffff:10.1.2.3]:80", "10.1.2.3"),
    ("unix:/run/x.sock", "unix:/run/x.sock"),
])
def test_an_enrolment_is_paced_by_its_address(peer: str, address: str) -> None:
    assert peer_address(_Peer(peer)) == address  # type: ignore[arg-type]


# Free messages ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flood", [heartbeat, lambda generation: pb.NodeMessage()], ids=["same-generation", "empty"])
def test_a_node_flooding_messages_that_cost_no_transaction_is_paced(
        database: str, pool_id: str, flood: Callable[[int], pb.NodeMessage]) -> None:
    """A heartbeat that changes nothing, or a message of no known kind, cost no transaction and so
    took no token: a node could send them as fast as its link allowed and keep the gateway's event
    loop (every node's sessions) parsing them. Now they have a bucket of their own per node; past
    it the session's reader waits, and what the node sent after them waits behind them."""
    gw = GatewayThread(database, dataclasses.replace(GatewaySettings(), node_messages_per_second=0,
                                                     node_free_messages_per_second=1 / 3600,
                                                     node_free_messages_burst=10))
    try:
        with capture_logs() as logs:
            node, session = connected(gw, pool_id, "chatty")
            session.send(heartbeat(7))  # writes (a new generation): not a free one
            until(lambda: node_row(database, node.node_id)["applied_generation"] == 7, what="generation 7")
            for _ in range(10):
                session.send(flood(7))  # the burst: taken in at once
            session.send(heartbeat(8))  # costs a transaction: not paced by the free bucket
            until(lambda: node_row(database, node.node_id)["applied_generation"] == 8, what="generation 8")
            assert not [e for e in logs if e["event"] == "node throttled"]
            session.send(flood(8))  # past the burst: the reader waits an hour
            session.send(heartbeat(9))
            until(lambda: [e for e in list(logs) if e["event"] == "node throttled" and e["free"]], what="the wait")
        assert node_row(database, node.node_id)["applied_generation"] == 8
        session.close()
    finally:
        gw.stop()


# Renewals across gateways --------------------------------------------------------------------------

def test_renewals_are_bounded_across_gateways(database: str, pool_id: str) -> None:
    """Each gateway paces a node's renewals in its own memory, so a node renewing through every
    gateway in turn was issued certificates that many times as often. The issuance is now bounded
    per node in the database as well (BC_NODE_CERTS_PER_HOUR, the enrolment's pair counted): here
    two pairs an hour, with both gateways' own pacing off."""
    pki = dataclasses.replace(PkiSettings(), node_renewals_per_hour=2)
    settings = dataclasses.replace(GatewaySettings(), node_renewals_per_hour=0, pki=pki)
    one, two = GatewayThread(database, settings), GatewayThread(database, settings)
    try:
        node = Node(one)
        node.enrol(join_token(database, pool_id, "roamer"))  # the first pair of the hour
        keys = NodeKeys()
        with node.channel() as channel:
            renewed = node_pb2_grpc.NodeGatewayStub(channel).Renew(pb.RenewRequest(csr_pem=keys.csr()), timeout=10)
        node.keys = keys
        node.certified(renewed.certificate_pem)
        node.gateway = two
        with node.channel() as channel, pytest.raises(grpc.RpcError) as refused:
            node_pb2_grpc.NodeGatewayStub(channel).Renew(pb.RenewRequest(csr_pem=NodeKeys().csr()), timeout=10)
        code, reason, details = rpc_error(refused)
        assert (code, reason, details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", "rate-limited")
        assert 3000 <= int(details["retryAfterSeconds"]) <= 3600
        with node.channel() as channel:  # a lost answer asked again issues nothing: still answered
            again = node_pb2_grpc.NodeGatewayStub(channel).Renew(pb.RenewRequest(csr_pem=keys.csr()), timeout=10)
        assert again.certificate_pem == renewed.certificate_pem
        with psycopg.connect(database) as conn:
            assert conn.execute("SELECT count(*) FROM node_certs WHERE node_id = %s",
                                (node.node_id,)).fetchone()[0] == 4
    finally:
        one.stop()
        two.stop()
