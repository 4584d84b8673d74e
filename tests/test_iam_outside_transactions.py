"""DESIGN section 8: IAM is never called inside a database transaction. Every IAM decision made
while serving Get, List, Release, Cancel, Renew, Extend, Timeline and Watch is observed at the
moment it is taken, and the connection of the transaction the serving task has open (if any) must
be idle: no transaction open across the decision."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import db, iam
from tests.support import World


class DecisionSpy:
    """Wraps the real IAM decision (its answer is unchanged) and records, per action, whether the
    deciding task had a transaction open at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, bool]] = []
        self._lock = threading.Lock()
        real = iam.decide

        def spy(*args: Any, **kwargs: Any) -> iam.Decision:
            conn = db.open_transaction()
            in_tx = conn is not None and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
            with self._lock:
                self.seen.append((args[2], in_tx))
            return real(*args, **kwargs)

        monkeypatch.setattr(iam, "decide", spy)

    def actions(self) -> set[str]:
        with self._lock:
            return {action for action, _ in self.seen}

    def inside(self) -> list[str]:
        with self._lock:
            return [action for action, in_tx in self.seen if in_tx]


def test_iam_is_never_asked_inside_a_transaction(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = DecisionSpy(monkeypatch)
    t, user = world.tenant, world.user
    a = world.create(lease_seconds=600)
    b = world.create(start=world.later())
    user.res("Get", pb.GetReservationRequest(tenant_id=t, reservation_id=a.id))
    user.res("List", pb.ListReservationsRequest(tenant_id=t))
    user.res("Renew", pb.RenewReservationRequest(tenant_id=t, reservation_id=a.id))
    user.res("Extend", pb.ExtendReservationRequest(tenant_id=t, reservation_id=a.id, by="1h",
                                                       idempotency_key="ext-1"))
    user.res("Release", pb.ReleaseReservationRequest(tenant_id=t, reservation_id=a.id))
    user.res("Cancel", pb.CancelReservationRequest(tenant_id=t, reservation_id=b.id))
    capacity_pb2_grpc.CapacityStub(user.channel).Timeline(
        cpb.TimelineRequest(tenant_id=t, pool_id=world.pool_id), metadata=user.metadata, timeout=30)
    watch = events_pb2_grpc.EventsStub(user.channel).Watch(
        epb.WatchRequest(tenant_id=t), metadata=user.metadata, timeout=30)
    next(iter(watch))  # a stored event arrives only after the Watch was authorised
    watch.cancel()

    # Not vacuous: every path was decided (and observed) here.
    assert {iam.CREATE, iam.READ, iam.LIST, iam.EXTEND, iam.RELEASE, "compute:capacity:read",
            "compute:events:read"} <= spy.actions()
    assert spy.inside() == []
