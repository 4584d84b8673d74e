"""Helpers for the promise tests: nodes that sign their reports with real keys, reports taken in
through the gateway's own intake, the nodes' desired state as the gateway reads it, and a
positive signal that the reconciler has handled every wake-up that fell due.

A node registered through the admin API is enrolled under its own name (enrolment reuses the
node), so it keeps its atoms and gets a real certificate from the control-plane CA; its reports
are signed with its key and stored exactly as the gateway stores them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.nodes import desired
from controlplane.nodes import reports as node_reports
from tests.support import World, eventually
from tests.test_pki import Enrolled, arun, enrol, sign


class SigningNodes:
    """The world's nodes, each enrolled on first use and connected, reporting like bcd does."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.enrolled: dict[str, Enrolled] = {}
        self.sequence = 0

    def node(self, node_id: str) -> Enrolled:
        if node_id not in self.enrolled:
            name = next(n.name for n in self.world.nodes if n.id == node_id)
            node = enrol(self.world.conninfo, self.world.pool_id, name)
            assert node.node_id == node_id, "enrolment under the node's name reuses the node"
            self.world.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(
                node_id=node_id, connectivity="connected"))
            self.enrolled[node_id] = node
        return self.enrolled[node_id]

    def report(self, node_id: str, allocation_id: str, kind: str = "bound", **fields: Any) -> str:
        """A node-signed report of `kind` about the allocation, taken in by the gateway's intake
        (which stores it as received and wakes the reservation). Returns the intake's verdict."""
        node = self.node(node_id)
        # Each report is newer than the last, as a daemon's are: the gateway drops a replay.
        self.sequence = max(self.sequence + 1, int(time.time() * 1000))
        body = node_pb2.Report(node_id=node_id, sequence=self.sequence, time=int(time.time() * 1000))
        if kind == "bound":
            body.bound.CopyFrom(node_pb2.AllocationBound(allocation_id=allocation_id, **fields))
        elif kind == "released":
            body.released.CopyFrom(node_pb2.AllocationReleased(allocation_id=allocation_id, reason="unassigned"))
        else:
            body.failed.CopyFrom(node_pb2.AllocationFailed(allocation_id=allocation_id, reason="device-missing"))
        raw = body.SerializeToString()
        attested = node_pb2.AttestedReport(body=raw, key_id=node.key_id, signature=sign(node.keys.signing, raw))
        ack = arun(self.world.conninfo, lambda pool: node_reports.intake(pool, node_id, attested))
        return node_pb2.ReportOutcome.Name(ack.outcome).removeprefix("REPORT_").lower()

    def activate(self, rid: str) -> pb.Reservation:
        """Wait for binding, have every binding allocation's node report it bound, wait for active."""
        binding = eventually(self.world, rid, lambda r: r.state == "binding")
        for a in binding.allocations:
            if a.state == "binding":
                assert self.report(a.node_id, a.id, cdi_devices=[f"bcd.dev/gpu={d}" for d in a.device_ids]) == "stored"
        return eventually(self.world, rid, lambda r: r.state == "active")


def desired_state(world: World, node_id: str) -> node_pb2.DesiredState:
    """The node's desired state exactly as the gateway sends it."""
    return arun(world.conninfo, lambda pool: desired.read(pool, node_id))


def due_wakeups(world: World, rid: str, within_ms: int = 0) -> int:
    """How many of the reservation's wake-ups are due now, or within `within_ms`."""
    return world.sql("SELECT count(*) FROM work_items WHERE kind = 'reservation' AND subject = %s"
                     " AND run_at <= compute_now() + %s * interval '1 millisecond'", (rid, within_ms))[0][0]


def settled(world: World, rid: str, seconds: float = 10) -> None:
    """Wait until the reconciler has handled every wake-up of the reservation that is due, each
    successfully (a failing handler leaves its item behind with an error and a later run_at).
    A wake-up is deleted in the transaction that handled it, so none left due means every one
    committed. Callers make sure one was due: an API call that wakes it has returned, or
    `due_wakeups` counted one before the clock moved."""
    deadline = time.monotonic() + seconds
    while True:
        left, failed = world.sql(
            "SELECT count(*) FILTER (WHERE run_at <= compute_now()), count(*) FILTER (WHERE attempts > 0)"
            " FROM work_items WHERE kind = 'reservation' AND subject = %s", (rid,))[0]
        assert failed == 0, world.sql("SELECT last_error FROM work_items WHERE subject = %s AND attempts > 0", (rid,))
        if left == 0:
            return
        assert time.monotonic() < deadline, f"{left} due wake-ups of {rid} still unhandled"
        time.sleep(0.05)


def advance_and_settle(world: World, rid: str, ms: int) -> None:
    """Move compute_now() by `ms`, after checking that at least one of the reservation's
    wake-ups falls due by then, and wait until the reconciler has handled them all."""
    assert due_wakeups(world, rid, ms) > 0, "no wake-up of this reservation falls due: nothing would run"
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=ms))
    settled(world, rid)


def wake_up_times(world: World, rid: str) -> list[int]:
    """The run_at (epoch ms) of the reservation's pending wake-ups, ascending."""
    return [t for (t,) in world.sql("SELECT epoch_ms(run_at) FROM work_items WHERE kind = 'reservation'"
                                    " AND subject = %s ORDER BY run_at", (rid,))]


@contextlib.contextmanager
def pool_locked(world: World) -> Iterator[None]:
    """Hold the pool's lock (pg_advisory_xact_lock on 'pool:<id>', as controlplane.common.locks.pool_lock
    takes it) in a transaction of the test's own, so a step that needs it waits until the block ends."""
    with psycopg.connect(world.conninfo) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("pool:" + world.pool_id,))
        yield


def poll(check: Callable[[], Any], seconds: float = 10, what: str = "condition") -> Any:
    """Poll `check()` until it returns something truthy, and return that."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
