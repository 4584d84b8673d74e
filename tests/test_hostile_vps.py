"""A hostile tenant and a careless operator against instances, provider reservations and the
usage ledger (spec 001): ids of the wrong kind, absurd names, calls made twice, provider calls
that land late or out of order, usage windows in the future, and the ledger's totals. Every
refusal carries the spec's code and details; the provider ends up running what the rows bill."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bettercompute.provider.v1 import provider_pb2 as ppb
from bettercompute.v1 import grants_pb2 as gpb
from bettercompute.v1 import instances_pb2 as ipb
from bettercompute.v1 import providers_pb2 as vpb
from controlplane.ids import new_id
from tests.support import Client, ServerThread, World
from tests.vps_support import (FLAVOR, HOUR, MIN, SimThread, Vps, metered, outcome, own_stack, progress,  # noqa: F401 (fixtures)
                               sim, v, world_of)


ROWS = 3  # ledger rows one usage query answers, in this module
TASKS = 20


@pytest.fixture
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from own_stack(pg_uri, usage_query_max_rows=ROWS)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    yield from world_of(stack)


def at_provider(v: Vps, name: str) -> str:
    """The instance's state at the provider."""
    return v.sim.provider.GetInstance(ppb.InstanceRef(account=v.external, name=name)).state


def until(check: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def rows(v: Vps) -> int:
    return v.world.sql("SELECT count(*) FROM instances WHERE tenant_id = %s", (v.world.tenant,))[0][0]


# --- ids of the wrong kind, absurd names ---------------------------------------------------------

@pytest.mark.parametrize("wrong", [
    "rgrant_" + "0" * 26, "pool_" + "0" * 26, "rsv_" + "0" * 26, "inst_" + "0" * 25, "inst_" + "0" * 53,
    "inst_" + "O" * 26, "INST_" + "0" * 26, "inst_" + "0" * 26 + "\n", "inst_" + "0" * 26 + "\x00", "",
    "inst_" + "0" * 1_000_000,
])
def test_an_instance_id_of_the_wrong_kind_is_invalid_input_naming_it(v: Vps, wrong: str) -> None:
    for method in ("Get", "Stop", "Start", "Delete"):
        code, reason, details = outcome(lambda: v.instance_call(method, wrong))
        assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT",
                                                    "instanceId"), method


@pytest.mark.parametrize(("kw", "field"), [
    ({"name": "x" * 1_000_000}, "name"), ({"name": "x" * 129}, "name"), ({"name": "vm-é"}, "name"),
    ({"name": "vm\x00"}, "name"), ({"name": "vm\n"}, "name"), ({"name": ""}, "name"), ({"name": "vm 1"}, "name"),
    ({"flavor": "f" * 1_000_000}, "flavor"), ({"flavor": "n2\u2010standard"}, "flavor"),
    ({"key": "k" * 129}, "idempotencyKey"), ({"key": "k\u00e9"}, "idempotencyKey"),
    ({"pool_id": "pool_" + "0" * 26 + "\n"}, "poolId"), ({"pool_id": "rgrant_" + "0" * 26}, "poolId"),
    ({"project_id": "pool_" + "0" * 26}, "projectId"), ({"project_id": ""}, "projectId"),
    ({"billing": "none\x00"}, "billing"), ({"billing": "b" * 1_000_000}, "billing"),
])
def test_absurd_instance_fields_are_invalid_input_and_make_nothing(v: Vps, kw: dict, field: str) -> None:
    code, reason, details = outcome(lambda: v.instance(**kw))
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", field)
    assert rows(v) == 0
    assert v.sim.provider.ListInstances(ppb.ListInstancesRequest(account=v.external)).items == []


@pytest.mark.parametrize("name", ["p" * 1_000_000, "p" * 129, "projé", "p\x00", "p\n", "", "a/b"])
def test_absurd_project_names_are_invalid_input(v: Vps, name: str) -> None:
    code, reason, details = outcome(lambda: v.user("projects", "Create", vpb.CreateProjectRequest(
        tenant_id=v.world.tenant, name=name)))
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "name")


def test_ids_of_the_wrong_kind_for_grants_are_invalid_input_naming_them(v: Vps) -> None:
    made = v.instance()
    code, reason, details = outcome(lambda: v.get_grant(made.id))
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "grantId")
    code, reason, details = outcome(lambda: v.root("grants", "End", gpb.EndReservationGrantRequest(
        tenant_id="root", account_id=v.world.pool_id, grant_id="rgrant_" + "0" * 26)))
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "accountId")
    code, reason, details = outcome(lambda: v.grant(project_id=made.id))
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "projectId")


def test_a_nonexistent_instance_of_the_right_kind_is_not_found(v: Vps) -> None:
    ghost = "inst_" + "0" * 26
    for method in ("Get", "Stop", "Start", "Delete"):
        assert outcome(lambda: v.instance_call(method, ghost))[1:] == ("NOT_FOUND", {"instanceId": ghost}), method


# --- calls made twice ------------------------------------------------------------------------------

def test_stop_twice_and_delete_twice_answer_the_same_and_bill_once(v: Vps) -> None:
    made = v.instance(key="once")
    first, second = (v.instance_call("Stop", made.id) for _ in range(2))
    assert first == second and first.state == "stopped"
    gone, again = (v.instance_call("Delete", made.id) for _ in range(2))
    assert gone == again and gone.state == "deleted"
    assert v.world.sql("SELECT count(*), count(ended_at) FROM instance_segments WHERE instance_id = %s",
                       (made.id,)) == [(1, 1)]
    assert at_provider(v, made.id) == "deleted"
    code, reason, _ = outcome(lambda: v.instance_call("Start", made.id))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
    # A retry of its create answers the deleted instance: nothing is made again.
    assert v.instance(name=made.name, key="once") == gone
    assert rows(v) == 1


def test_twenty_stops_starts_and_deletes_at_once_end_deleted_billed_once_and_deleted_at_the_provider(v: Vps) -> None:
    made = v.instance()
    calls = ("Stop", "Start", "Delete", "Start")
    with ThreadPoolExecutor(TASKS) as pool:
        answers = list(pool.map(lambda i: outcome(lambda: v.instance_call(calls[i % 4], made.id)), range(TASKS)))
    for answer in answers:  # a call after the delete is INVALID_STATE; a provider that lost the race, retry
        if not isinstance(answer, ipb.Instance):
            assert answer[1] in ("INVALID_STATE", "CAPACITY_UNAVAILABLE"), answer
    assert v.instance_call("Get", made.id).state == "deleted"
    assert v.world.sql("SELECT count(*) FROM instance_segments WHERE instance_id = %s AND ended_at IS NULL",
                       (made.id,)) == [(0,)]
    overlapping = v.world.sql(
        "SELECT count(*) FROM instance_segments a JOIN instance_segments b ON a.instance_id = b.instance_id"
        " AND a.id < b.id AND tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)")
    assert overlapping == [(0,)]
    v.scan()
    assert at_provider(v, made.id) == "deleted"


# --- provider calls that land late or out of order -------------------------------------------------

def test_a_start_that_lands_after_the_stop_that_followed_it_is_stopped_by_the_next_scan(v: Vps) -> None:
    """Start, then Stop: the provider carries the start out last (its answer was slow). The rows say
    stopped and bill nothing, so the instance must not go on running there for free."""
    made = v.instance()
    v.instance_call("Stop", made.id)
    v.sim.provider.StartInstance(ppb.InstanceRef(account=v.external, name=made.id))  # the late start
    assert at_provider(v, made.id) == "running"
    v.scan()
    assert at_provider(v, made.id) == "stopped"
    assert v.instance_call("Get", made.id).state == "stopped"


def test_a_stop_that_lands_after_the_start_that_followed_it_is_started_by_the_next_scan(v: Vps) -> None:
    """Stop, then Start: the provider carries the stop out last. The rows bill it as running, so it
    must run."""
    made = v.instance()
    v.instance_call("Stop", made.id)
    v.instance_call("Start", made.id)
    v.sim.provider.StopInstance(ppb.InstanceRef(account=v.external, name=made.id))  # the late stop
    v.scan()
    assert at_provider(v, made.id) == "running"
    assert v.instance_call("Get", made.id).state == "running"


def test_a_create_that_lands_after_its_delete_is_deleted_by_the_next_scan(v: Vps) -> None:
    """The tenant lists its new instance and deletes it while the create's provider call is still
    on its way; the provider carries the create out after the delete (which found nothing)."""
    made = v.instance()
    v.instance_call("Delete", made.id)
    v.sim.provider.CreateInstance(ppb.CreateInstanceRequest(  # the late create
        account=v.external, name=made.id, flavor=FLAVOR, region="eu-1", reservation=v.reservation))
    assert at_provider(v, made.id) == "running"
    v.scan()
    assert at_provider(v, made.id) == "deleted"


def test_machines_no_row_knows_are_left_alone(v: Vps) -> None:
    """The provider account may hold other machines, another deployment's (named like ours) among
    them: they are not ours to stop or delete."""
    theirs = "inst_" + uuid.uuid4().hex[:26]
    for name in (theirs, "web-1"):
        v.sim.provider.CreateInstance(ppb.CreateInstanceRequest(
            account=v.external, name=name, flavor=FLAVOR, region="eu-1", reservation=v.reservation))
    v.sim.provider.StopInstance(ppb.InstanceRef(account=v.external, name="web-1"))
    v.scan()
    assert (at_provider(v, theirs), at_provider(v, "web-1")) == ("running", "stopped")


def test_an_account_registered_twice_keeps_its_instances(v: Vps) -> None:
    """A careless operator registers the same provider account a second time: refused since the
    fifth hostile round (its reservations would be granted twice over); a twin row registered
    before that (written here directly) must still not take the first's instances, at its scan,
    for machines of nobody."""
    made = v.instance()
    code, reason, details = outcome(lambda: v.root("accounts", "Create", vpb.CreateProviderAccountRequest(
        tenant_id="root", name="twin", provider="sim", endpoint=v.sim.endpoint, external_account=v.external)))
    assert (code, reason, details["accountId"]) == (grpc.StatusCode.ABORTED, "CONFLICT", v.account_id)
    twin = v.world.sql("INSERT INTO provider_accounts (id, name, provider, endpoint, external_account)"
                       " VALUES (%s, 'twin', 'sim', %s, %s) RETURNING id",
                       (new_id("pacct"), v.sim.endpoint, v.external))[0][0]
    v.root("accounts", "ScanReservations", vpb.GetProviderAccountRequest(tenant_id="root", account_id=twin))
    assert at_provider(v, made.id) == "running"
    v.instance_call("Stop", made.id)
    v.sim.provider.StartInstance(ppb.InstanceRef(account=v.external, name=made.id))  # a late start
    v.root("accounts", "ScanReservations", vpb.GetProviderAccountRequest(tenant_id="root", account_id=twin))
    assert at_provider(v, made.id) == "stopped"


def test_a_create_given_up_on_that_lands_after_its_undo_is_deleted_by_the_next_scan(v: Vps) -> None:
    """The provider does not answer a create in time: the control plane asks it to delete what it may
    have made and gives up; the create, still on its way, lands after that delete. The instance
    runs at the provider, on a slot, unbilled, unless the control plane still knows its name."""
    v.sim.sim.SetFaults(ppb.Faults(failure_rate=1.0))
    try:
        code, reason, details = outcome(lambda: v.instance(key="given-up"))
    finally:
        v.sim.faults()
    assert (code, reason, details["reason"]) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_UNAVAILABLE", "provider-unavailable")
    [(name, state)] = v.world.sql("SELECT id, state FROM instances WHERE tenant_id = %s", (v.world.tenant,))
    assert state == "deleted"
    assert v.world.sql("SELECT count(*) FROM instance_segments WHERE instance_id = %s AND ended_at > started_at",
                       (name,)) == [(0,)]  # billed nothing
    v.sim.provider.CreateInstance(ppb.CreateInstanceRequest(  # the create lands after all
        account=v.external, name=name, flavor=FLAVOR, region="eu-1", reservation=v.reservation))
    v.scan()
    assert at_provider(v, name) == "deleted"
    again = v.instance(key="given-up")  # the key decides anew
    assert again.id != name and again.state == "running"
    assert [i.id for i in v.user("instances", "List", ipb.ListInstancesRequest(tenant_id=v.world.tenant)).items] == [
        again.id]


def test_a_scan_the_provider_does_not_answer_changes_nothing_and_the_next_brings_it_in_line(v: Vps) -> None:
    made = v.instance()
    v.instance_call("Stop", made.id)
    v.sim.provider.StartInstance(ppb.InstanceRef(account=v.external, name=made.id))  # a late start
    v.sim.sim.SetFaults(ppb.Faults(failure_rate=1.0))
    try:
        code, reason, details = outcome(v.scan)
    finally:
        v.sim.faults()
    assert (code, reason, details["reason"]) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_UNAVAILABLE", "provider-unavailable")
    assert at_provider(v, made.id) == "running"
    assert [r.reservation_id for r in v.scan()] == [v.reservation]
    assert at_provider(v, made.id) == "stopped"


# --- the usage ledger ------------------------------------------------------------------------------

def test_a_usage_window_in_the_future_or_before_anything_is_empty(v: Vps) -> None:
    v.instance()
    now = v.advance(3 * HOUR)
    for window in ({"from": now + HOUR}, {"from": now + HOUR, "to": now + 5 * HOUR}, {"from": 0, "to": 1}):
        answer = v.usage(**window)
        assert (list(answer.items), answer.total) == ([], 0), window


def test_a_usage_answer_cut_at_its_row_limit_says_so_and_totals_the_whole_window(v: Vps) -> None:
    """An operator who bills from `total` must not bill the first rows only, unaware of the rest."""
    start = v.now()
    g = v.grant(slots=1, starts_at=start, ends_at=start + 5 * HOUR)  # six hours, fractions at the ends
    v.advance(6 * HOUR)
    until(lambda: v.world.sql("SELECT metered_until >= ends_at FROM reservation_grants WHERE id = %s",
                              (g.id,)) == [(True,)])
    cut = v.usage(meter="vm.grant.slot.hours", **{"from": 0})
    assert len(cut.items) == ROWS and cut.truncated
    assert cut.total == pytest.approx(5)
    last = cut.items[-1].hour
    rest = v.usage(meter="vm.grant.slot.hours", **{"from": last + HOUR})
    assert len(rest.items) == 6 - ROWS and not rest.truncated
    assert rest.total == pytest.approx(sum(i.quantity for i in rest.items))
    assert sum(i.quantity for i in (*cut.items, *rest.items)) == pytest.approx(5)


def test_a_grant_started_minutes_ago_in_an_hour_already_ended_bills_its_instances_once(v: Vps) -> None:
    """startsAt may be five minutes in the past: a grant made three minutes into an hour may start
    in the hour before. Its tenant's running instance is taken in from that start; the hour it ran
    in at the reservation rate must not have been billed so already (and billed again as the
    grant's slot-hours)."""
    inst = v.instance()
    created = v.world.sql("SELECT epoch_ms(created_at) FROM instances WHERE id = %s", (inst.id,))[0][0]
    now = v.now()
    boundary = now - now % HOUR + HOUR
    if boundary - created < 5 * MIN:  # made in the hour's last minutes: the grant's start would come before it
        boundary += HOUR
    v.advance(boundary + 3 * MIN - now)
    # The gpu meter runs after the instance meter in each pass: once it passed the hour, the
    # instance meter has had its pass over it.
    until(lambda: progress(v, "gpu") >= boundary)
    g = v.grant(slots=1, starts_at=boundary - MIN, ends_at=boundary + 2 * HOUR)
    until(lambda: v.get_grant(g.id).state == "active")
    v.advance(3 * HOUR)
    until(lambda: progress(v, "vps.instances") >= boundary + 2 * HOUR)
    term_end = boundary + 2 * HOUR
    assert metered(v, "vm.reserved.instance.hours", f"instance/{inst.id}", term_end) == pytest.approx(
        (boundary - MIN - created) / HOUR, abs=1e-6)  # created is read rounded to the millisecond
    assert metered(v, "vm.grant.usage.hours", f"instance/{inst.id}", term_end) == pytest.approx(
        (2 * HOUR + MIN) / HOUR)
