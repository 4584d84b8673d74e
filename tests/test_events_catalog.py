"""The event catalog (spec "States and conditions", DESIGN section 18): lifecycle changes emit
events with subject reservation/<id> and state and poolId in their data; reservation.cancelled,
reservation.expired and reservation.awaiting-confirmation among them. Read as a subscriber does,
through Events.Watch, after driving reservations through their lifecycle with real calls."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.promise_support import SigningNodes
from tests.support import Client, ServerThread, World, eventually, rpc_error
from tests.test_watch import Stream

MIN = 60_000
HOUR = 3_600_000
STATES = {"awaiting-confirmation", "pending", "queued", "placed", "binding", "active",
          "denied", "released", "failed", "cancelled", "expired"}


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True)


def test_every_reservation_event_carries_state_and_pool_id(world: World) -> None:
    at = world.root.admin("GetClock", apb.GetClockRequest()).now
    nodes = SigningNodes(world)

    def cancel(rid: str) -> pb.Reservation:
        return world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=rid))

    def release(rid: str) -> pb.Reservation:
        return world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=rid))

    # placed -> cancelled (reason cancel)
    withdrawn = world.create(count=1, start=at + 5 * HOUR)
    assert cancel(withdrawn.id).state == "cancelled"
    # pending -> cancelled by a release (reason release): two fillers take both nodes' window.
    fillers = [world.create(count=8, start=at + 2 * HOUR, duration="1h") for _ in range(2)]
    waiting = world.create(count=8, start=at + 2 * HOUR, duration="1h")
    assert waiting.state == "pending"
    assert release(waiting.id).state == "cancelled"
    for f in fillers:
        release(f.id)
    # placed -> binding -> active -> extended -> released (reason release)
    used = world.create(count=2, duration="2h")
    nodes.activate(used.id)
    world.user.res("Extend", pb.ExtendReservationRequest(tenant_id=world.tenant, reservation_id=used.id,
                                                         by="1h", idempotency_key="more"))
    assert release(used.id).state == "released"
    # active -> released at its end (reason expired)
    ending = world.create(count=1, duration="30m")
    nodes.activate(ending.id)
    # awaiting-confirmation -> expired at the confirmation deadline
    world.policy("permit(principal, action, resource) unless { context.delegated };")
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                              confirm_actions=["compute:reservations:create"])
    with pytest.raises(grpc.RpcError) as exc:
        world.create(agent, key="agent-run", count=1)
    held = rpc_error(exc)[2]["reservationId"]
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=31 * MIN))
    eventually(world, held, lambda r: r.state == "expired")
    eventually(world, ending.id, lambda r: r.state == "released")

    stored = world.sql("SELECT count(*) FROM events WHERE tenant_id = %s", (world.tenant,))[0][0]
    with Stream(world.user, tenant_id=world.tenant, after_id=0) as stream:
        events = [e for e in stream.take(stored) if e.type.startswith("reservation.")]
    catalog: dict[str, list[dict]] = {}
    for e in events:
        data = MessageToDict(e.data)
        assert e.subject.startswith("reservation/rsv_"), e
        assert data.get("state") in STATES and data.get("poolId") == world.pool_id, (e.type, data)
        catalog.setdefault(e.type, []).append(data)

    expected = {"placed", "pending", "binding", "active", "extended", "released", "cancelled",
                "awaiting-confirmation", "expired"}
    assert {f"reservation.{t}" for t in expected} <= set(catalog), sorted(catalog)
    assert sorted(d["reason"] for d in catalog["reservation.cancelled"]) == ["cancel", "release"]
    assert all(d["state"] == "cancelled" for d in catalog["reservation.cancelled"])
    [awaiting] = catalog["reservation.awaiting-confirmation"]
    assert awaiting["state"] == "awaiting-confirmation" and awaiting["confirmationId"].startswith("conf")
    [expired] = catalog["reservation.expired"]
    assert (expired["state"], expired["reason"]) == ("expired", "confirmation-expired")
    assert sorted(d["reason"] for d in catalog["reservation.released"]) == ["expired", "release", "release",
                                                                            "release"]
    check_invariants(world.conninfo, world.tenant)
