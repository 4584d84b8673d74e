"""reservationGrants (spec 001): every rule of create, get, list and end, through the real API,
against the real simulated provider, with the database's clock moved where the state machine
needs it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import grants_pb2 as gpb
from bettercompute.v1 import providers_pb2 as vpb
from controlplane.common.status import error_info
from tests.conftest import module_stack
from tests.support import PERMISSIVE, Client, ServerThread, World, make_world, rpc_error
from tests.vps_support import HOUR, MIN, SimThread, Stubs, Vps, make_vps, own_stack, sim, v, world_of  # noqa: F401 (fixtures)


@pytest.fixture
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from own_stack(pg_uri, provider_scan_seconds=0.3)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    yield from world_of(stack)


def events(v: Vps, tenant: str, prefix: str = "reservation-grant.") -> list[tuple[str, dict]]:
    rows = v.world.sql("SELECT type, data FROM events WHERE tenant_id = %s AND type LIKE %s ORDER BY id",
                       (tenant, prefix + "%"))
    return [(t, d) for t, d in rows]


def wait_state(v: Vps, grant_id: str, state: str, seconds: float = 15) -> gpb.ReservationGrant:
    deadline = time.monotonic() + seconds
    while True:
        g = v.get_grant(grant_id)
        if g.state == state:
            return g
        assert time.monotonic() < deadline, f"grant stayed {g.state}, wanted {state}"
        time.sleep(0.05)


def test_create_returns_a_scheduled_grant_and_publishes_created(v: Vps) -> None:
    start = v.now() + HOUR
    g = v.grant(slots=2, starts_at=start, ends_at=start + 3 * HOUR)
    assert (g.state, g.slots, g.tenant_id, g.pool_id, g.starts_at, g.ends_at) == (
        "scheduled", 2, v.world.tenant, v.world.pool_id, start, start + 3 * HOUR)
    assert g.id.startswith("rgrant_") and g.flavor == "n2-standard-8" and g.region == "eu-1"
    assert events(v, v.world.tenant) == [("reservation-grant.created", {
        "grantId": g.id, "poolId": v.world.pool_id, "slots": 2, "startsAt": start, "endsAt": start + 3 * HOUR,
        "state": "scheduled"})]


# --- who --------------------------------------------------------------------------------------------

def test_create_is_root_only(v: Vps) -> None:
    mine = v.grant_request()
    mine.tenant_id = v.world.tenant  # a member of its own tenant, not of root
    with pytest.raises(grpc.RpcError) as exc:
        v.user("grants", "Create", mine)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    with pytest.raises(grpc.RpcError) as exc:  # naming root without being a member of it
        v.user("grants", "Create", v.grant_request())
    assert rpc_error(exc)[1] == "ACCESS_DENIED"


def test_create_and_end_are_decided_as_providers_manage_on_the_account(v: Vps) -> None:
    g = v.grant()
    v.world.root.admin("PutPolicy", apb.PutPolicyRequest(tenant_id="root", cedar=(
        PERMISSIVE + '\nforbid(principal, action == Action::"compute:providers:manage", resource) '
                     f'when {{ resource.accountId == "{v.account_id}" }};')))
    for call in (lambda: v.grant(), lambda: v.end(g.id)):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert rpc_error(exc)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
        assert rpc_error(exc)[2]["accountId"] == v.account_id


# --- the reservation --------------------------------------------------------------------------------

def test_a_reservation_not_on_the_account_is_not_found(v: Vps, sim: SimThread) -> None:
    for kw in ({"reservation_id": "res-unknown"}, {"account_id": "pacct_" + "0" * 26}):
        with pytest.raises(grpc.RpcError) as exc:
            v.grant(**kw)
        assert rpc_error(exc)[1] == "NOT_FOUND"


def test_a_reservation_not_ready_gone_or_unbound_is_invalid_state(v: Vps, sim: SimThread) -> None:
    from bettercompute.provider.v1 import provider_pb2 as ppb
    sim.sim.PutReservation(ppb.PutReservationRequest(account=v.external, name="res-creating", flavor="n2-standard-8",
                                                     region="eu-1", total=2, state="creating"))
    v.put(2, "res-unbound")
    v.put(2, "res-gone")
    v.scan()
    for name in ("res-creating", "res-gone"):
        v.root("accounts", "BindReservation", vpb.BindReservationRequest(
            tenant_id="root", account_id=v.account_id, reservation_id=name, pool_id=v.world.pool_id))
    v.gone("res-gone")
    v.scan()
    for name, why in (("res-creating", "creating"), ("res-gone", "gone"), ("res-unbound", "unbound")):
        with pytest.raises(grpc.RpcError) as exc:
            v.grant(reservation_id=name)
        code, reason, details = rpc_error(exc)
        assert (code, reason, details["reason"]) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE", why)


def test_a_pool_not_offered_to_the_grantee_is_invalid_input(v: Vps) -> None:
    v.world.root.admin("CreateTenant", apb.CreateTenantRequest(id="outsider", name="outsider"))
    with pytest.raises(grpc.RpcError) as exc:
        v.grant(tenant="outsider")
    assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": "grantTenantId", "poolId": v.world.pool_id,
                                                    "reason": "pool-not-offered"})
    v.world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=v.world.pool_id, tenant_id="outsider"))
    assert v.grant(tenant="outsider").tenant_id == "outsider"


# --- capacity ---------------------------------------------------------------------------------------

def test_overlapping_grants_must_fit_the_total(v: Vps) -> None:
    start = v.now() + HOUR
    v.grant(slots=3, starts_at=start, ends_at=start + 2 * HOUR)
    with pytest.raises(grpc.RpcError) as exc:
        v.grant(slots=2, starts_at=start + HOUR, ends_at=start + 3 * HOUR)
    assert rpc_error(exc)[:2] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_UNAVAILABLE")
    assert rpc_error(exc)[2] == {"total": "4", "granted": "3"}
    # A term that does not overlap, and the one left slot, fit.
    assert v.grant(slots=4, starts_at=start + 2 * HOUR, ends_at=start + 4 * HOUR).state == "scheduled"
    assert v.grant(slots=1, starts_at=start, ends_at=start + HOUR).state == "scheduled"


def test_cancelled_grants_do_not_count(v: Vps) -> None:
    start = v.now() + HOUR
    g = v.grant(slots=4, starts_at=start)
    assert v.end(g.id).state == "cancelled"
    assert v.grant(slots=4, starts_at=start).slots == 4


def test_concurrent_grants_never_over_commit_the_reservation(v: Vps) -> None:
    start = v.now() + HOUR
    outcomes: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            v.grant(slots=1, starts_at=start, key=f"race-{i}")
            result = "ok"
        except grpc.RpcError as exc:
            result = error_info(exc).reason
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["CAPACITY_UNAVAILABLE"] * 8 + ["ok"] * 4
    assert v.world.sql("SELECT sum(slots) FROM reservation_grants WHERE state <> 'cancelled'") == [(4,)]


# --- project, term, fields, idempotency -------------------------------------------------------------

def test_a_project_must_be_the_grantees(v: Vps) -> None:
    mine = v.user("projects", "Create", vpb.CreateProjectRequest(tenant_id=v.world.tenant, name="web"))
    other = make_world(v.world.endpoint, v.world.root, v.world.conninfo, nodes=0)
    theirs = Stubs(other.user)("projects", "Create", vpb.CreateProjectRequest(tenant_id=other.tenant, name="web"))
    with pytest.raises(grpc.RpcError) as exc:
        v.grant(project_id=theirs.id)
    assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": "projectId", "reason": "project-not-grantee"})
    g = v.grant(project_id=mine.id)
    assert g.project_id == mine.id
    assert events(v, v.world.tenant)[-1][1]["projectId"] == mine.id
    other.close()


def test_the_term_starts_at_most_five_minutes_ago_and_ends_after_it_starts(v: Vps) -> None:
    now = v.now()
    with pytest.raises(grpc.RpcError) as exc:
        v.grant(starts_at=now - 6 * MIN)
    assert rpc_error(exc)[1] == "INVALID_INPUT" and rpc_error(exc)[2]["field"] == "startsAt"
    for end in (now, now - MIN):
        with pytest.raises(grpc.RpcError) as exc:
            v.grant(starts_at=now, ends_at=end)
        assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": "endsAt"})
    late = v.grant(starts_at=now - 4 * MIN)  # in the past, within five minutes: it starts at once
    assert wait_state(v, late.id, "active").starts_at == now - 4 * MIN


@pytest.mark.parametrize(("field", "value", "name"), [
    ("tenant_id", "root tenant", "tenantId"),
    ("tenant_id", "x" * 129, "tenantId"),
    ("account_id", "pacct_short", "accountId"),
    ("account_id", "acct_" + "0" * 26, "accountId"),
    ("reservation_id", "r" * 301, "reservationId"),
    ("reservation_id", "res 1", "reservationId"),
    ("grant_tenant_id", "", "grantTenantId"),
    ("grant_tenant_id", "a/b", "grantTenantId"),
    ("project_id", "prj_UPPER" + "0" * 22, "projectId"),
    ("slots", 0, "slots"),
    ("slots", 100_001, "slots"),
    ("starts_at", -1, "startsAt"),
    ("idempotency_key", "", "idempotencyKey"),
    ("idempotency_key", "k" * 129, "idempotencyKey"),
])
def test_every_field_constraint_is_checked(v: Vps, field: str, value: object, name: str) -> None:
    request = v.grant_request()
    setattr(request, field, value)
    with pytest.raises(grpc.RpcError) as exc:
        v.root("grants", "Create", request)
    assert rpc_error(exc)[1] == "INVALID_INPUT" and rpc_error(exc)[2]["field"] == name


def test_the_largest_valid_values_are_taken(v: Vps) -> None:
    v.put(100_000)
    v.scan()
    g = v.grant(slots=100_000, key="k" * 128)
    assert g.slots == 100_000


def test_a_retry_returns_the_grant_and_another_request_under_the_key_conflicts(v: Vps) -> None:
    request = v.grant_request(slots=2, key="once")
    first = v.root("grants", "Create", request)
    again = v.root("grants", "Create", request)
    # The same grant; its state may have moved on (scheduled -> active at startsAt) in between.
    assert again.id == first.id and again.state in ("scheduled", "active")
    again.state = first.state
    assert again == first
    assert v.world.sql("SELECT count(*) FROM reservation_grants") == [(1,)]
    request.slots = 3
    with pytest.raises(grpc.RpcError) as exc:
        v.root("grants", "Create", request)
    assert rpc_error(exc)[:3] == (grpc.StatusCode.ABORTED, "CONFLICT", {"grantId": first.id})


# --- get and list -----------------------------------------------------------------------------------

def test_get_reads_the_tenants_grant_and_root_reads_any(v: Vps) -> None:
    g = v.grant(starts_at=v.now() + HOUR)
    assert v.get_grant(g.id) == g
    assert v.get_grant(g.id, tenant="root", stubs=v.root) == g
    other = make_world(v.world.endpoint, v.world.root, v.world.conninfo, nodes=0)
    with pytest.raises(grpc.RpcError) as exc:
        v.get_grant(g.id, tenant=other.tenant, stubs=Stubs(other.user))
    assert rpc_error(exc)[1:] == ("NOT_FOUND", {"grantId": g.id})
    with pytest.raises(grpc.RpcError) as exc:  # not a member of the tenant it names
        v.get_grant(g.id, tenant=v.world.tenant, stubs=Stubs(other.user))
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    with pytest.raises(grpc.RpcError) as exc:
        v.get_grant("rgrant_nope")
    assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": "grantId"})
    other.close()


def test_get_and_list_are_decided_as_quotas_read_on_the_tenant(v: Vps) -> None:
    g = v.grant()
    v.world.policy(PERMISSIVE + '\nforbid(principal, action == Action::"compute:quotas:read", resource);')
    for call in (lambda: v.get_grant(g.id),
                 lambda: v.user("grants", "List", gpb.ListReservationGrantsRequest(tenant_id=v.world.tenant))):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert rpc_error(exc)[1] == "ACCESS_DENIED"


def test_list_is_newest_first_and_all_is_roots_alone(v: Vps) -> None:
    made = [v.grant(slots=1) for _ in range(3)]
    other = make_world(v.world.endpoint, v.world.root, v.world.conninfo, nodes=0)
    v.world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=v.world.pool_id, tenant_id=other.tenant))
    theirs = v.grant(tenant=other.tenant)
    listed = v.user("grants", "List", gpb.ListReservationGrantsRequest(tenant_id=v.world.tenant)).items
    assert [g.id for g in listed] == [g.id for g in reversed(made)]
    every = v.root("grants", "List", gpb.ListReservationGrantsRequest(tenant_id="root", all=True)).items
    assert [g.id for g in every] == [theirs.id] + [g.id for g in reversed(made)]
    assert v.root("grants", "List", gpb.ListReservationGrantsRequest(tenant_id="root")).items == []
    with pytest.raises(grpc.RpcError) as exc:
        v.user("grants", "List", gpb.ListReservationGrantsRequest(tenant_id=v.world.tenant, all=True))
    assert rpc_error(exc)[1] == "ACCESS_DENIED"
    other.close()


# --- end and the state machine ----------------------------------------------------------------------

def test_the_grant_goes_active_at_its_start_and_ended_at_its_end(v: Vps) -> None:
    start = v.now() + HOUR
    g = v.grant(slots=2, starts_at=start, ends_at=start + HOUR)
    v.advance(HOUR)
    assert wait_state(v, g.id, "active").ends_at == start + HOUR
    v.advance(HOUR)
    ended = wait_state(v, g.id, "ended")
    assert (ended.ends_at, ended.reason) == (start + HOUR, "term")
    data = {"grantId": g.id, "poolId": v.world.pool_id, "slots": 2, "startsAt": start, "endsAt": start + HOUR}
    assert events(v, v.world.tenant) == [
        ("reservation-grant.created", {**data, "state": "scheduled"}),
        ("reservation-grant.active", {**data, "state": "active"}),
        ("reservation-grant.ended", {**data, "state": "ended", "reason": "term"})]


def test_end_moves_ends_at_to_now_and_never_later(v: Vps) -> None:
    start = v.now()
    g = v.grant(starts_at=start, ends_at=start + 3 * HOUR)
    wait_state(v, g.id, "active")
    v.advance(HOUR)
    ended = v.end(g.id)
    assert ended.state == "ended" and ended.reason == "end"
    assert start + HOUR <= ended.ends_at < start + 3 * HOUR
    assert v.end(g.id) == ended  # ended: returned unchanged
    assert events(v, v.world.tenant)[-1] == ("reservation-grant.ended", {
        "grantId": g.id, "poolId": v.world.pool_id, "slots": 1, "startsAt": start, "endsAt": ended.ends_at,
        "state": "ended", "reason": "end"})


def test_end_cancels_a_grant_that_has_not_started(v: Vps) -> None:
    start = v.now() + HOUR
    g = v.grant(starts_at=start, ends_at=start + HOUR)
    cancelled = v.end(g.id)
    assert (cancelled.state, cancelled.ends_at, cancelled.reason) == ("cancelled", start + HOUR, "end")
    assert v.end(g.id) == cancelled
    assert [t for t, _ in events(v, v.world.tenant)] == ["reservation-grant.created", "reservation-grant.cancelled"]
    v.advance(2 * HOUR)  # its wake-ups find it cancelled: it never goes active
    v.world.sql("SELECT 1")
    assert v.get_grant(g.id).state == "cancelled"


def test_end_of_a_grant_of_another_account_is_not_found(v: Vps, sim: SimThread) -> None:
    g = v.grant()
    other = v.root("accounts", "Create", vpb.CreateProviderAccountRequest(
        tenant_id="root", name="other", provider="sim", endpoint=sim.endpoint, external_account="acct-other"))
    with pytest.raises(grpc.RpcError) as exc:
        v.root("grants", "End", gpb.EndReservationGrantRequest(tenant_id="root", account_id=other.id, grant_id=g.id))
    assert rpc_error(exc)[1] == "NOT_FOUND"


# --- unbind, account delete, reservation gone, capacity short, tenant deleted ----------------------

def test_unbind_and_account_delete_refuse_while_a_grant_is_scheduled_or_active(v: Vps) -> None:
    scheduled = v.grant(starts_at=v.now() + HOUR)
    active = v.grant(starts_at=v.now())
    wait_state(v, active.id, "active")
    unbind = vpb.UnbindReservationRequest(tenant_id="root", account_id=v.account_id, reservation_id=v.reservation)
    delete = vpb.GetProviderAccountRequest(tenant_id="root", account_id=v.account_id)
    for service, method, request in (("accounts", "UnbindReservation", unbind), ("accounts", "Delete", delete)):
        with pytest.raises(grpc.RpcError) as exc:
            v.root(service, method, request)
        code, reason, details = rpc_error(exc)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
        assert sorted(details["grantIds"].strip('[]').replace('"', '').split(", ")) == sorted([scheduled.id, active.id])
    v.end(scheduled.id)
    v.end(active.id)
    assert v.root("accounts", "UnbindReservation", unbind).pool_id == ""


def test_account_delete_waits_until_the_ended_grants_are_metered_then_removes_them(v: Vps) -> None:
    start = v.now()
    ended = v.grant(starts_at=start, ends_at=start + 2 * HOUR)
    cancelled = v.grant(starts_at=start + 5 * HOUR)
    v.end(cancelled.id)
    wait_state(v, ended.id, "active")
    v.end(ended.id)
    delete = vpb.GetProviderAccountRequest(tenant_id="root", account_id=v.account_id)
    with pytest.raises(grpc.RpcError) as exc:
        v.root("accounts", "Delete", delete)
    assert rpc_error(exc)[1:] == ("INVALID_STATE", {"accountId": v.account_id, "grantIds": f'["{ended.id}"]'})
    v.advance(2 * HOUR)  # past the hour the grant ended in: the metering worker's next pass meters it
    deadline = time.monotonic() + 15
    while v.world.sql("SELECT metered_until < ends_at FROM reservation_grants WHERE id = %s",
                      (ended.id,)) != [(False,)]:
        assert time.monotonic() < deadline, "the grant was never metered to its end"
        time.sleep(0.05)
    assert v.root("accounts", "Delete", delete).id == v.account_id
    assert v.world.sql("SELECT count(*) FROM reservation_grants") == [(0,)]
    assert v.world.sql("SELECT count(*) FROM usage_records WHERE subject = %s", (f"grant/{ended.id}",)) != [(0,)]


def test_a_gone_reservation_ends_active_grants_and_cancels_scheduled_ones(v: Vps) -> None:
    active = v.grant(slots=2, starts_at=v.now())
    scheduled = v.grant(slots=2, starts_at=v.now() + HOUR)
    wait_state(v, active.id, "active")
    v.gone()
    assert [r.state for r in v.scan()] == ["gone"]
    ended, cancelled = v.get_grant(active.id), v.get_grant(scheduled.id)
    assert (ended.state, ended.reason, cancelled.state, cancelled.reason) == (
        "ended", "reservation-gone", "cancelled", "reservation-gone")
    assert ended.ends_at < active.ends_at
    kinds = sorted((t, d["grantId"], d.get("reason")) for t, d in events(v, v.world.tenant)[-2:])
    assert kinds == [("reservation-grant.cancelled", scheduled.id, "reservation-gone"),
                     ("reservation-grant.ended", active.id, "reservation-gone")]


def test_a_total_below_the_peak_overlap_publishes_capacity_short_once_per_change(v: Vps) -> None:
    start = v.now() + HOUR
    a = v.grant(slots=2, starts_at=start, ends_at=start + 2 * HOUR)
    b = v.grant(slots=1, starts_at=start + HOUR, ends_at=start + 3 * HOUR)
    c = v.grant(slots=1, starts_at=start + 2 * HOUR, ends_at=start + 4 * HOUR)  # peak overlap: 3 (a + b)
    v.put(3)
    v.scan()
    assert events(v, "root", "reservation-grant.capacity-short") == []
    v.put(2)
    v.scan()
    v.scan()  # the same total again: no second event
    v.put(1)
    v.scan()
    short = events(v, "root", "reservation-grant.capacity-short")
    ids = sorted([a.id, b.id, c.id])
    assert short == [
        ("reservation-grant.capacity-short", {"accountId": v.account_id, "reservationId": v.reservation,
                                              "total": 2, "grantedSlots": 3, "grantIds": ids}),
        ("reservation-grant.capacity-short", {"accountId": v.account_id, "reservationId": v.reservation,
                                              "total": 1, "grantedSlots": 3, "grantIds": ids})]
    assert {v.get_grant(g.id).state for g in (a, b, c)} == {"scheduled"}  # they keep billing: root decides


def test_deleting_a_tenant_ends_its_active_grants_and_cancels_its_scheduled_ones(v: Vps) -> None:
    from controlplane import db
    from controlplane.vps import lifecycle
    active = v.grant(starts_at=v.now())
    scheduled = v.grant(starts_at=v.now() + HOUR)
    wait_state(v, active.id, "active")
    server = v.server
    server.call(db.run_in_transaction(server.app.pool, lambda conn: lifecycle.end_for_tenant(conn, v.world.tenant)))
    assert (v.get_grant(active.id).state, v.get_grant(active.id).reason) == ("ended", "tenant-deleted")
    assert (v.get_grant(scheduled.id).state, v.get_grant(scheduled.id).reason) == ("cancelled", "tenant-deleted")


# --- the vps.reservations scan ----------------------------------------------------------------------

def test_the_periodic_scan_records_new_reservations_and_total_changes(v: Vps) -> None:
    v.put(7)
    v.put(3, "res-new")
    deadline = time.monotonic() + 15
    while v.world.sql("SELECT reservation_id, total FROM provider_reservations ORDER BY 1") != [
            ("res-1", 7), ("res-new", 3)]:
        assert time.monotonic() < deadline, "the scan worker never recorded the provider's reservations"
        time.sleep(0.05)


def test_a_failing_or_stalled_provider_is_not_a_gone_reservation(v: Vps, sim: SimThread) -> None:
    g = v.grant(starts_at=v.now())
    wait_state(v, g.id, "active")
    try:
        for faults in ({"failure_rate": 1.0}, {"stall_ms": 1500}):
            sim.faults(**faults)
            with pytest.raises(grpc.RpcError) as exc:
                v.scan()
            assert rpc_error(exc)[1] == "CAPACITY_UNAVAILABLE"
            assert rpc_error(exc)[2]["reason"] == "provider-unavailable"
            assert v.get_grant(g.id).state == "active"  # a gone reservation would have ended it
            sim.faults()
            assert [r.state for r in v.scan()] == ["ready"]
    finally:
        sim.faults()


def test_list_answers_at_most_the_configured_number(pg_uri: str, sim: SimThread) -> None:
    """The spec's 1000 is BC_GRANTS_LIST_MAX; with 2, three grants list as the newest two."""
    stack = module_stack(pg_uri, grants_list_max=2)
    server, root = next(stack)
    try:
        w = make_world(server.endpoint, root, server.conninfo, nodes=0)
        small = make_vps(w, sim, total=4)
        made = [small.grant(starts_at=small.now() + HOUR) for _ in range(3)]
        listed = small.user("grants", "List", gpb.ListReservationGrantsRequest(tenant_id=w.tenant)).items
        assert [g.id for g in listed] == [made[2].id, made[1].id]
        w.close()
    finally:
        stack.close()


def test_a_reservation_whose_name_we_cannot_take_is_skipped_not_fatal(v: Vps) -> None:
    v.put(2, "bad name")
    v.put(2, "res-2")
    assert [r.reservation_id for r in v.scan()] == ["res-1", "res-2"]


def test_a_subscriber_watching_reservation_grant_events_reads_them(v: Vps) -> None:
    from google.protobuf.json_format import MessageToDict

    from tests.test_watch import Stream
    stream = Stream(v.world.user, tenant_id=v.world.tenant, types=["reservation-grant."])
    start = v.now() + HOUR
    g = v.grant(slots=2, starts_at=start, ends_at=start + HOUR)
    v.end(g.id)
    got = stream.take(2)
    assert [(e.type, e.subject) for e in got] == [("reservation-grant.created", f"reservation-grant/{g.id}"),
                                                  ("reservation-grant.cancelled", f"reservation-grant/{g.id}")]
    assert MessageToDict(got[1].data) == {"grantId": g.id, "poolId": v.world.pool_id, "slots": 2, "startsAt": start,
                                          "endsAt": start + HOUR, "state": "cancelled", "reason": "end"}
    stream.call.cancel()


def test_binding_to_another_pool_refuses_while_a_grant_is_live(v: Vps) -> None:
    g = v.grant(starts_at=v.now() + HOUR)
    other = v.world.root.admin("CreatePool", apb.CreatePoolRequest(owner_tenant_id=v.world.tenant, name="p2")).id
    rebind = vpb.BindReservationRequest(tenant_id="root", account_id=v.account_id, reservation_id=v.reservation,
                                        pool_id=other)
    with pytest.raises(grpc.RpcError) as exc:
        v.root("accounts", "BindReservation", rebind)
    assert rpc_error(exc)[1:] == ("INVALID_STATE", {"reservationId": v.reservation, "grantIds": f'["{g.id}"]'})
    v.end(g.id)
    assert v.root("accounts", "BindReservation", rebind).pool_id == other


def test_a_live_grant_keeps_its_pool_offered_to_the_grantee(v: Vps) -> None:
    """Admin.WithdrawPoolOffer is refused while the tenant holds a live grant on the pool (the
    grant was made because the pool was offered); once the grant ended, the offer can go."""
    world = v.world
    world.root.admin("CreateTenant", apb.CreateTenantRequest(id="guest", name="guest"))
    world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id="guest"))
    grant = v.grant(tenant="guest")
    withdraw = apb.WithdrawPoolOfferRequest(pool_id=world.pool_id, tenant_id="guest")
    with pytest.raises(grpc.RpcError) as exc:
        world.root.admin("WithdrawPoolOffer", withdraw)
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["grantId"], details["tenantId"]) == (
        grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE", grant.id, "guest")
    [pool] = [p for p in world.root.admin("ListPools", apb.ListPoolsRequest()).items if p.id == world.pool_id]
    assert "guest" in pool.offered_to
    v.end(grant.id)
    assert "guest" not in world.root.admin("WithdrawPoolOffer", withdraw).offered_to
