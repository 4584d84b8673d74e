"""The metering ledger: vm.grant.slot.hours for every committed slot of every hour of a term (used
or not), informational vm.grant.usage.hours inside a grant, vm.reserved.* beyond or after it,
on-demand once the reservation is gone, gpu.hours for GPU reservations from active until release;
written once each hour has ended, never twice (a rerun or a second replica), read by the tenant's
Usage API."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import usage_pb2 as upb
from tests.promise_support import SigningNodes
from tests.support import PERMISSIVE, Client, ServerThread, World, eventually, make_world, rpc_error
from tests.vps_support import HOUR, MIN, Stubs, Vps, own_stack, sim, v, world_of  # noqa: F401 (fixtures)


@pytest.fixture
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from own_stack(pg_uri)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    yield from world_of(stack, nodes=1)


def until(check, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def ledger(v: Vps, meter: str | None = None) -> list[tuple]:
    rows = v.world.sql("SELECT meter, subject, epoch_ms(hour), quantity::float8, region, pool_id, provider "
                       "FROM usage_records WHERE tenant_id = %s ORDER BY meter, subject, hour", (v.world.tenant,))
    return [r for r in rows if meter is None or r[0] == meter]


def total(v: Vps, meter: str, subject: str | None = None) -> float:
    return sum(r[3] for r in ledger(v, meter) if subject is None or r[1] == subject)


def metered_to_end(v: Vps, grant_id: str) -> bool:
    return v.world.sql("SELECT metered_until >= ends_at FROM reservation_grants WHERE id = %s",
                       (grant_id,)) == [(True,)]


def test_every_committed_slot_hour_of_the_term_is_metered_used_or_not(v: Vps) -> None:
    start = v.now()
    g = v.grant(slots=3, starts_at=start, ends_at=start + 2 * HOUR + 30 * MIN)
    v.advance(4 * HOUR)
    until(lambda: metered_to_end(v, g.id))
    rows = ledger(v, "vm.grant.slot.hours")
    assert sum(r[3] for r in rows) == pytest.approx(3 * 2.5)
    assert {r[1] for r in rows} == {f"grant/{g.id}"} and len(rows) in (3, 4)  # the term spans 3 or 4 hours
    assert {r[4:] for r in rows} == {("eu-1", v.world.pool_id, "sim")}
    assert all(r[2] % HOUR == 0 for r in rows)


def test_an_hour_is_metered_only_once_it_has_ended(v: Vps) -> None:
    start = v.now()
    g = v.grant(slots=1, starts_at=start, ends_at=start + 5 * HOUR)
    v.server.call(_passes(v, 2))
    assert ledger(v, "vm.grant.slot.hours") == []  # the grant's first hour has not ended
    v.advance(HOUR)
    until(lambda: len(ledger(v, "vm.grant.slot.hours")) >= 1)
    hours = [r[2] for r in ledger(v, "vm.grant.slot.hours")]
    assert max(hours) + HOUR <= v.now()
    assert not metered_to_end(v, g.id)


async def _passes(v: Vps, n: int) -> None:
    from controlplane.vps import metering
    for _ in range(n):
        await metering.run_once(v.server.app.runtime)


def test_a_rerun_or_a_second_replica_writes_nothing_twice(v: Vps) -> None:
    from controlplane.vps import metering
    start = v.now()
    g = v.grant(slots=2, starts_at=start, ends_at=start + 3 * HOUR)
    v.instance()
    v.advance(4 * HOUR)
    until(lambda: metered_to_end(v, g.id))
    v.server.call(_passes(v, 1))  # everything due is written now
    before = ledger(v)
    # Forget the progress, as a replica that never saw it would, and run passes side by side.
    v.world.sql("UPDATE reservation_grants SET metered_until = NULL")
    v.world.sql("DELETE FROM metering_progress")
    rt = v.server.app.runtime
    async def side_by_side() -> None:
        await asyncio.gather(*(metering.run_once(rt) for _ in range(3)))

    v.server.call(side_by_side())
    # Hours that settle while this runs (the instance keeps running) may be written meanwhile, even
    # an hour older than another meter's last one: every hour of a subject written before is
    # written once, unchanged, under the same meter.
    metered = {(r[1], r[2]) for r in before}
    assert [r for r in ledger(v) if (r[1], r[2]) in metered] == before
    assert total(v, "vm.grant.slot.hours") == pytest.approx(6)


def test_an_ended_grant_stops_billing_at_its_end(v: Vps) -> None:
    start = v.now()
    g = v.grant(slots=2, starts_at=start, ends_at=start + 10 * HOUR)
    until(lambda: v.get_grant(g.id).state == "active")
    v.advance(90 * MIN)
    ended = v.end(g.id)
    v.advance(3 * HOUR)
    until(lambda: metered_to_end(v, g.id))
    assert total(v, "vm.grant.slot.hours") == pytest.approx(2 * (ended.ends_at - start) / HOUR)


def test_instances_inside_a_grant_record_only_usage_and_beyond_it_the_reservation_rate(v: Vps) -> None:
    start = v.now()
    g = v.grant(slots=1, starts_at=start, ends_at=start + 2 * HOUR)
    until(lambda: v.get_grant(g.id).state == "active")
    inside, beyond = v.instance(), v.instance()
    none = v.instance(billing="none")
    assert (inside.placement, beyond.placement) == ("grant", "reserved")
    v.advance(4 * HOUR)
    until(lambda: metered_to_end(v, g.id) and any(r[2] + HOUR > start + 2 * HOUR
                                                  for r in ledger(v, "vm.reserved.instance.hours")
                                                  if r[1] == f"instance/{inside.id}"))
    # Inside the grant: informational usage only, never a compute meter, until the grant ended;
    # then the reservation rate.
    assert total(v, "vm.grant.usage.hours", f"instance/{inside.id}") == pytest.approx(
        (start + 2 * HOUR - v.world.sql("SELECT epoch_ms(min(started_at)) FROM instance_segments "
                                        "WHERE instance_id = %s", (inside.id,))[0][0]) / HOUR, abs=1e-3)
    assert total(v, "vm.grant.usage.hours", f"instance/{beyond.id}") == 0
    assert total(v, "vm.reserved.instance.hours", f"instance/{beyond.id}") > 2
    assert [r for r in ledger(v) if r[1] == f"instance/{none.id}"] == []


def test_instances_of_a_gone_reservation_are_billed_on_demand(v: Vps) -> None:
    made = v.instance()
    v.gone()
    v.scan()
    v.advance(2 * HOUR)
    until(lambda: total(v, "vm.ondemand.instance.hours", f"instance/{made.id}") > 0.9)


def test_gpu_hours_run_from_active_until_release_and_not_while_binding(v: Vps) -> None:
    nodes = SigningNodes(v.world)
    r = v.world.create(count=2, start=v.now() + 30 * MIN, duration="6h")
    v.advance(31 * MIN)  # its start: binding
    eventually(v.world, r.id, lambda x: x.state == "binding")
    v.advance(3 * MIN)  # three minutes of binding, not billed
    nodes.activate(r.id)
    activated = v.world.sql("SELECT epoch_ms(time) FROM events WHERE subject = %s AND type = 'reservation.active'",
                            (f"reservation/{r.id}",))[0][0]
    v.advance(2 * HOUR)
    released = v.world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=v.world.tenant,
                                                                         reservation_id=r.id))
    assert released.state == "released"
    ended = released.during.end  # the window, truncated at the release
    v.advance(3 * HOUR)
    until(lambda: v.world.sql("SELECT metered_until >= from_epoch_ms(%s) FROM metering_progress "
                              "WHERE source = 'gpu'", (ended + HOUR,)) == [(True,)])
    # Two GPUs from active to release, to the millisecond: not the 34 minutes before it.
    assert total(v, "gpu.hours", f"reservation/{r.id}") == pytest.approx(2 * (ended - activated) / HOUR, abs=2e-5)
    assert all(row[4:6] == ("eu-1", v.world.pool_id) for row in ledger(v, "gpu.hours"))


def test_the_usage_api_reads_the_tenants_ledger_by_meter_pool_and_hours(v: Vps) -> None:
    start = v.now()
    g = v.grant(slots=1, starts_at=start, ends_at=start + 3 * HOUR)
    v.instance()
    v.instance()
    v.advance(4 * HOUR)
    until(lambda: metered_to_end(v, g.id) and total(v, "vm.reserved.instance.hours") > 0)
    everything = v.usage(**{"from": 0})
    assert {i.meter for i in everything.items} >= {"vm.grant.slot.hours", "vm.grant.usage.hours",
                                                    "vm.reserved.instance.hours"}
    slots = v.usage(meter="vm.grant.slot.hours", **{"from": 0})
    assert slots.total == pytest.approx(3) and {i.subject for i in slots.items} == {f"grant/{g.id}"}
    assert {i.meter for i in v.usage(meter="vm.grant.", **{"from": 0}).items} == {
        "vm.grant.slot.hours", "vm.grant.usage.hours"}
    assert v.usage(pool_id="pool_" + "0" * 26, **{"from": 0}).items == []
    first_hour = min(i.hour for i in slots.items)
    only_first = v.usage(meter="vm.grant.slot.hours", to=first_hour + HOUR, **{"from": first_hour})
    assert [i.hour for i in only_first.items] == [first_hour]
    # The same through `better-compute usage`, a real process.
    token = v.world.user.metadata[0][1].removeprefix("Bearer ")
    done = subprocess.run([sys.executable, "-m", "controlplane.cli", "--endpoint", v.world.endpoint, "--token", token,
                           "--tenant", v.world.tenant, "--pool", v.world.pool_id, "usage", "--meter",
                           "vm.grant.slot.hours", "--only-pool", "--from", "0", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["total"] == pytest.approx(3) and {i["subject"] for i in answer["items"]} == {f"grant/{g.id}"}
    assert {i["poolId"] for i in answer["items"]} == {v.world.pool_id}
    other = make_world(v.world.endpoint, v.world.root, v.world.conninfo, nodes=0)
    assert Stubs(other.user)("usage", "Query", upb.QueryUsageRequest(tenant_id=other.tenant)).items == []
    with pytest.raises(grpc.RpcError) as exc:
        v.usage(tenant=v.world.tenant, stubs=Stubs(other.user))
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    v.world.policy(PERMISSIVE + '\nforbid(principal, action == Action::"compute:usage:read", resource);')
    with pytest.raises(grpc.RpcError) as exc:
        v.usage()
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    other.close()


@pytest.mark.parametrize("bounds, field", [
    ({"from": -1}, "from"), ({"from": 2**63 - 1}, "from"), ({"from": 10, "to": 10}, "to"),
    ({"from": 0, "to": 2**63 - 1}, "to"),
])
def test_the_usage_api_refuses_hours_out_of_range(v: Vps, bounds: dict, field: str) -> None:
    """Absurd hour bounds are INVALID_INPUT naming the field, never an error from the database."""
    with pytest.raises(grpc.RpcError) as exc:
        v.usage(**bounds)
    code, reason, details = rpc_error(exc)
    assert (reason, details["field"]) == ("INVALID_INPUT", field)
