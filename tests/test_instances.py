"""Instances on a provider reservation and spec 001's slot rules: into the grantee's grant while it
has a free slot, else an ordinary free slot, else CAPACITY_UNAVAILABLE; others share
`total - in use - unused granted slots`; project grants; a physically full reservation; stopped
instances of a grant; take-in at a grant's start; renewals; a reservation gone."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.provider.v1 import provider_pb2 as ppb
from bettercompute.v1 import instances_pb2 as ipb
from bettercompute.v1 import providers_pb2 as vpb
from tests.support import Client, ServerThread, World, rpc_error
from tests.vps_support import HOUR, SimThread, Vps, other, own_stack, sim, v, world_of  # noqa: F401 (fixtures)


@pytest.fixture
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from own_stack(pg_uri)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    yield from world_of(stack)


def refused(call) -> dict[str, str]:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_UNAVAILABLE")
    return details


def until(check, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def active_grant(v: Vps, **kw):
    g = v.grant(starts_at=v.now(), **kw)
    until(lambda: v.get_grant(g.id).state == "active")
    return g


def test_the_grantee_fills_its_grant_then_ordinary_slots_then_is_refused(v: Vps, sim: SimThread) -> None:
    g = active_grant(v, slots=2)
    placed = [v.instance() for _ in range(4)]
    assert [(i.placement, i.grant_id) for i in placed] == [("grant", g.id)] * 2 + [("reserved", "")] * 2
    assert refused(lambda: v.instance()) == {"total": "4", "inUse": "4"}
    running = sim.provider.ListReservations(ppb.ListReservationsRequest(account=v.external))
    assert running.items[0].in_use == 4  # the provider runs them, in the reservation


def test_others_share_total_minus_in_use_minus_unused_granted_slots(v: Vps, other) -> None:
    w, theirs = other
    active_grant(v, slots=2)  # unused
    v.instance()  # in the grant
    made = [v.instance(theirs, tenant=w.tenant) for _ in range(2)]
    assert [i.placement for i in made] == ["reserved", "reserved"]
    details = refused(lambda: v.instance(theirs, tenant=w.tenant))
    assert details == {"total": "4", "inUse": "3", "granted": "2"}
    # The grantee still has its unused granted slot; nobody has an ordinary one.
    assert v.instance().placement == "grant"
    refused(lambda: v.instance())


def test_a_grant_naming_a_project_serves_only_that_projects_instances(v: Vps) -> None:
    web = v.user("projects", "Create", vpb.CreateProjectRequest(tenant_id=v.world.tenant, name="web"))
    g = active_grant(v, slots=1, project_id=web.id)
    assert v.instance().placement == "reserved"
    inside = v.instance(project_id=web.id)
    assert (inside.placement, inside.grant_id, inside.project_id) == ("grant", g.id, web.id)


def test_a_physically_full_reservation_refuses_the_grantee_too(v: Vps, other) -> None:
    w, theirs = other
    v.put(3)
    v.scan()
    active_grant(v, slots=1)
    v.instance(theirs, tenant=w.tenant)
    v.instance(theirs, tenant=w.tenant)
    v.put(2)  # the provider shrank it below what runs
    v.scan()
    assert refused(lambda: v.instance()) == {"total": "2", "inUse": "2"}


def test_a_grants_stopped_instances_keep_their_slots(v: Vps, other) -> None:
    w, theirs = other
    v.put(2)
    v.scan()
    g = active_grant(v, slots=1)
    first = v.instance()
    assert v.instance_call("Stop", first.id).state == "stopped"
    # The stopped instance holds the grant's slot: the grantee's next one takes the ordinary slot,
    # and the other tenant gets none.
    assert v.instance().placement == "reserved"
    refused(lambda: v.instance(theirs, tenant=w.tenant))
    started = v.instance_call("Start", first.id)
    assert (started.state, started.placement, started.grant_id) == ("running", "grant", g.id)


def test_an_ordinary_stopped_instance_frees_its_slot_and_needs_one_to_start(v: Vps, other) -> None:
    w, theirs = other
    v.put(1)
    v.scan()
    mine = v.instance()
    v.instance_call("Stop", mine.id)
    theirs_one = v.instance(theirs, tenant=w.tenant)
    assert theirs_one.placement == "reserved"
    refused(lambda: v.instance_call("Start", mine.id))
    v.instance_call("Delete", theirs_one.id, theirs, tenant=w.tenant)
    assert v.instance_call("Start", mine.id).state == "running"


def test_a_starting_grant_takes_in_running_instances_oldest_first_never_billing_none(v: Vps) -> None:
    none = v.instance(billing="none")
    old, newer, newest = v.instance(), v.instance(), v.instance()
    v.instance_call("Stop", newer.id)  # stopped: not running, not taken in
    g = v.grant(slots=2, starts_at=v.now() + HOUR)
    v.advance(HOUR)
    until(lambda: v.get_grant(g.id).state == "active")
    got = {i.id: (i.placement, i.grant_id) for i in v.user("instances", "List", ipb.ListInstancesRequest(
        tenant_id=v.world.tenant)).items}
    assert got[old.id] == ("grant", g.id) and got[newest.id] == ("grant", g.id)
    assert got[none.id] == ("reserved", "") and got[newer.id] == ("reserved", "")


def test_a_renewal_takes_over_the_ended_grants_instances_up_to_its_free_slots(v: Vps) -> None:
    start = v.now()
    first = v.grant(slots=3, starts_at=start, ends_at=start + HOUR)
    renewal = v.grant(slots=1, starts_at=start + HOUR, ends_at=start + 3 * HOUR)
    until(lambda: v.get_grant(first.id).state == "active")
    stopped, a, b = v.instance(), v.instance(), v.instance()
    v.instance_call("Stop", stopped.id)
    assert {stopped.grant_id, a.grant_id, b.grant_id} == {first.id}
    v.advance(HOUR)
    until(lambda: v.get_grant(first.id).state == "ended" and v.get_grant(renewal.id).state == "active")
    after = {i.id: (i.placement, i.grant_id) for i in v.user("instances", "List", ipb.ListInstancesRequest(
        tenant_id=v.world.tenant)).items}
    # The renewal's one slot goes to the oldest running instance of the ended grant, not to the
    # stopped one; the rest run at the reservation rate.
    assert after[a.id] == ("grant", renewal.id)
    assert after[stopped.id] == ("reserved", "") and after[b.id] == ("reserved", "")


def test_a_gone_reservation_puts_its_instances_on_demand(v: Vps) -> None:
    active_grant(v, slots=1)
    inside, outside = v.instance(), v.instance()
    v.gone()
    v.scan()
    for i in (inside, outside):
        got = v.instance_call("Get", i.id)
        assert (got.placement, got.grant_id, got.state) == ("on-demand", "", "running")


def test_get_list_and_another_tenants_instance(v: Vps, other) -> None:
    w, theirs = other
    mine = v.instance(name="web-1")
    assert v.instance_call("Get", mine.id) == mine
    assert [i.id for i in v.user("instances", "List", ipb.ListInstancesRequest(tenant_id=v.world.tenant)).items] == [
        mine.id]
    with pytest.raises(grpc.RpcError) as exc:
        v.instance_call("Get", mine.id, theirs, tenant=w.tenant)
    assert rpc_error(exc)[1:] == ("NOT_FOUND", {"instanceId": mine.id})
    deleted = v.instance_call("Delete", mine.id)
    assert deleted.state == "deleted"
    assert v.instance_call("Delete", mine.id).state == "deleted"
    with pytest.raises(grpc.RpcError) as exc:
        v.instance_call("Start", mine.id)
    assert rpc_error(exc)[1] == "INVALID_STATE"


def test_create_is_idempotent_under_its_key(v: Vps) -> None:
    first = v.instance(name="a", key="same")
    assert v.instance(name="a", key="same") == first
    with pytest.raises(grpc.RpcError) as exc:
        v.instance(name="b", key="same")
    assert rpc_error(exc)[1:] == ("CONFLICT", {"instanceId": first.id})


def test_a_flavor_without_a_bound_reservation_is_invalid_input(v: Vps) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        v.instance(flavor="other-flavor")
    assert rpc_error(exc)[1] == "INVALID_INPUT" and rpc_error(exc)[2]["field"] == "flavor"


def test_a_provider_that_refuses_leaves_no_instance_and_no_slot_taken(v: Vps, sim: SimThread) -> None:
    v.put(1)
    v.scan()
    try:
        sim.faults(failure_rate=1.0)
        details = refused(lambda: v.instance())
        assert details["reason"] == "provider-unavailable"
    finally:
        sim.faults()
    assert v.world.sql("SELECT count(*) FROM instances WHERE state <> 'deleted'") == [(0,)]
    assert v.instance().placement == "reserved"


def test_a_retry_after_a_failed_provider_call_brings_the_provider_in_line(v: Vps, sim: SimThread) -> None:
    made = v.instance()
    ref = ppb.InstanceRef(account=v.external, name=made.id)
    try:
        sim.faults(failure_rate=1.0)
        assert refused(lambda: v.instance_call("Stop", made.id))["reason"] == "provider-unavailable"
    finally:
        sim.faults()
    assert sim.provider.GetInstance(ref).state == "running"  # the provider never heard of the stop
    assert v.instance_call("Stop", made.id).state == "stopped"  # the retry
    assert sim.provider.GetInstance(ref).state == "stopped"
