"""A quota charge is one call (charge_quota): two charges racing for the last unit are decided one
at a time, the second seeing the first's committed charge (a sum read after the limit row lock)."""

from __future__ import annotations

import threading
import time

import psycopg

from tests.support import World

CHARGE = "SELECT quota_limit, used, charged FROM charge_quota(%s, 'gpu', %s, 1)"


def test_a_charge_waiting_for_the_limit_row_sees_the_charge_committed_before_it(world: World) -> None:
    first, second = world.create(count=1), world.create(count=1)
    with psycopg.connect(world.conninfo, autocommit=True) as admin:
        admin.execute("UPDATE quota_charges SET refunded_at = now() WHERE tenant_id = %s", (world.tenant,))
        admin.execute("""UPDATE quotas SET "limit" = 1 WHERE tenant_id = %s AND resource = 'gpu'""", (world.tenant,))
        with psycopg.connect(world.conninfo) as a, psycopg.connect(world.conninfo) as b:
            assert a.execute(CHARGE, (world.tenant, first.id)).fetchone() == (1, 0, True)
            b_pid = b.info.backend_pid
            answer: list[tuple] = []
            def charge_second() -> None:
                answer.append(b.execute(CHARGE, (world.tenant, second.id)).fetchone())

            waiter = threading.Thread(target=charge_second)
            waiter.start()
            deadline = time.monotonic() + 30
            while not admin.execute(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (b_pid,)
            ).fetchone()[0]:
                assert time.monotonic() < deadline, "the second charge never waited for the limit row"
                time.sleep(0.02)
            a.commit()
            waiter.join(30)
            assert answer == [(1, 1, False)], "the second charge must see the first and be refused"
            b.commit()
        live = admin.execute(
            "SELECT reservation_id FROM quota_charges WHERE tenant_id = %s AND refunded_at IS NULL", (world.tenant,)
        ).fetchall()
        assert live == [(first.id,)]


USAGE = "SELECT resource, per, amount FROM quota_usage WHERE tenant_id = %s AND amount <> 0 ORDER BY resource, per"
SUMMED = """
SELECT resource, per, sum(amount) FROM quota_charges WHERE tenant_id = %s AND refunded_at IS NULL
GROUP BY resource, per HAVING sum(amount) <> 0 ORDER BY resource, per
"""


def test_the_running_usage_follows_every_charge_refund_recharge_and_delete(world: World) -> None:
    """A charge reads the tenant's running usage (migration 0029), not the sum of its live
    charges: after charges of several denominators, a refund, a charge again after a refund (the
    ON CONFLICT update) and a cascading delete, the usage equals the sum at every step."""
    first, second = world.create(count=2), world.create(count=1)
    with psycopg.connect(world.conninfo, autocommit=True) as admin:
        def same() -> list[tuple]:
            usage = admin.execute(USAGE, (world.tenant,)).fetchall()
            assert usage == admin.execute(SUMMED, (world.tenant,)).fetchall()
            return usage

        assert ("gpu", 1, 3) in same()
        admin.execute("SELECT charge_quota(%s, 'gpu:X', %s, 3, 7, true)", (world.tenant, first.id))  # 3/7, no limit row
        assert ("gpu:X", 7, 3) in same()
        admin.execute("UPDATE quota_charges SET refunded_at = now() WHERE reservation_id = %s", (first.id,))
        assert ("gpu", 1, 1) in same() and not any(r == "gpu:X" for r, _, _ in same())
        admin.execute("SELECT charge_quota(%s, 'gpu', %s, 2)", (world.tenant, first.id))  # a refunded row charged again
        assert ("gpu", 1, 3) in same()
        admin.execute("DELETE FROM quota_charges WHERE reservation_id = %s", (second.id,))
        assert ("gpu", 1, 2) in same()
        refused = admin.execute("SELECT used, charged FROM charge_quota(%s, 'gpu', %s, 1000000000000)",
                                (world.tenant, second.id)).fetchone()
        assert refused == (2, False), "the charge reads the running usage"
