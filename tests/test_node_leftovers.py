"""Node-side leftovers of the hostile reviews: a node flipping its inventory or capabilities in a
loop woke its pool's pending retry once per message (and a stream of wake-ups held off every
pool's 30-second safety net); an extend added time on a node taken out of service. Real servers on
loopback, the real gateway with mutual TLS, the real pending worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import psycopg
import pytest
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2 as npb
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import nodes_pb2 as nodes_pb
from bettercompute.v1 import nodes_pb2_grpc as npb_grpc
from bettercompute.v1 import reservations_pb2 as rpb
from tests.nodes_support import ControlPlane
from tests.support import get, make_world, refused
from tests.test_gateway import (GatewayThread, _bound_body, binding, cdi_names, connected, cp,  # noqa: F401
                                eventually, gateway, hello, node_row)
from tests.test_pki import sql

WAKE_S = 1.0  # the pool's pacing in these tests


@pytest.fixture
def paced(database: str) -> Iterator[ControlPlane]:
    """The control plane with its workers, pending wake-ups paced at WAKE_S, and no 30-second
    retry to hide a lost wake-up."""
    control = ControlPlane(database, workers=True, pending_retry_seconds=3600, pending_wake_seconds=WAKE_S)
    try:
        yield control
    finally:
        control.stop()


def _retries(logs: list[dict[str, Any]], pool_id: str) -> int:
    return sum(1 for e in list(logs) if e["event"] == "pending retried" and e.get("pool_id") == pool_id)


def _flip(i: int, generation: int) -> npb.NodeMessage:
    """The i-th flip: a fifth GPU there or not, and the kubernetes capability on or off, in turn."""
    caps = ("devices.limits", "binding.kubernetes") if i // 2 % 2 else ("devices.limits",)
    message = hello(gpus=4 + i % 2, caps=caps, uuid="GPU-flip")
    message.hello.inventory.generation = generation
    return message


# -- a node flipping its inventory ------------------------------------------------------------------

def test_the_pacer_retries_a_pool_at_most_once_an_interval_and_never_drops_the_last_wake_up() -> None:
    from controlplane.workers.pending import COALESCE_SECONDS, Pacer

    now = [100.0]
    pacer = Pacer(2.0, clock=lambda: now[0])
    pacer.wake("a")
    assert pacer.take_due() == [] and pacer.next_due() == 100.0 + COALESCE_SECONDS  # a burst coalesces
    now[0] += COALESCE_SECONDS
    assert pacer.take_due() == ["a"]  # the first wake-up of a quiet pool: at once
    for _ in range(50):  # flips during and after that retry: one retry due, an interval after it began
        now[0] += 0.01
        pacer.wake("a")
        pacer.wake("b")  # another pool is paced on its own
    assert pacer.take_due() == ["b"] and pacer.next_due() == 100.0 + COALESCE_SECONDS + 2.0
    now[0] = pacer.next_due()
    assert pacer.take_due() == ["a"] and pacer.next_due() is None  # the last wake-up, not lost
    now[0] += 5.0  # quiet for longer than the interval: at once again
    pacer.wake("a")
    assert pacer.next_due() == now[0] + COALESCE_SECONDS
    assert Pacer(0, clock=lambda: now[0]).interval == 0.0 and Pacer(-1).interval == 0.0  # 0: unpaced


def test_a_node_flipping_its_gpus_and_capabilities_wakes_its_pools_retry_a_bounded_number_of_times(
        gateway: GatewayThread, paced: ControlPlane) -> None:
    """Every flip changes what placement reads, so each wakes the pool (bc_pool_freed), and the
    pending worker retried the pool's pending reservations once per applied message: at the node's
    message allowance (50 a second by default), for every tenant of the pool. Now a pool is retried
    at most once per BC_PENDING_WAKE_SECONDS; and the last state is still acted on: the pending
    reservation that fits only once the node reports its GPUs on fabric 9, right after its flips, is placed (no
    30-second retry here to do it)."""
    node, session = connected(gateway, paced.pool_id, "flipper", uuid="GPU-flip")
    waiting = paced.create(count=2, node_selector={"fabric.domain": "fab-1/9"})
    assert paced.get(waiting.id).state == "pending"
    flips = 60
    with capture_logs() as logs:
        began = time.monotonic()
        for i in range(flips):
            session.send(_flip(i, generation=10 + i))
        eventually(lambda: node_row(paced.conninfo, node.node_id)["inventory_generation"] == 10 + flips - 1,
                   what="every flip applied")
        last = hello(uuid="GPU-flip", clique="9")  # the last state: the fabric the reservation asks for
        last.hello.inventory.generation = 10 + flips
        session.send(last)
        placed = eventually(lambda: (r := paced.get(waiting.id)).state in ("placed", "binding", "active") and r,
                            what="the reservation placed after the last flip")
        elapsed = time.monotonic() - began
        retried = _retries(logs, paced.pool_id)
    assert [a.node_id for a in placed.allocations] == [node.node_id]
    # One retry per WAKE_S at most, plus the first (at once) and one already under way: unpaced,
    # every few applied flips had a retry of their own.
    assert 1 <= retried <= elapsed / WAKE_S + 2, (retried, elapsed)
    paced.check_invariants()
    session.close()


def test_a_stream_of_wake_ups_never_holds_off_the_safety_net(gateway: GatewayThread, database: str) -> None:
    """The pending worker retried every pool only after pending_retry_seconds without any wake-up:
    a node flipping its inventory in one pool held off the safety net of every other pool for as
    long as it flipped. Now the safety net runs on its period whatever wakes meanwhile: a pending
    reservation of another pool, woken by nothing, is still retried."""
    control = ControlPlane(database, workers=True, pending_retry_seconds=1, pending_wake_seconds=0)
    other = make_world(control.server.endpoint, control.root, database, nodes=0)
    stop = threading.Event()
    try:
        node, session = connected(gateway, control.pool_id, "flipper", uuid="GPU-flip")

        def flip() -> None:
            i = 0
            while not stop.is_set():  # as fast as the gateway takes them in
                session.send(_flip(i, generation=10 + i))
                eventually(lambda: node_row(database, node.node_id)["inventory_generation"] >= 10 + i,
                           what="the flip applied")
                i += 1

        control.create(count=2, node_selector={"fabric.domain": "fab-1/9"})  # retried at every flip
        stranded = other.create(count=1)  # a pool without nodes: pending, and nothing wakes it
        assert get(other, stranded.id).state == "pending"
        flipper = threading.Thread(target=flip, daemon=True)
        with capture_logs() as logs:
            flipper.start()
            eventually(lambda: _retries(logs, control.pool_id) >= 2, what="the flipping pool retried")
            eventually(lambda: _retries(logs, other.pool_id) >= 2, what="the safety net retrying the other pool")
        stop.set()
        flipper.join(30)
        session.close()
    finally:
        stop.set()
        other.close()
        control.stop()



# -- extend and renew on hardware taken out of service ----------------------------------------------

HOUR = 3_600_000


def _active(gateway: GatewayThread, cp: ControlPlane, node: Any, session: Any) -> rpb.Reservation:
    """A reservation of 2 GPUs with a lease, bound on `node` by its signed report: active."""
    rid, aid = binding(cp, count=2, lease_seconds=3600)
    cp.drain()
    session.send(node.report(_bound_body(node.node_id, aid, cdi_names(gateway.conninfo, aid))))
    eventually(lambda: sql(gateway.conninfo, "SELECT 1 FROM node_reports WHERE allocation_id = %s", (aid,)),
               what="the bound report stored")
    cp.drain()
    r = cp.get(rid)
    assert r.state == "active", r
    return r


def _extend(cp: ControlPlane, rid: str, key: str, **change: Any) -> rpb.ExtendReservationResponse:
    return cp.world.user.res("Extend", rpb.ExtendReservationRequest(
        tenant_id=cp.world.tenant, reservation_id=rid, idempotency_key=key, **change))


def _take_out(cp: ControlPlane, how: str, node_id: str, device: str, back: bool = False) -> None:
    if how == "revoked":
        npb_grpc.NodeAdminStub(cp.root.channel).RevokeCertificates(
            nodes_pb.RevokeCertificatesRequest(node_id=node_id, reason="stolen"), metadata=cp.root.metadata)
    elif how == "cordoned":
        cp.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node_id, state="ready" if back else "cordoned"))
    elif how == "quarantined":
        cp.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(node_id=node_id, device_uuid=device,
                                                             health="healthy" if back else "unhealthy"))
    else:
        cp.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(
            node_id=node_id, connectivity="connected" if back else "unreachable"))


@pytest.mark.parametrize("how,reason", [("revoked", "node-revoked"), ("cordoned", "node-cordoned"),
                                        ("quarantined", "device-unhealthy")])
def test_an_active_reservation_on_hardware_taken_out_of_service_cannot_be_extended_there(
        gateway: GatewayThread, cp: ControlPlane, how: str, reason: str) -> None:
    """An operator revokes a stolen node's certificates, cordons a node for maintenance, or
    quarantines a GPU after an XID error, under an active reservation. Its current window runs its
    course (spec P6), but extend moved its booking's end on that hardware as if nothing happened:
    more time sold on a machine out of service. Now INVALID_STATE naming why (details.reason,
    nodeId, deviceUuid), nothing changed and the extend slot free; renew (which books nothing)
    still works, as does an until already reached; back in service, extend works again."""
    node, session = connected(gateway, cp.pool_id, "n1", uuid="GPU-n1")
    r = _active(gateway, cp, node, session)
    device = r.allocations[0].device_ids[0]
    _take_out(cp, how, node.node_id, device)
    code, spec_code, details = refused(_extend, cp, r.id, "ext-1", by="1h")
    expected = {"reason": reason, "nodeId": node.node_id, "state": "active", "reservationId": r.id}
    if how == "quarantined":
        expected["deviceUuid"] = device
    assert (code, spec_code, details) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE", expected)
    after = cp.get(r.id)
    assert (after.during.end, after.version) == (r.during.end, r.version)
    assert cp.world.sql("SELECT pending FROM authz_projection WHERE reservation_id = %s", (r.id,)) == [(None,)]
    assert cp.world.sql("SELECT 1 FROM extend_holds WHERE reservation_id = %s", (r.id,)) == []
    assert not _extend(cp, r.id, "ext-2", until=r.during.end).extended  # already reached: no refusal
    renewed = cp.world.user.res("Renew", rpb.RenewReservationRequest(tenant_id=cp.world.tenant, reservation_id=r.id))
    assert renewed.state == "active" and renewed.during.end == r.during.end
    if how != "revoked":  # (a revoked node is back only once readmitted and enrolled again)
        _take_out(cp, how, node.node_id, device, back=True)
        out = _extend(cp, r.id, "ext-3", by="1h")
        assert out.extended and out.reservation.during.end == r.during.end + HOUR
    cp.check_invariants()
    session.close()


def test_an_active_reservation_on_an_unreachable_node_is_still_extended(gateway: GatewayThread, cp: ControlPlane) -> None:
    """Unreachable is not out of service: the node may be back in a minute, and the reservation
    keeps its booking (spec P6), so its extension is decided as ever."""
    node, session = connected(gateway, cp.pool_id, "n1", uuid="GPU-n1")
    r = _active(gateway, cp, node, session)
    _take_out(cp, "unreachable", node.node_id, "")
    assert node_row(cp.conninfo, node.node_id)["connectivity"] == "unreachable"
    out = _extend(cp, r.id, "ext-1", by="1h")
    assert out.extended and out.reservation.during.end == r.during.end + HOUR
    session.close()


def test_a_placed_reservation_on_a_revoked_node_is_extended_and_repaired_with_its_whole_window(
        gateway: GatewayThread, cp: ControlPlane) -> None:
    """Before its start a reservation's booking is BookingRepair's: extending a placed one on a
    revoked node is decided as ever, and the repair moves the whole window, the extension
    included, to a good node."""
    bad, bad_session = connected(gateway, cp.pool_id, "bad", uuid="GPU-bad")
    future = cp.create(count=4, start=cp.world.later(), duration="2h")
    assert [a.node_id for a in future.allocations] == [bad.node_id]
    good, good_session = connected(gateway, cp.pool_id, "good", uuid="GPU-good")
    _take_out(cp, "revoked", bad.node_id, "")
    out = _extend(cp, future.id, "ext-1", by="1h")
    assert out.extended and out.reservation.during.end == future.during.end + HOUR
    cp.advance(24 * HOUR - 10 * 60_000)
    cp.drain()
    moved = cp.get(future.id)
    assert moved.state == "placed", moved
    assert [a.node_id for a in moved.allocations if a.state == "placed"] == [good.node_id]
    assert (moved.during.start, moved.during.end) == (future.during.start, future.during.end + HOUR)
    cp.check_invariants()
    good_session.close()


def test_a_node_cordoned_while_iam_decides_the_extension_is_refused_in_its_second_transaction(
        gateway: GatewayThread, cp: ControlPlane) -> None:
    """The extend's first transaction saw the node in service; the cordon commits before its
    second (which waits for the pool lock the test holds): the second checks again. The cordon is
    written in the test's own locked transaction, since SetNodeState would queue for the pool lock
    behind the extend."""
    node, session = connected(gateway, cp.pool_id, "n1", uuid="GPU-n1")
    r = _active(gateway, cp, node, session)
    with ThreadPoolExecutor(1) as ex:
        with psycopg.connect(cp.conninfo) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("pool:" + cp.pool_id,))
            pending = ex.submit(refused, _extend, cp, r.id, "ext-1", by="1h")
            eventually(lambda: sql(cp.conninfo, "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"),
                       what="the extend waiting for the pool lock in its second transaction")
            conn.execute("UPDATE nodes SET state = 'cordoned' WHERE id = %s", (node.node_id,))
        code, spec_code, details = pending.result(60)
    assert (spec_code, details["reason"]) == ("INVALID_STATE", "node-cordoned"), details
    assert cp.get(r.id).during.end == r.during.end
    assert cp.world.sql("SELECT pending FROM authz_projection WHERE reservation_id = %s", (r.id,)) == [(None,)]
    session.close()
