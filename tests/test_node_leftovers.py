"""Node-side leftovers of the hostile reviews: a node flipping its inventory or capabilities in a
loop woke its pool's pending retry once per message (and a stream of wake-ups held off every
pool's 30-second safety net); an extend added time on a node taken out of service. Real servers on
loopback, the real gateway with mutual TLS, the real pending worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from bettercompute.node.v1 import node_pb2 as npb
from tests.nodes_support import ControlPlane
from tests.support import get, make_world
from tests.test_gateway import GatewayThread, connected, eventually, gateway, hello, node_row  # noqa: F401

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

