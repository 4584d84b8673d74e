"""A property test over random sequences of grant creates and ends, instance creates, stops,
starts and deletes, reservation-gone events and the clock moving on (so grants start and end on
the work queue): no slot is ever used by two instances, no granted slot is used by another
tenant, and every committed slot-hour is metered exactly once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import providers_pb2 as vpb
from controlplane.common.status import error_info
from tests.conftest import module_stack, stateful_examples
from tests.support import Client, ServerThread, make_world
from tests.vps_support import HOUR, MIN, SimThread, Stubs, Vps, make_vps

TOTAL = 4


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, clock_control=True, metering_seconds=0.2, metering_settle_seconds=0,
                            provider_call_seconds=2, provider_scan_seconds=3600)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimThread]:
    s = SimThread()
    yield s
    s.close()


def reason_of(exc: grpc.RpcError) -> str:
    info = error_info(exc)
    return info.reason if info else str(exc.code())


def until(check, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Slots(RuleBasedStateMachine):
    """One account with one reservation of TOTAL slots bound to a pool that two tenants book:
    A (the pool's owner, with a project) and B (offered the pool)."""

    stack: tuple[ServerThread, Client]
    sim: SimThread

    def __init__(self) -> None:
        super().__init__()
        server, root = self.stack
        self.a = make_world(server.endpoint, root, server.conninfo, nodes=0)
        self.v: Vps = make_vps(self.a, self.sim, total=TOTAL)
        self.b = make_world(server.endpoint, root, server.conninfo, nodes=0)
        root.admin("OfferPool", apb.OfferPoolRequest(pool_id=self.a.pool_id, tenant_id=self.b.tenant))
        self.stubs = {self.a.tenant: self.v.user, self.b.tenant: Stubs(self.b.user)}
        self.project = self.v.user("projects", "Create", vpb.CreateProjectRequest(tenant_id=self.a.tenant,
                                                                                  name="web")).id
        self.grants: list[str] = []
        self.instances: dict[str, str] = {}  # id -> tenant
        self.gone = False

    def sql(self, query: str, *params: object) -> list[tuple]:
        return self.a.sql(query, params)

    def tenant(self, which: int) -> str:
        return (self.a.tenant, self.b.tenant)[which]

    @rule(which=st.integers(0, 1), slots=st.integers(1, 3), start=st.sampled_from([-2 * MIN, 0, 30 * MIN, 90 * MIN]),
          length=st.sampled_from([30 * MIN, HOUR, 150 * MIN]), project=st.booleans())
    def create_grant(self, which: int, slots: int, start: int, length: int, project: bool) -> None:
        tenant = self.tenant(which)
        at = self.v.now() + start
        kw = {"project_id": self.project} if project and which == 0 else {}
        try:
            g = self.v.grant(tenant=tenant, slots=slots, starts_at=at, ends_at=at + length, **kw)
            self.grants.append(g.id)
        except grpc.RpcError as exc:
            assert reason_of(exc) in ("CAPACITY_UNAVAILABLE", "INVALID_STATE"), exc

    @precondition(lambda self: self.grants)
    @rule(pick=st.integers(0, 100))
    def end_grant(self, pick: int) -> None:
        self.v.end(self.grants[pick % len(self.grants)])

    @rule(which=st.integers(0, 1), billing=st.sampled_from(["standard", "standard", "none"]), project=st.booleans())
    def create_instance(self, which: int, billing: str, project: bool) -> None:
        tenant = self.tenant(which)
        kw = {"project_id": self.project} if project and which == 0 else {}
        try:
            made = self.v.instance(self.stubs[tenant], tenant=tenant, billing=billing, **kw)
        except grpc.RpcError as exc:
            assert reason_of(exc) in ("CAPACITY_UNAVAILABLE", "INVALID_STATE"), exc
            return
        self.instances[made.id] = tenant
        if made.placement == "reserved":
            self.ordinary_slot_was_free()

    @precondition(lambda self: self.instances)
    @rule(pick=st.integers(0, 100), action=st.sampled_from(["Stop", "Start", "Delete"]))
    def change_instance(self, pick: int, action: str) -> None:
        iid = sorted(self.instances)[pick % len(self.instances)]
        tenant = self.instances[iid]
        [(was,)] = self.sql("SELECT state FROM instances WHERE id = %s", iid)
        try:
            got = self.v.instance_call(action, iid, self.stubs[tenant], tenant=tenant)
        except grpc.RpcError as exc:
            assert reason_of(exc) in ("CAPACITY_UNAVAILABLE", "INVALID_STATE"), exc
            return
        # Only a start that started it took a slot: starting a running instance changes nothing, and
        # a grant that began meanwhile may hold slots its tenant's instances outside it still run on.
        if action == "Start" and was != "running" and got.placement == "reserved":
            self.ordinary_slot_was_free()

    @precondition(lambda self: not self.gone)
    @rule()
    def reservation_gone(self) -> None:
        self.v.gone()
        self.v.scan()
        self.gone = True

    @rule(minutes=st.sampled_from([10, 40, 70]))
    def time_passes(self, minutes: int) -> None:
        self.v.advance(minutes * MIN)
        until(lambda: self.sql("SELECT count(*) FROM work_items WHERE kind = 'grant' AND run_at <= compute_now()"
                               " AND dead_at IS NULL") == [(0,)])

    def ordinary_slot_was_free(self) -> None:
        """An instance just took an ordinary slot: it was not one a live grant holds."""
        (outside, granted, total), = self.sql(
            "SELECT (SELECT count(*) FROM instances WHERE account_id = %s AND grant_id IS NULL"
            "         AND placement = 'reserved' AND state = 'running'),"
            "       (SELECT coalesce(sum(slots), 0) FROM reservation_grants WHERE account_id = %s"
            "         AND state IN ('scheduled', 'active') AND starts_at <= compute_now() AND ends_at > compute_now()),"
            "       (SELECT total FROM provider_reservations WHERE account_id = %s)",
            self.v.account_id, self.v.account_id, self.v.account_id)
        assert outside + granted <= total

    @invariant()
    def no_slot_is_used_twice(self) -> None:
        """The slots held (running instances, stopped ones a grant keeps) never exceed the total."""
        (held, total), = self.sql(
            "SELECT (SELECT count(*) FROM instances WHERE account_id = %s AND placement <> 'on-demand'"
            "         AND (state = 'running' OR (state = 'stopped' AND grant_id IS NOT NULL))),"
            "       (SELECT total FROM provider_reservations WHERE account_id = %s)",
            self.v.account_id, self.v.account_id)
        assert held <= total

    @invariant()
    def a_grants_slots_serve_only_its_tenant(self) -> None:
        wrong = self.sql(
            "SELECT i.id FROM instances i JOIN reservation_grants g ON g.id = i.grant_id"
            " WHERE i.account_id = %s AND i.state <> 'deleted' AND (i.tenant_id <> g.tenant_id"
            "   OR (g.project_id IS NOT NULL AND i.project_id IS DISTINCT FROM g.project_id)"
            "   OR g.state NOT IN ('scheduled', 'active') OR i.billing <> 'standard')", self.v.account_id)
        assert wrong == []
        over = self.sql(
            "SELECT g.id FROM reservation_grants g WHERE g.account_id = %s AND g.slots < "
            " (SELECT count(*) FROM instances i WHERE i.grant_id = g.id AND i.state <> 'deleted')", self.v.account_id)
        assert over == []

    def teardown(self) -> None:
        """Every committed slot-hour metered exactly once, once every term has ended."""
        try:
            self.v.advance(6 * HOUR)
            until(lambda: self.sql(
                "SELECT count(*) FROM reservation_grants WHERE account_id = %s AND state <> 'cancelled'"
                " AND coalesce(metered_until, starts_at) < ends_at", self.v.account_id) == [(0,)])
            rows = self.sql(
                "SELECT g.id, g.slots * extract(epoch FROM g.ends_at - g.starts_at) / 3600,"
                "       coalesce((SELECT sum(u.quantity) FROM usage_records u"
                "                 WHERE u.subject = 'grant/' || g.id AND u.meter = 'vm.grant.slot.hours'), 0)"
                " FROM reservation_grants g WHERE g.account_id = %s", self.v.account_id)
            states = dict(self.sql("SELECT id, state FROM reservation_grants WHERE account_id = %s", self.v.account_id))
            for gid, committed, metered in rows:
                expected = 0 if states[gid] == "cancelled" else float(committed)
                assert float(metered) == pytest.approx(expected, abs=1e-6), (gid, states[gid])
        finally:
            self.a.close()
            self.b.close()


def test_random_grants_and_instances_keep_slots_and_metering_exact(
        stack: tuple[ServerThread, Client], sim: SimThread, pytestconfig: pytest.Config) -> None:
    Slots.stack = stack
    Slots.sim = sim
    run_state_machine_as_test(
        Slots, settings=settings(max_examples=stateful_examples(pytestconfig), stateful_step_count=20,
                                 suppress_health_check=[*settings.default.suppress_health_check,
                                                        HealthCheck.filter_too_much]))
