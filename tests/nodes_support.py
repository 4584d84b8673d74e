"""Support for the node-side tests: the control plane beside a gateway on one database, so a test
reaches reservation and allocation states through the API, the reservation worker and signed
reports, never by writing rows.

The control plane runs without its background workers (unless asked for them): `drain()` runs the real reservation worker
(controlplane.workers.queue.run_one) on every item due now, when the test says so, so a test can
count the wake-ups a gateway schedules before the worker takes them.
"""

from __future__ import annotations

from typing import Any

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.config import Settings
from controlplane.workers import queue
from tests.invariants import check_invariants
from controlplane.app import WORK_HANDLERS
from tests.support import Client, ServerThread, World, make_world


class ControlPlane:
    def __init__(self, conninfo: str, *, workers: bool = False, **settings: Any) -> None:
        self.conninfo = conninfo
        self.server = ServerThread(conninfo, Settings(database_url=conninfo, clock_control=True, **settings),
                                   workers=workers)
        self.root = Client(self.server.endpoint, bootstrap.ensure_root(conninfo))
        self.world: World = make_world(self.server.endpoint, self.root, conninfo, nodes=0)

    @property
    def pool_id(self) -> str:
        return self.world.pool_id

    def drain(self) -> int:
        """Run the reservation worker until nothing is due; how many items it took."""
        taken = 0
        while self.server.call(queue.run_one(self.server.app.runtime, WORK_HANDLERS)):
            taken += 1
        return taken

    def create(self, **kw: Any) -> pb.Reservation:
        return self.world.create(**kw)

    def get(self, rid: str) -> pb.Reservation:
        return self.world.user.res("Get", pb.GetReservationRequest(tenant_id=self.world.tenant, reservation_id=rid))

    def advance(self, ms: int) -> None:
        self.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=ms))

    def check_invariants(self) -> None:
        check_invariants(self.conninfo, self.world.tenant)

    def stop(self) -> None:
        self.world.user.close()  # type: ignore[union-attr]
        self.root.close()
        self.server.stop()
