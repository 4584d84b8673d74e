"""A hostile tenant against grants, instances, metering and spot (spec 001; spot and preemption):
other tenants' ids, draws beyond a grant or a reservation 20 at a time, bad amounts and terms,
retries under one key at once, a provider that refuses, and the ledger afterwards. Every refusal
must carry the spec's code and details, and nothing may be left half-written."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from bettercompute.provider.v1 import provider_pb2 as ppb
from bettercompute.v1 import grants_pb2 as gpb
from bettercompute.v1 import instances_pb2 as ipb
from bettercompute.v1 import providers_pb2 as vpb
from bettercompute.v1 import reservations_pb2 as rpb
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, gpus, make_world
from tests.vps_support import (HOUR, MIN, SimThread, Vps, metered, other, outcome, own_stack,  # noqa: F401 (fixtures)
                               progress, sim, v, world_of)

LIMIT = 6  # instances, and projects, per tenant in this module
TASKS = 20


@pytest.fixture
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from own_stack(pg_uri, instances_per_tenant=LIMIT, projects_per_tenant=LIMIT)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    yield from world_of(stack)


def at_once(call: Callable[[int], Any], n: int = TASKS) -> list[Any]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: outcome(lambda: call(i)), range(n)))


def until(check: Callable[[], bool], seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def active_grant(v: Vps, **kw: Any) -> gpb.ReservationGrant:
    g = v.grant(starts_at=v.now(), **kw)
    until(lambda: v.get_grant(g.id).state == "active")
    return g


def provider_in_use(v: Vps) -> int:
    found = v.sim.provider.ListReservations(ppb.ListReservationsRequest(account=v.external)).items
    return next(r.in_use for r in found if r.name == v.reservation)


def running_rows(v: Vps) -> int:
    return v.world.sql("SELECT count(*) FROM instances WHERE account_id = %s AND state = 'running'",
                       (v.account_id,))[0][0]


# --- draws beyond a grant or a reservation, 20 at a time -------------------------------------------

def test_twenty_creates_at_once_never_exceed_the_grant_or_the_reservation(v: Vps, other) -> None:
    w, theirs = other
    g = active_grant(v, slots=2)
    answers = at_once(lambda i: v.instance() if i % 2 else v.instance(theirs, tenant=w.tenant))
    made = [a for a in answers if isinstance(a, ipb.Instance)]
    refused = [a for a in answers if not isinstance(a, ipb.Instance)]
    assert len(made) == 4 and sum(1 for a in made if a.grant_id == g.id) == 2
    assert not any(a.grant_id for a in made if a.tenant_id == w.tenant)  # nobody else takes a granted slot
    for code, reason, details in refused:
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_UNAVAILABLE"), reason
        assert details["total"] == "4"
    assert running_rows(v) == provider_in_use(v) == 4


def test_twenty_creates_under_one_key_make_one_instance(v: Vps) -> None:
    answers = at_once(lambda i: v.instance(name="same", key="one-key"))
    assert all(isinstance(a, ipb.Instance) for a in answers), [a for a in answers if not isinstance(a, ipb.Instance)]
    assert len({a.id for a in answers}) == 1
    assert running_rows(v) == provider_in_use(v) == 1
    assert v.world.sql("SELECT count(*) FROM instance_segments") == [(1,)]  # billed once


def test_twenty_creates_at_once_respect_the_instances_per_tenant_limit(v: Vps) -> None:
    v.put(40)
    v.scan()
    answers = at_once(lambda i: v.instance())
    made = [a for a in answers if isinstance(a, ipb.Instance)]
    assert len(made) == LIMIT
    for code, reason, details in (a for a in answers if not isinstance(a, ipb.Instance)):
        assert (code, reason, details["limit"]) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE", str(LIMIT))


def test_twenty_grants_at_once_never_overcommit_the_reservation(v: Vps) -> None:
    start = v.now() + HOUR
    answers = at_once(lambda i: v.grant(slots=1, starts_at=start))
    made = [a for a in answers if isinstance(a, gpb.ReservationGrant)]
    assert len(made) == 4
    for code, reason, details in (a for a in answers if not isinstance(a, gpb.ReservationGrant)):
        assert (code, reason, details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_UNAVAILABLE",
                                           {"total": "4", "granted": "4"})


def test_twenty_grants_under_one_key_make_one_grant(v: Vps) -> None:
    start = v.now() + HOUR
    answers = at_once(lambda i: v.grant(slots=1, starts_at=start, key="one-grant"))
    assert all(isinstance(a, gpb.ReservationGrant) for a in answers), answers
    assert len({a.id for a in answers}) == 1


# --- another tenant's ids -----------------------------------------------------------------------

def test_another_tenants_grant_and_instance_are_not_found_and_its_usage_is_denied(v: Vps, other) -> None:
    w, theirs = other
    g = active_grant(v, slots=1)
    mine = v.instance()
    assert outcome(lambda: v.get_grant(g.id, tenant=w.tenant, stubs=theirs))[1:] == ("NOT_FOUND", {"grantId": g.id})
    assert outcome(lambda: v.get_grant(g.id, stubs=theirs))[1] == "ACCESS_DENIED"
    assert [x.id for x in theirs("grants", "List", gpb.ListReservationGrantsRequest(tenant_id=w.tenant)).items] == []
    assert outcome(lambda: theirs("grants", "List", gpb.ListReservationGrantsRequest(
        tenant_id=w.tenant, all=True)))[1] == "ACCESS_DENIED"
    for method in ("Get", "Stop", "Start", "Delete"):
        assert outcome(lambda: v.instance_call(method, mine.id, theirs, tenant=w.tenant))[1:] == (
            "NOT_FOUND", {"instanceId": mine.id}), method
        assert outcome(lambda: v.instance_call(method, mine.id, theirs))[1] == "ACCESS_DENIED", method
    assert v.instance_call("Get", mine.id).state == "running"
    assert outcome(lambda: v.usage(stubs=theirs))[1] == "ACCESS_DENIED"
    # Their instance in my project is refused: the project is not theirs.
    project = v.user("projects", "Create", vpb.CreateProjectRequest(tenant_id=v.world.tenant, name="p"))
    assert outcome(lambda: v.instance(theirs, tenant=w.tenant, project_id=project.id))[1:] == (
        "NOT_FOUND", {"projectId": project.id})


# --- bad amounts and terms -------------------------------------------------------------------------

@pytest.mark.parametrize(("kw", "field"), [
    ({"slots": 0}, "slots"), ({"slots": -1}, "slots"), ({"slots": 100_001}, "slots"), ({"slots": 2**31 - 1}, "slots"),
    ({"starts_at": -1}, "startsAt"), ({"ends_at": -5}, "endsAt"),
    ({"starts_at": 2**62, "ends_at": 2**62 + 1}, "startsAt"), ({"starts_at": 2**63 - 2, "ends_at": 2**63 - 1}, "startsAt"),
    ({"ends_at": 2**63 - 1}, "endsAt"), ({"starts_at": 0, "ends_at": 1}, "startsAt"),
])
def test_absurd_grant_amounts_and_terms_are_invalid_input(v: Vps, kw: dict, field: str) -> None:
    if "starts_at" not in kw:
        kw["starts_at"] = v.now()
    code, reason, details = outcome(lambda: v.grant(**kw))
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", field)
    assert v.world.sql("SELECT count(*) FROM reservation_grants") == [(0,)]


def test_ends_before_starts_is_invalid_input(v: Vps) -> None:
    now = v.now()
    for ends in (now, now - 1):
        code, reason, details = outcome(lambda: v.grant(starts_at=now, ends_at=ends))
        assert (reason, details["field"]) == ("INVALID_INPUT", "endsAt")


@pytest.mark.parametrize(("kw", "field"), [
    ({"from": -1}, "from"), ({"from": 2**63 - 1}, "from"), ({"to": 0}, "to"), ({"to": -5}, "to"),
    ({"to": 2**63 - 1}, "to"), ({"meter": "A" * 10}, "meter"), ({"pool_id": "x"}, "poolId"),
])
def test_absurd_usage_queries_are_invalid_input(v: Vps, kw: dict, field: str) -> None:
    code, reason, details = outcome(lambda: v.usage(**kw))
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", field)


def test_bad_instance_billing_is_invalid_input(v: Vps) -> None:
    for billing in ("free", "NONE", " none"):
        code, reason, details = outcome(lambda: v.instance(billing=billing))
        assert (reason, details["field"]) == ("INVALID_INPUT", "billing")
    assert running_rows(v) == 0


# --- a grant after it ended, and a provider that refuses ------------------------------------------

def test_an_ended_grants_stopped_instance_restarts_outside_it(v: Vps, other) -> None:
    w, theirs = other
    v.put(2)
    v.scan()
    g = active_grant(v, slots=1)
    mine = v.instance()
    v.instance_call("Stop", mine.id)
    v.end(g.id)
    assert v.instance_call("Get", mine.id).grant_id == ""
    theirs_two = [v.instance(theirs, tenant=w.tenant) for _ in range(2)]
    assert [i.placement for i in theirs_two] == ["reserved", "reserved"]
    code, reason, _ = outcome(lambda: v.instance_call("Start", mine.id))
    assert reason == "CAPACITY_UNAVAILABLE"
    assert v.instance_call("Get", mine.id).state == "stopped"


def test_a_start_the_provider_refuses_leaves_the_instance_stopped_and_unbilled(v: Vps) -> None:
    mine = v.instance()
    v.instance_call("Stop", mine.id)
    v.put(0)  # the provider shrank the reservation; the control plane has not scanned yet
    code, reason, details = outcome(lambda: v.instance_call("Start", mine.id))
    assert reason == "CAPACITY_UNAVAILABLE" and details["reason"] == "provider-exhausted"
    assert v.instance_call("Get", mine.id).state == "stopped"
    assert v.world.sql("SELECT count(*) FROM instance_segments WHERE instance_id = %s AND ended_at IS NULL",
                       (mine.id,)) == [(0,)]


def test_a_create_the_provider_refuses_leaves_nothing(v: Vps) -> None:
    v.put(0)
    code, reason, details = outcome(lambda: v.instance(key="refused"))
    assert (reason, details["reason"]) == ("CAPACITY_UNAVAILABLE", "provider-exhausted")
    assert v.world.sql("SELECT count(*) FROM instances") == [(0,)]
    assert v.world.sql("SELECT count(*) FROM instance_segments") == [(0,)]
    v.put(4)
    assert v.instance(key="refused").state == "running"


def test_one_key_for_two_flavors_at_once_is_one_instance_and_conflicts(v: Vps) -> None:
    v.sim.put("res-2", 4, account=v.external, flavor="n2-standard-4")
    v.scan()
    v.root("accounts", "BindReservation", vpb.BindReservationRequest(
        tenant_id="root", account_id=v.account_id, reservation_id="res-2", pool_id=v.world.pool_id))
    answers = at_once(lambda i: v.instance(name="same", key="two-flavors",
                                           flavor="n2-standard-4" if i % 2 else "n2-standard-8"))
    made = {a.id for a in answers if isinstance(a, ipb.Instance)}
    assert len(made) == 1
    for code, reason, details in (a for a in answers if not isinstance(a, ipb.Instance)):
        assert (code, reason) == (grpc.StatusCode.ABORTED, "CONFLICT"), reason
        assert details in ({"instanceId": next(iter(made))}, {"idempotencyKey": "two-flavors"})


# --- spot: a victim that tries to keep its devices, and regular creates at once -------------------

@pytest.fixture
def spot_world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=256)
    w.sql("UPDATE pools SET policy = policy || '{\"spot\": {\"noticeSeconds\": 2}}'::jsonb WHERE id = %s",
          (w.pool_id,))
    w.add_node(gpus(f"spot-{w.tenant}", 8))
    w.server = server
    yield w
    w.close()


def settled(w: World, **kw: Any) -> Any:
    r = w.create(**kw)
    w.server.call(w.server.app.runtime.capacity.barrier())
    return r


def test_a_spot_victim_cannot_extend_its_way_past_the_notice(spot_world: World) -> None:
    w = spot_world
    victim = settled(w, count=8, spot=True, duration="8h")
    regular = settled(w, count=8, duration="1h")
    assert regular.state == "placed"
    cut = regular.during.start
    for kw in ({"by": "4h"}, {"until": cut + 3_600_000}):
        answer = w.user.res("Extend", rpb.ExtendReservationRequest(
            tenant_id=w.tenant, reservation_id=victim.id, idempotency_key=f"x-{uuid.uuid4().hex[:8]}", **kw))
        assert not answer.extended and answer.reservation.during.end == cut
    check_invariants(w.conninfo, w.tenant)


def test_twenty_regular_creates_at_once_on_spot_work_book_no_atom_twice(spot_world: World) -> None:
    w = spot_world
    for _ in range(4):
        settled(w, count=2, spot=True, duration="8h")
    answers = at_once(lambda i: w.create(count=2, duration="1h"))
    placed = [a for a in answers if isinstance(a, rpb.Reservation) and a.state == "placed"]
    assert 1 <= len(placed) <= 4
    for a in answers:
        assert isinstance(a, rpb.Reservation), a
    check_invariants(w.conninfo, w.tenant)


# --- the meter after an outage of the grant worker --------------------------------------------------

def test_an_instance_is_not_billed_twice_when_the_grant_worker_is_late(v: Vps) -> None:
    """The grant's start is applied late (the worker was down): the hours the grant covers must not
    have been metered at the reservation rate before it took the instance in."""
    start = v.now()
    inst = v.instance()
    created = v.world.sql("SELECT epoch_ms(created_at) FROM instances WHERE id = %s", (inst.id,))[0][0]
    g = v.grant(slots=1, starts_at=start + HOUR, ends_at=start + 5 * HOUR)
    v.world.sql("UPDATE work_items SET run_at = compute_now() + interval '30 days'"
                " WHERE kind = 'grant' AND subject = %s", (g.id,))
    now = v.advance(3 * HOUR) - 5 * MIN  # the instance meter waits the five minutes a grant may start in the past
    last_hour = now - now % HOUR - HOUR
    # The gpu meter runs after the instance meter in each pass: once it reached the last hour, the
    # instance meter has had its pass over these hours.
    until(lambda: progress(v, "gpu") > last_hour)
    reserved = metered(v, "vm.reserved.instance.hours", f"instance/{inst.id}")
    assert reserved <= (start + HOUR - created) / HOUR + 1e-6, "billed at the reservation rate inside the grant"
    v.world.sql("SELECT schedule_work('grant', %s, compute_now())", (g.id,))  # the worker is back
    until(lambda: v.get_grant(g.id).state == "active")
    until(lambda: progress(v, "vps.instances") > last_hour)
    assert metered(v, "vm.reserved.instance.hours", f"instance/{inst.id}") == pytest.approx(
        (start + HOUR - created) / HOUR)
    assert metered(v, "vm.grant.usage.hours", f"instance/{inst.id}") == pytest.approx(
        (last_hour + HOUR - start - HOUR) / HOUR)


# --- billing 'none' -------------------------------------------------------------------------------

def test_a_policy_can_keep_a_tenant_from_running_instances_unbilled(v: Vps) -> None:
    """billing 'none' is never metered: the tenant's policy sees it and can forbid it."""
    v.world.policy('permit(principal, action, resource);\n'
                   'forbid(principal, action == Action::"compute:instances:manage", resource)'
                   ' when { resource has billing && resource.billing == "none" };')
    code, reason, _ = outcome(lambda: v.instance(billing="none"))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    assert running_rows(v) == provider_in_use(v) == 0
    assert v.instance().billing == "standard"




def test_an_account_is_not_deleted_under_its_instances_which_stay_unchanged_and_delete_cleanly(v: Vps) -> None:
    """Root deleting the account would leave its instances running at the provider, unbilled and
    out of the tenant's reach: refused (INVALID_STATE naming an instance), nothing half-written."""
    mine = v.instance()
    v.instance_call("Stop", (stopped := v.instance()).id)
    delete = vpb.GetProviderAccountRequest(tenant_id="root", account_id=v.account_id)
    code, reason, details = outcome(lambda: v.root("accounts", "Delete", delete))
    assert (code, reason, details["instanceId"]) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE", mine.id)
    for target, state in ((mine, "running"), (stopped, "stopped")):
        got = v.instance_call("Get", target.id)
        assert (got.state, got.placement) == (state, target.placement)  # nothing half-written
    assert v.world.sql("SELECT count(*) FROM instance_segments WHERE instance_id = %s", (stopped.id,)) == [(1,)]
    for target in (mine, stopped):
        assert v.instance_call("Delete", target.id).state == "deleted"
    assert v.world.sql("SELECT count(*) FROM instance_segments WHERE ended_at IS NULL") == [(0,)]
    assert v.root("accounts", "Delete", delete).id == v.account_id


def test_twenty_starts_at_once_take_only_the_free_slot(v: Vps, other) -> None:
    w, theirs = other
    mine = [v.instance() for _ in range(4)]
    for i in mine:
        v.instance_call("Stop", i.id)
    for _ in range(3):
        v.instance(theirs, tenant=w.tenant)
    answers = at_once(lambda n: v.instance_call("Start", mine[n % 4].id))
    started = {a.id for a in answers if isinstance(a, ipb.Instance)}
    assert len(started) == 1
    for code, reason, details in (a for a in answers if not isinstance(a, ipb.Instance)):
        assert (code, reason, details["total"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_UNAVAILABLE", "4")
    assert running_rows(v) == provider_in_use(v) == 4
    overlapping = v.world.sql(
        "SELECT count(*) FROM instance_segments a JOIN instance_segments b ON a.instance_id = b.instance_id"
        " AND a.id < b.id AND tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)")
    assert overlapping == [(0,)]


def test_twenty_projects_at_once_stop_at_the_limit(v: Vps) -> None:
    def create(name: str) -> vpb.Project:
        return v.user("projects", "Create", vpb.CreateProjectRequest(tenant_id=v.world.tenant, name=name))

    answers = at_once(lambda i: create(f"p{i}"))
    made = [a for a in answers if isinstance(a, vpb.Project)]
    assert len(made) == LIMIT
    for code, reason, details in (a for a in answers if not isinstance(a, vpb.Project)):
        assert (code, reason, details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", {
            "reason": "project-limit", "limit": str(LIMIT)})
    assert create(made[0].name) == made[0]  # a retry of one it has is still served
    listed = v.user("projects", "List", vpb.ListProjectsRequest(tenant_id=v.world.tenant)).items
    assert sorted(p.id for p in listed) == sorted(p.id for p in made)


def test_releases_and_cancels_at_once_during_a_notice_leave_the_quota_exact(spot_world: World) -> None:
    w = spot_world
    victims = [settled(w, count=4, spot=True, duration="8h") for _ in range(2)]
    preemptor = settled(w, count=8, duration="1h")
    assert preemptor.state == "placed"
    ids = [r.id for r in (*victims, preemptor)]

    def end(i: int) -> Any:
        rid = ids[i % 3]
        call = "Release" if i % 2 else "Cancel"
        request = (rpb.ReleaseReservationRequest if call == "Release" else rpb.CancelReservationRequest)(
            tenant_id=w.tenant, reservation_id=rid)
        return w.user.res(call, request)

    for answer in at_once(end):
        if not isinstance(answer, rpb.Reservation):
            assert answer[1] == "INVALID_STATE", answer
    until(lambda: all(w.user.res("Get", rpb.GetReservationRequest(tenant_id=w.tenant, reservation_id=rid)).state
                      in ("released", "cancelled") for rid in ids))
    check_invariants(w.conninfo, w.tenant)
    assert w.sql("SELECT count(*) FROM quota_charges WHERE tenant_id = %s AND refunded_at IS NULL", (w.tenant,)) == [(0,)]



def test_the_grantees_instance_goes_into_its_grant_on_another_reservation_of_the_flavor(v: Vps) -> None:
    """Two reservations of the flavor on the pool: the grant is on the second; its grantee's
    instance must go into the grant, not be billed at the reservation rate beside it."""
    v.put(2, "res-0")
    v.scan()
    v.root("accounts", "BindReservation", vpb.BindReservationRequest(
        tenant_id="root", account_id=v.account_id, reservation_id="res-0", pool_id=v.world.pool_id))
    g = active_grant(v, slots=1)  # on res-1
    inside = v.instance()
    assert (inside.reservation_id, inside.placement, inside.grant_id) == ("res-1", "grant", g.id)
    beyond = v.instance()  # the grant is full: an ordinary slot
    assert (beyond.placement, beyond.grant_id) == ("reserved", "")
    assert v.instance(billing="none").placement == "reserved"  # never into a grant


def test_a_grant_on_a_physically_full_reservation_leaves_the_grantee_the_other_one(v: Vps) -> None:
    v.put(2, "res-0")
    v.scan()
    v.root("accounts", "BindReservation", vpb.BindReservationRequest(
        tenant_id="root", account_id=v.account_id, reservation_id="res-0", pool_id=v.world.pool_id))
    active_grant(v, slots=1)  # on res-1
    v.put(0)  # res-1 shrank to nothing at the provider
    v.scan()
    got = v.instance()
    assert (got.reservation_id, got.placement) == ("res-0", "reserved")


def test_a_create_whose_answer_is_lost_leaves_no_instance_running_unseen(v: Vps) -> None:
    """The provider makes the instance and its answer is lost: the control plane must not forget
    it (a VM running at the provider, on a slot, that no row bills), and a retry completes it."""
    v.sim.sim.SetFaults(ppb.Faults(lost_answer_rate=1.0))
    try:
        code, reason, details = outcome(lambda: v.instance(name="lost", key="lost"))
    finally:
        v.sim.faults()
    assert (code, reason, details["reason"]) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_UNAVAILABLE", "provider-unavailable")
    assert provider_in_use(v) <= running_rows(v)  # nothing runs that no row knows of
    again = v.instance(name="lost", key="lost")
    assert again.state == "running"
    assert running_rows(v) == provider_in_use(v) == 1


def test_twenty_stops_and_starts_at_once_never_bill_one_instance_twice(v: Vps) -> None:
    g = active_grant(v, slots=1)
    mine = v.instance()
    for _ in range(4):  # each round races; any round may overlap two segments
        answers = at_once(lambda i: v.instance_call("Stop" if i % 2 else "Start", mine.id))
        assert all(isinstance(a, ipb.Instance) for a in answers), answers
    overlapping = v.world.sql(
        "SELECT count(*) FROM instance_segments a JOIN instance_segments b ON a.instance_id = b.instance_id"
        " AND a.id < b.id AND tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)")
    assert overlapping == [(0,)]
    now = v.instance_call("Get", mine.id)
    assert (now.grant_id, now.placement) == (g.id, "grant")  # its grant's slot, stopped or running
    open_segments = v.world.sql("SELECT count(*) FROM instance_segments WHERE ended_at IS NULL")[0][0]
    assert open_segments == (1 if now.state == "running" else 0)
