"""Preemption end to end through real processes (control plane, gateway, nodesim): a spot hold
bound on a node gets its notice when a regular reservation needs its GPUs; the node sees the hold's
`until` moved to the notice's end, removes the spot's files then, and binds the preemptor after."""

from __future__ import annotations

import time

from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World
from tests.test_e2e import eventually, fleet_factory, stack, world  # noqa: F401 (fixtures)

NOTICE_S = 3


def env_of(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def wait_until(check, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_spot_hold_is_preempted_on_the_node_and_the_preemptor_binds_after(world: World, fleet_factory) -> None:  # noqa: F811
    fleet = fleet_factory(1)
    world.sql("UPDATE pools SET policy = policy || %s::jsonb WHERE id = %s",
              ('{"spot": {"noticeSeconds": %d}}' % NOTICE_S, world.pool_id))
    spot = world.create(count=8, spot=True, duration="8h")
    active = eventually(world, spot.id, lambda x: x.state == "active")
    alloc = active.allocations[-1]
    node_dir = fleet.node_dir(alloc.node_id)
    env_path = node_dir / "run" / "bcd" / "allocations" / f"{alloc.id}.env"
    cdi_path = node_dir / "etc" / "cdi" / f"bcd-{alloc.id}.json"
    assert env_path.exists() and cdi_path.exists()

    r = world.create(count=8, duration="1h")
    assert r.state == "placed"
    cut = r.during.start
    assert sorted(r.allocations[0].device_ids) == sorted(alloc.device_ids)
    # The node sees the hold's new until (it rewrites the hold's env file) while the spot still runs.
    wait_until(lambda: env_of(env_path).get("BCD_UNTIL") == str(cut), "the node never saw the new until")
    assert world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=spot.id)).state \
        == "active"

    bound = eventually(world, r.id, lambda x: x.state == "active", seconds=60)
    assert not env_path.exists() and not cdi_path.exists()  # the victim's files went at the notice's end
    mine = bound.allocations[-1]
    assert (node_dir / "run" / "bcd" / "allocations" / f"{mine.id}.env").exists()
    # The node reported the spot's hold released before it reported the preemptor's bound.
    reports = world.sql("SELECT allocation_id, kind FROM node_reports WHERE allocation_id = ANY(%s) ORDER BY id",
                        ([alloc.id, mine.id],))
    assert (alloc.id, "released") in reports and (mine.id, "bound") in reports
    assert reports.index((alloc.id, "released")) < reports.index((mine.id, "bound"))
    bound_at = world.sql("SELECT epoch_ms(min(received_at)) FROM node_reports WHERE allocation_id = %s"
                         " AND kind = 'bound'", (mine.id,))[0][0]
    assert bound_at >= cut
    released = eventually(world, spot.id, lambda x: x.state == "released")
    assert released.state == "released"
    reasons = [d["reason"] for (d,) in world.sql(
        "SELECT data FROM events WHERE subject = %s AND type = 'reservation.released'", (f"reservation/{spot.id}",))]
    assert reasons == ["preempted"]
    preempted = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.preempted'",
                          (f"reservation/{spot.id}",))
    assert [d["by"] for (d,) in preempted] == [r.id]
    assert not world.sql("SELECT 1 FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL",
                         (spot.id,))
