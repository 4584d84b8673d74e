"""charge_all decides every resource of a charge in one read (migration 0055): on random limits,
usages of several denominators and requests, it answers what charging one resource at a time
with charge_quota answers (the rule it replaced): the same refusal (resource, limit, `used` to the
digit) or the same charges written."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.support import World

RESOURCES = ("gpu", "gpu:A100", "gpu:H100", "vcpu")
LENIENT = {"gpu:A100": True, "gpu:H100": True}

usage_st = st.dictionaries(st.tuples(st.sampled_from(RESOURCES), st.sampled_from([1, 2, 3, 7])),
                           st.integers(min_value=-2, max_value=30), max_size=6)
limits_st = st.dictionaries(st.sampled_from(RESOURCES), st.integers(min_value=0, max_value=12), max_size=4)
ask_st = st.dictionaries(st.sampled_from(RESOURCES),
                         st.tuples(st.integers(min_value=1, max_value=9), st.sampled_from([1, 2, 7])),
                         min_size=1, max_size=4)

_RESERVATION: dict[int, str] = {}
CHARGE_ALL = "SELECT charge_all(%s, %s, %s, %s, %s, %s, '{}')"
ONE = "SELECT quota_limit, used::text, charged FROM charge_quota(%s, %s, %s, %s, %s, %s)"
CHARGES = "SELECT resource, amount, per FROM quota_charges WHERE reservation_id = %s ORDER BY resource"


def _answer(conn: psycopg.Connection, run: Any, reservation_id: str) -> tuple:
    """('refused', resource, limit, used text) or ('charged', rows written), rolled back after."""
    with conn.transaction(force_rollback=True):
        refused = run()
        if refused is not None:
            return ("refused", *refused)
        return ("charged", conn.execute(CHARGES, (reservation_id,)).fetchall())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(usage=usage_st, limits=limits_st, ask=ask_st)
def test_charge_all_answers_as_charging_one_resource_at_a_time(world: World, usage: dict, limits: dict,
                                                                ask: dict) -> None:
    if id(world) not in _RESERVATION:  # one per world: the examples share it (each rolls back)
        _RESERVATION[id(world)] = world.create(count=1).id
    reservation_id = _RESERVATION[id(world)]
    tenant = world.tenant
    wanted = sorted(ask.items())
    resources = [r for r, _ in wanted]
    amounts, pers = [a for _, (a, _) in wanted], [p for _, (_, p) in wanted]
    lenient = [LENIENT.get(r, False) for r in resources]
    with psycopg.connect(world.conninfo) as conn, conn.transaction(force_rollback=True):
        conn.execute("DELETE FROM quota_charges WHERE tenant_id = %s", (tenant,))
        conn.execute("DELETE FROM quota_usage WHERE tenant_id = %s", (tenant,))
        conn.execute("DELETE FROM quotas WHERE tenant_id = %s", (tenant,))
        for (resource, per), amount in usage.items():
            conn.execute("INSERT INTO quota_usage (tenant_id, resource, per, amount) VALUES (%s, %s, %s, %s)",
                         (tenant, resource, per, amount))
        for resource, limit in limits.items():
            conn.execute("""INSERT INTO quotas (tenant_id, resource, "limit") VALUES (%s, %s, %s)""",
                         (tenant, resource, limit))

        def one_at_a_time() -> tuple | None:
            for resource, amount, per, loose in zip(resources, amounts, pers, lenient):
                limit, used, charged = conn.execute(ONE, (tenant, resource, reservation_id, amount, per, loose)).fetchone()
                if not charged:
                    return resource, limit, used
            return None

        def all_at_once() -> tuple | None:
            try:
                with conn.transaction():
                    conn.execute(CHARGE_ALL, (tenant, reservation_id, resources, amounts, pers, lenient))
            except psycopg.Error as exc:
                assert exc.sqlstate == "BCQ01", exc
                got = json.loads(exc.diag.message_detail)
                return got["resource"], got["limit"], got["used"]
            return None

        expected = _answer(conn, one_at_a_time, reservation_id)
        assert _answer(conn, all_at_once, reservation_id) == expected


def test_charge_all_plans_its_statements_once_per_connection_whatever_their_costs(world: World) -> None:
    """Its fit read's rows come from unnest() of its arguments, whose custom plans the plan cache
    found cheaper than the generic one on every call under a benchmark's statistics: a create's
    charge was planned again each time, a tenth of PostgreSQL's CPU per create. Its statements now
    keep their generic plans (migration 0058), even for a session that asks for custom plans
    everywhere: then only the caller's own statement is planned on each call. PostgreSQL reports
    each planning (log_planner_stats) to a client that asks for LOG messages."""
    reservation_id = world.create(count=1).id
    planned: list[str] = []
    with psycopg.connect(world.conninfo, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: planned.append("plan") if d.message_primary == "PLANNER STATISTICS" else None)
        conn.execute("SET plan_cache_mode = force_custom_plan")
        conn.execute("SET client_min_messages = log")
        conn.execute("SET log_planner_stats = on")

        def plannings_of_a_charge() -> int:
            before = len(planned)
            with conn.transaction(force_rollback=True):
                conn.execute(CHARGE_ALL, (world.tenant, reservation_id, ["gpu", "gpu:no-such-model"], [1, 1],
                                          [1, 1], [False, True]))
            return len(planned) - before

        first = plannings_of_a_charge()
        assert first > 1, "the first call plans the function's statements: the test must see them"
        assert [plannings_of_a_charge() for _ in range(4)] == [1, 1, 1, 1]
