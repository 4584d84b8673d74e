"""Taking something away, attacked as a hostile tenant (or an unlucky operator) would: a node's
certificates revoked, a token expired by the product clock, a pool offer withdrawn, a membership
removed, a webhook deleted, a policy tightened. Each must hold from the moment it is taken away,
not after a sweep (real servers on loopback, the real gateway with mutual TLS for nodes)."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import nodes_pb2_grpc as npb_grpc
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.nodes import connectivity
from controlplane.workers import pending
from tests.nodes_support import ControlPlane
from tests.test_gateway import (GatewayThread, Node, connected, cp, eventually, gateway,  # noqa: F401
                                join_token, node_row, pool_id, hello)
from tests.support import Client, World, rpc_error
from tests.test_pki import arun
from tests.test_watch import Stream, open_stream, reserve

# -- a revoked node -------------------------------------------------------------------------------


def _node_admin(cp: ControlPlane) -> npb_grpc.NodeAdminStub:
    return npb_grpc.NodeAdminStub(cp.root.channel)


def _only_node(cp: ControlPlane, gateway: GatewayThread, name: str, gpus: int = 2) -> tuple[Node, Any]:
    """A connected node in the control plane's pool, the pool's only one."""
    node, session = connected(gateway, cp.pool_id, name, gpus=gpus, uuid=f"GPU-{name}")
    return node, session


def test_a_revoked_node_is_unschedulable_at_once_and_again_once_readmitted_and_back(
        gateway: GatewayThread, cp: ControlPlane) -> None:
    """An operator revokes a stolen node (NodeAdmin, by node id): its atoms stayed bookable until
    the gateway's sweep marked it unreachable, so a create right after was placed on it. Now the
    revoke makes it unreachable in its own transaction: the next create is not placed there, the
    placed reservation on it is moved off (BookingRepair); readmitted, enrolled again and back, it is
    schedulable again and the waiting reservation is placed there."""
    node, session = _only_node(cp, gateway, "stolen")
    future = cp.create(count=1, start=cp.world.later())
    assert cp.get(future.id).state == "placed"
    assert [a.node_id for a in cp.get(future.id).allocations] == [node.node_id]

    revoked = _node_admin(cp).RevokeCertificates(
        npb.RevokeCertificatesRequest(node_id=node.node_id, reason="stolen"), metadata=cp.root.metadata)
    assert revoked.serials
    index = cp.server.app.runtime.capacity  # the placement index hears it with the revoke's commit
    cp.server.call(index.barrier())
    assert not index.pool(cp.pool_id).nodes[node.node_id].schedulable

    after = cp.create(count=1)
    cp.drain()
    after = cp.get(after.id)
    assert not after.allocations and after.state == "pending", after
    assert node_row(cp.conninfo, node.node_id)["connectivity"] == "unreachable"
    assert cp.get(future.id).state == "placed"  # as on a lost node: repaired before its start
    cp.advance(24 * 3_600_000 - 10 * 60_000)
    cp.drain()
    future = cp.get(future.id)  # BookingRepair moved it off the node: nowhere else to go
    assert future.state == "pending" and any(c.reason == "BookingRepairFailed" for c in future.conditions), (
        future.state, list(future.conditions), list(future.allocations))

    # Its session is ended by the gateway; a heartbeat it sent just before (taken in after the
    # revoke) or an operator cannot make it connected while it is revoked.
    assert session.ended() is not None
    assert not arun(cp.conninfo, lambda pool: connectivity.seen(pool, node.node_id, 1))
    with pytest.raises(grpc.RpcError) as refused:
        cp.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(
            node_id=node.node_id, connectivity="connected"))
    assert rpc_error(refused)[1:] == ("INVALID_STATE", {"nodeId": node.node_id})
    assert node_row(cp.conninfo, node.node_id)["connectivity"] == "unreachable"

    assert _node_admin(cp).ReadmitNode(npb.ReadmitNodeRequest(node_id=node.node_id),
                                       metadata=cp.root.metadata).readmitted
    assert node_row(cp.conninfo, node.node_id)["connectivity"] == "unreachable"  # not back yet
    node.enrol(join_token(gateway.conninfo, cp.pool_id, "stolen"))
    back = node.session()
    assert back.recv() is not None
    back.send(hello(gpus=2, uuid="GPU-stolen"))
    eventually(lambda: node_row(cp.conninfo, node.node_id)["connectivity"] == "connected", what="back")
    cp.server.call(pending.retry_pool(cp.server.app.runtime, cp.pool_id))  # the worker node_seen wakes
    future = cp.get(future.id)
    assert future.state == "placed" and [a.node_id for a in future.allocations if a.state != "released"] == [node.node_id], future
    cp.check_invariants()
    back.close()


# -- a token expired by the product clock ---------------------------------------------------------

HOUR = 3_600_000


def _whoami(client: Client, world: World) -> Any:
    return client.res("List", pb.ListReservationsRequest(tenant_id=world.tenant))


def test_a_token_expires_by_the_product_clock(clock_world: World) -> None:
    """Token expiry was judged by the wall clock (now()), not compute_now() (DESIGN "Time"): with
    the clock moved past a token's expiry, the token still worked and was still listed as live.
    Now the product clock judges it everywhere: authentication refuses it (UNAUTHENTICATED naming
    it), the live list leaves it out; a token minted after the move lives its whole TTL, and an
    absolute expiresAt is a time on that clock."""
    w = clock_world
    ident, client = w.identity()
    short = w.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="1h"))
    short_client = Client(w.endpoint, short.secret)
    _whoami(short_client, w)
    w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=HOUR + 1000))
    with pytest.raises(grpc.RpcError) as expired:
        _whoami(short_client, w)
    assert rpc_error(expired) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", {"tokenId": short.id})
    live = w.root.admin("ListTokens", apb.ListTokensRequest(identity_id=ident)).items
    assert short.id not in [t.id for t in live] and live
    _whoami(client, w)  # the identity's 30-day token still works

    now = w.root.admin("GetClock", apb.GetClockRequest()).now
    fresh = w.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="1h"))
    assert now + HOUR - 60_000 <= fresh.expires_at <= now + HOUR + 60_000
    at = w.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, expires_at=now + 2 * HOUR))
    assert at.expires_at == now + 2 * HOUR
    for token in (fresh, at):
        fresh_client = Client(w.endpoint, token.secret)
        _whoami(fresh_client, w)
        fresh_client.close()
    short_client.close()


def test_an_open_watch_stream_ends_when_the_clock_passes_its_tokens_expiry(clock_world: World) -> None:
    """A Watch stream's timer ran on the wall clock: with the product clock moved past its token's
    expiry, new calls with the token were refused but the open stream went on delivering events.
    Now moving the clock ends the streams of the tokens it expired, UNAUTHENTICATED, and a stream
    on a token that lives on keeps going."""
    w = clock_world
    reserve(w)  # a stored event, so an open stream has something to stream first
    ident, _ = w.identity()
    short = w.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="1h"))
    short_client = Client(w.endpoint, short.secret)
    doomed = open_stream(short_client, w)
    lasting = open_stream(w.user, w)
    w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=HOUR + 1000))
    with pytest.raises(grpc.RpcError) as ended:
        while True:
            doomed.take(1)  # events after the move may come first; then the end
    assert rpc_error(ended)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    later = reserve(w)
    while lasting.take(1)[0].subject != f"reservation/{later.id}":
        pass
    lasting.call.cancel()
    short_client.close()


# -- a policy tightened under an open stream -------------------------------------------------------


def test_an_open_watch_stream_stops_when_the_policy_no_longer_allows_it(world: World) -> None:
    """IAM was asked once, when the stream opened: after the tenant's admin tightened the policy
    so the identity may no longer read events, its open stream kept delivering new ones. Now each
    batch is decided on the policy read with it: the stream ends ACCESS_DENIED, before the event."""
    reserve(world)
    stream = open_stream(world.user, world)
    world.policy('permit(principal, action == Action::"compute:reservations:create", resource);')
    later = reserve(world)
    with pytest.raises(grpc.RpcError) as ended:
        while True:
            event = stream.take(1)[0]
            assert event.subject != f"reservation/{later.id}", "an event streamed after the policy denied it"
    assert rpc_error(ended)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")


# -- a token revoked while its stream reads -------------------------------------------------------


def test_a_token_revoked_while_its_stream_reads_gets_no_more_events(world: World) -> None:
    """The stream checked its token's revocation only when it waited for new events, or (through
    its send timer) while suspended in a send: revoked while it read a batch, it streamed that
    batch and every further one first. Now each batch read is checked: UNAUTHENTICATED, nothing
    streamed after the revocation."""
    import psycopg

    reserve(world)
    keeper = open_stream(world.user, world)  # keeps the hub's frontier fresh
    ident, client = world.identity()
    waiting = ("SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
               " AND wait_event_type = 'Lock' AND query LIKE %s")
    with psycopg.connect(world.conninfo) as holder, psycopg.connect(world.conninfo, autocommit=True) as probe:
        holder.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")  # the stream's read waits
        stream = Stream(client, tenant_id=world.tenant)
        until(lambda: probe.execute(waiting, ("%event_type_matches%",)).fetchall(), "the stream's read")
        world.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident))
        until(lambda: probe.execute(waiting, ("%pg_locks%",)).fetchall(), "the hub past the revocation")
        holder.rollback()
    with pytest.raises(grpc.RpcError) as ended:
        event = stream.take(1)[0]
        pytest.fail(f"streamed after its token was revoked: {event.type}")
    assert rpc_error(ended)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    keeper.call.cancel()
    client.close()


def until(check: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return result


def test_a_join_token_issued_before_a_nodes_revocation_is_void_after_its_readmission(
        gateway: GatewayThread, cp: ControlPlane) -> None:
    """A join token for the node's name, issued before the revocation and unspent (on the stolen
    disk, say), was refused while the node was revoked but not spent: once an operator readmitted
    the node for its rebuilt machine, the thief's token enrolled it. Revoking the node now voids
    its name's unspent join tokens; one issued after the revocation enrols it once readmitted."""
    node, session = _only_node(cp, gateway, "laptop", gpus=1)
    stale = join_token(gateway.conninfo, cp.pool_id, "laptop")
    _node_admin(cp).RevokeCertificates(npb.RevokeCertificatesRequest(node_id=node.node_id, reason="stolen"),
                                       metadata=cp.root.metadata)
    fresh = join_token(gateway.conninfo, cp.pool_id, "laptop")
    assert _node_admin(cp).ReadmitNode(npb.ReadmitNodeRequest(node_id=node.node_id),
                                       metadata=cp.root.metadata).readmitted
    with pytest.raises(grpc.RpcError) as refused:
        Node(gateway).enrol(stale)
    assert rpc_error(refused)[:2] == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert Node(gateway).enrol(fresh).node_id == node.node_id
    session.close()
