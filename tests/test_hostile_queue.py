"""A hostile tenant against the pool-lease placer's `queued` path, spot and preemption, the
extend / renew / release / cancel races, and quota accounting under all of them, through the real
gRPC API on a lease-policy pool (DESIGN.md sections 8, 9, 10 and 15; spec "Waiting for
placement", "States and conditions", "Start, lease, extend and release"; spec 004 "Calendar
reservations")."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from structlog.testing import capture_logs

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.invariants import check_invariants
from controlplane.workers import pending as pending_worker
from tests.support import (Client, ServerThread, World, eventually, get, invalid, make_world, outcome,
                           refused)

NOTICE_S = 2
WAIT_CAP_S = 1.0


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    # Pending reservations are retried only when woken (no 30-second safety net to hide a lost wake-up).
    yield from module_stack(pg_uri, default_placer="lease", placer_lease_seconds=1.5,
                            create_wait_cap_seconds=WAIT_CAP_S, pending_retry_seconds=3600)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    """A tenant with a lease pool of two 8-GPU nodes whose spot notice is NOTICE_S."""
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=2, quota=64)
    w.sql("UPDATE pools SET policy = policy || %s::jsonb WHERE id = %s",
          ('{"spot": {"noticeSeconds": %d}}' % NOTICE_S, w.pool_id))
    w.server = server
    yield w
    w.close()


def held_by_other(world: World) -> None:
    """An absent holder holds the pool's lease for an hour: nothing drains the pool."""
    world.sql("INSERT INTO pool_leases (pool_id, holder, epoch, deadline) "
              "VALUES (%s, 'elsewhere', 7, clock_timestamp() + interval '1 hour') "
              "ON CONFLICT (pool_id) DO UPDATE SET holder = 'elsewhere', epoch = pool_leases.epoch + 1, "
              "deadline = EXCLUDED.deadline", (world.pool_id,))


def lapse(world: World) -> None:
    world.sql("UPDATE pool_leases SET deadline = clock_timestamp() WHERE pool_id = %s", (world.pool_id,))


def placed(world: World, **kw) -> pb.Reservation:
    r = world.create(**kw)
    return eventually(world, r.id, lambda x: x.state != "queued", seconds=20)


def extend(world: World, rid: str, **change) -> pb.ExtendReservationResponse:
    return world.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=rid, idempotency_key=f"x-{uuid.uuid4().hex[:8]}", **change))


def release(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def cancel(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def renew(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Renew", pb.RenewReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def no_extend_leftovers(world: World, rid: str) -> None:
    assert world.sql("SELECT count(*) FROM extend_holds WHERE reservation_id = %s", (rid,))[0][0] == 0
    assert world.sql("SELECT pending FROM authz_projection WHERE reservation_id = %s", (rid,))[0][0] is None


# The queued path -------------------------------------------------------------------------------

def test_concurrent_lease_creates_never_pass_the_quota(world: World) -> None:
    world.quota(5)
    start = world.later(2)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: outcome(world.create, count=1, start=start), range(16)))
    ok = [r for r in results if isinstance(r, pb.Reservation)]
    refusals = [r for r in results if not isinstance(r, pb.Reservation)]
    assert len(ok) == 5 and {r[1] for r in refusals} == {"QUOTA_EXCEEDED"}, refusals
    check_invariants(world.conninfo, world.tenant)
    # Cancel and create at once: the refunds and the charges never pass the limit either.
    with ThreadPoolExecutor(16) as pool:
        cancels = [pool.submit(outcome, cancel, world, r.id) for r in ok[:3]]
        creates = [pool.submit(outcome, world.create, count=1, start=start) for _ in range(8)]
        [c.result() for c in cancels]
        more = [c.result() for c in creates]
    assert sum(isinstance(r, pb.Reservation) for r in more) <= 3
    for r in [*ok, *(m for m in more if isinstance(m, pb.Reservation))]:
        eventually(world, r.id, lambda x: x.state != "queued", seconds=20)
    check_invariants(world.conninfo, world.tenant)


def test_a_queued_reservation_cannot_be_extended_or_renewed(world: World) -> None:
    held_by_other(world)
    r = world.create(count=1, lease_seconds=600)
    assert r.state == "queued"
    code, reason, details = refused(extend, world, r.id, by="1h")
    assert (reason, details["state"]) == ("INVALID_STATE", "queued"), details
    code, reason, details = refused(renew, world, r.id)
    assert (reason, details["state"]) == ("INVALID_STATE", "queued"), details
    no_extend_leftovers(world, r.id)
    out = release(world, r.id)
    assert out.state == "cancelled"
    assert release(world, r.id).state == "cancelled"  # a terminal one is unchanged
    assert refused(extend, world, r.id, by="1h")[1] == "INVALID_STATE"
    assert refused(cancel, world, r.id)[1] == "INVALID_STATE"
    lapse(world)
    world.create(count=1, wait=pb.Wait(timeout_ms=20_000))  # the pool drains again
    assert get(world, r.id).state == "cancelled"
    check_invariants(world.conninfo, world.tenant)


@pytest.mark.parametrize("timeout_ms", [-1, -(2**63)])
def test_a_negative_wait_is_invalid_input(world: World, timeout_ms: int) -> None:
    invalid("wait.timeoutMs", world.create, count=1, wait=pb.Wait(timeout_ms=timeout_ms))


def test_a_huge_wait_is_capped_and_answers_queued(world: World) -> None:
    held_by_other(world)
    began = time.monotonic()
    r = world.create(count=1, wait=pb.Wait(timeout_ms=2**63 - 1))
    assert (r.state, r.operation.state) == ("queued", "running")
    assert time.monotonic() - began >= WAIT_CAP_S * 0.9  # it waited, up to the cap


def test_cancelling_queued_reservations_while_their_batch_commits(world: World) -> None:
    held_by_other(world)
    start = world.later(2)
    rs = [world.create(count=1, start=start) for _ in range(12)]
    assert {r.state for r in rs} == {"queued"}
    with ThreadPoolExecutor(12) as pool:
        lapse(world)
        outs = list(pool.map(lambda r: outcome(cancel, world, r.id), rs))
    assert all(isinstance(o, pb.Reservation) and o.state == "cancelled" for o in outs), outs
    ids = [r.id for r in rs]
    assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = ANY(%s) AND state IN "
                     "('placed', 'binding', 'bound')", (ids,))[0][0] == 0
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = ANY(%s) AND refunded_at IS NULL",
                     (ids,))[0][0] == 0
    check_invariants(world.conninfo, world.tenant)


# Extend ----------------------------------------------------------------------------------------

def test_many_concurrent_extends_of_one_reservation(world: World) -> None:
    r = placed(world, count=1, start=world.later(2))
    end = r.during.end
    with ThreadPoolExecutor(10) as pool:
        outs = list(pool.map(lambda _: outcome(extend, world, r.id, by="10m"), range(10)))
    grown = [o for o in outs if isinstance(o, pb.ExtendReservationResponse) and o.extended]
    others = [o for o in outs if not isinstance(o, pb.ExtendReservationResponse)]
    assert len(grown) + len(others) == 10, outs
    assert all(o[1] == "CONFLICT" and o[2]["reason"] in ("extend-in-flight", "reservation-changed")
               for o in others), others
    assert get(world, r.id).during.end == end + len(grown) * 600_000
    no_extend_leftovers(world, r.id)
    check_invariants(world.conninfo, world.tenant)


@pytest.mark.parametrize("change,field", [
    ({"by": "9223372036854775807h"}, "by"), ({"by": "99999999999999999999999ms"}, "by"),
    ({"until": 2**63 - 1}, "until"), ({"until": -1}, "until"), ({"by": "-1h"}, "by"),
])
def test_an_absurd_extend_is_invalid_input(world: World, change: dict, field: str) -> None:
    r = placed(world, count=1, start=world.later(2))
    invalid(field, extend, world, r.id, **change)
    no_extend_leftovers(world, r.id)


def test_an_until_in_the_past_changes_nothing(world: World) -> None:
    r = placed(world, count=1, start=world.later(2))
    out = extend(world, r.id, until=1)
    assert not out.extended and out.reservation.during.end == r.during.end
    no_extend_leftovers(world, r.id)


def test_a_calendar_reservation_cannot_be_extended_past_the_longest_reservation(world: World) -> None:
    days = world.server.settings.max_reservation_days
    r = placed(world, count=1, start=world.later(24 * 300), duration="1h")
    latest = r.during.start + days * 86_400_000
    details = invalid("until", extend, world, r.id, until=latest + 1)
    assert int(details["maxUntil"]) == latest
    assert extend(world, r.id, until=latest).extended
    check_invariants(world.conninfo, world.tenant)


def test_release_racing_extend_leaves_no_half_written_state(world: World) -> None:
    for _ in range(6):
        r = placed(world, count=1, start=world.later(2))
        with ThreadPoolExecutor(2) as pool:
            ext = pool.submit(outcome, extend, world, r.id, by="1h")
            rel = pool.submit(outcome, release, world, r.id)
            e, out = ext.result(), rel.result()
        assert isinstance(out, pb.Reservation) and out.state == "released", out
        assert isinstance(e, pb.ExtendReservationResponse) or e[1] in ("CONFLICT", "INVALID_STATE"), e
        no_extend_leftovers(world, r.id)
        assert world.sql("SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id "
                         "WHERE a.reservation_id = %s", (r.id,))[0][0] == 0  # a future one: deleted
    check_invariants(world.conninfo, world.tenant)


# Spot and preemption ---------------------------------------------------------------------------

def booked_atoms(world: World, rid: str) -> set[str]:
    return {a for (a,) in world.sql(
        "SELECT b.atom_id FROM bookings b JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = %s",
        (rid,))}


def one_node_pool(world: World) -> None:
    """Leave one node bookable, so a regular reservation must preempt."""
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=world.nodes[1].id, state="cordoned"))
    world.server.call(world.server.app.runtime.capacity.barrier())


def test_a_spot_victim_extended_into_its_preemptors_window_is_not_extended(world: World) -> None:
    world.wait_ms = 20_000
    one_node_pool(world)
    spot = placed(world, count=8, spot=True, duration="8h")
    r = eventually(world, world.create(count=8, duration="1h").id, lambda x: x.state == "placed", seconds=20)
    cut = r.during.start
    out = extend(world, spot.id, by="1h")
    assert not out.extended and out.available_until == cut
    assert get(world, spot.id).during.end == cut
    no_extend_leftovers(world, spot.id)
    check_invariants(world.conninfo, world.tenant)


def end_reason(world: World, rid: str) -> str | None:
    return world.sql("SELECT end_reason FROM reservations WHERE id = %s", (rid,))[0][0]


def test_a_victim_whose_preemptor_withdrew_is_not_released_as_preempted(world: World) -> None:
    """The attack: a spot victim under notice, its preemptor cancelled. It kept its Preempting
    condition, and at its end was released with reason `preempted` and `reservation.preempted`
    though nothing preempted it. (It then had to extend past the notice's end to keep running;
    since the hostile spot review the cancel gives it its window back, notice withdrawn.)"""
    world.wait_ms = 20_000
    one_node_pool(world)
    spot = placed(world, count=8, spot=True, duration="30s")
    r = eventually(world, world.create(count=8, duration="1h").id, lambda x: x.state == "placed", seconds=20)
    cut = r.during.start
    assert get(world, spot.id).during.end == cut
    assert cancel(world, r.id).state == "cancelled"
    out = extend(world, spot.id, until=cut)
    assert not out.extended and out.reservation.during.end == spot.during.end  # back to its own end
    assert "Preempting" not in [c.type for c in out.reservation.conditions]
    done = eventually(world, spot.id, lambda x: x.state == "released", seconds=60)
    assert done.during.end == spot.during.end and end_reason(world, spot.id) == "expired"
    (rel,) = [d for (t, d) in world.sql("SELECT type, data FROM events WHERE subject = %s ORDER BY id",
                                        (f"reservation/{spot.id}",)) if t == "reservation.released"]
    assert rel["reason"] == "expired"
    assert not world.sql("SELECT 1 FROM events WHERE subject = %s AND type = 'reservation.preempted'",
                         (f"reservation/{spot.id}",))
    check_invariants(world.conninfo, world.tenant)


HELD = 424242  # the advisory lock a test trigger makes one reservation's pending event wait for


def test_capacity_freed_while_a_batch_leaves_a_reservation_pending_wakes_it(world: World) -> None:
    """The attack: release a reservation while the lease holder's batch, which found no room for a
    queued one, has not committed it pending yet. The release's wake-up (bc_pool_freed) reached the
    pending worker while the member was still queued, so it found nothing to retry; the batch then
    committed it pending and nothing woke it again (until the 30-second safety net, here off),
    though its capacity had been free all along. The pending worker now waits for the pool lock
    before it reads the pool's pending reservations, so a batch in flight commits first."""
    world.wait_ms = 20_000
    one_node_pool(world)
    blocker = placed(world, count=8, duration="8h")
    never = placed(world, count=16)  # always pending: a retry of the pool tries it and says so
    assert never.state == "pending"
    world.wait_ms = 0
    held_by_other(world)
    late = world.create(count=8, duration="1h")
    assert late.state == "queued"
    world.sql(f"""CREATE FUNCTION hold_pending_{world.tenant}() RETURNS trigger LANGUAGE plpgsql AS $$
                  BEGIN
                    IF NEW.type = 'reservation.pending' AND NEW.subject = 'reservation/{late.id}' THEN
                      PERFORM pg_advisory_xact_lock({HELD});
                    END IF;
                    RETURN NEW;
                  END $$""")
    world.sql(f"CREATE TRIGGER hold_pending_{world.tenant} BEFORE INSERT ON events "
              f"FOR EACH ROW EXECUTE FUNCTION hold_pending_{world.tenant}()")
    holder = psycopg.connect(world.conninfo, autocommit=True)
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", (HELD,))
        with capture_logs() as logs:
            lapse(world)  # the server takes the lease; its batch finds no room and waits to commit
            waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            deadline = time.monotonic() + 20
            while world.sql(waiting)[0][0] < 1:
                assert time.monotonic() < deadline, "the batch never reached its commit"
                time.sleep(0.02)
            assert release(world, blocker.id).state == "released"  # capacity freed, the pool woken

            def retried() -> bool:
                return any(e["event"] == "pending retried" and e.get("pool_id") == world.pool_id for e in logs)
            while not retried() and world.sql(waiting)[0][0] < 2:  # it retried, or waits for the pool lock
                assert time.monotonic() < deadline, "the pending worker was never woken"
                time.sleep(0.02)
            holder.execute("SELECT pg_advisory_unlock(%s)", (HELD,))
            r = eventually(world, late.id, lambda x: x.state in ("placed", "binding"), seconds=15)
        assert len(r.allocations) == 1
    finally:
        holder.close()
        world.sql(f"DROP TRIGGER hold_pending_{world.tenant} ON events")
        world.sql(f"DROP FUNCTION hold_pending_{world.tenant}()")
    check_invariants(world.conninfo, world.tenant)


def test_older_hopeless_pending_reservations_of_one_tenant_never_starve_anothers(world: World) -> None:
    """The attack: a tenant fills a pool it shares with a page's worth (the pending worker's BATCH)
    of pending reservations nothing can ever place (a node selector no node has), older than
    another tenant's. Every retry read only the oldest page, so when capacity was freed the other
    tenant's pending reservation was never retried, neither woken nor by the safety net."""
    world.quota(pending_worker.BATCH + 16)
    world.wait_ms = 20_000
    blockers = [placed(world, count=8, duration="8h") for _ in range(2)]  # the pool is full
    world.wait_ms = 0
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: world.create(count=1, node_selector={"zone": "nowhere"}),
                      range(pending_worker.BATCH)))
    hopeless = "SELECT count(*) FROM reservations WHERE tenant_id = %s AND state = 'pending'"
    deadline = time.monotonic() + 60
    while world.sql(hopeless, (world.tenant,))[0][0] < pending_worker.BATCH:
        assert time.monotonic() < deadline, "the hopeless reservations never went pending"
        time.sleep(0.1)
    guest = make_world(world.endpoint, world.root, world.conninfo, nodes=0)
    try:
        world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
        guest.pool_id = world.pool_id
        g = guest.create(count=8, wait=pb.Wait(timeout_ms=20_000))
        assert eventually(guest, g.id, lambda x: x.state != "queued", seconds=20).state == "pending"
        release(world, blockers[0].id)
        r = eventually(guest, g.id, lambda x: x.state in ("placed", "binding"), seconds=30)
        assert len(r.allocations) == 1
        check_invariants(guest.conninfo, guest.tenant)
    finally:
        guest.close()
    check_invariants(world.conninfo, world.tenant)


def test_preemption_racing_the_victims_release(world: World) -> None:
    one_node_pool(world)
    for _ in range(4):
        world.wait_ms = 20_000
        spot = placed(world, count=8, spot=True, duration="8h")
        with ThreadPoolExecutor(2) as pool:
            pre = pool.submit(outcome, world.create, count=8, duration="1h")
            rel = pool.submit(outcome, release, world, spot.id)
            p, out = pre.result(), rel.result()
        assert isinstance(out, pb.Reservation) and out.state == "released", out
        assert isinstance(p, pb.Reservation), p
        p = eventually(world, p.id, lambda x: x.state in ("placed", "binding"), seconds=20)
        assert end_reason(world, spot.id) == "release"  # released by its owner, before or during a notice
        assert not world.sql("SELECT 1 FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL",
                             (spot.id,))
        check_invariants(world.conninfo, world.tenant)
        assert release(world, p.id).state == "released"
    check_invariants(world.conninfo, world.tenant)


def test_a_storm_of_creates_cancels_releases_extends_and_renews_keeps_every_invariant(world: World) -> None:
    """Spot and regular, queued, placed and started, with every lifecycle call racing the batches
    and each other: no double booking, no quota drift, no leftover extend slot, no INTERNAL."""
    import random
    world.quota(24)
    rng = random.Random(7)
    ids: list[str] = []
    refusals: list[tuple] = []

    def one(i: int) -> None:
        op = rng.choice(["create", "create", "cancel", "release", "extend", "renew"])
        if op == "create" or not ids:
            o = outcome(world.create, count=rng.choice([1, 2, 4]), spot=rng.random() < 0.4,
                        lease_seconds=600, duration=rng.choice(["30m", "1h"]),
                        start=world.later(rng.choice([0.5, 1])) if rng.random() < 0.5 else None)
            if isinstance(o, pb.Reservation):
                ids.append(o.id)
            else:
                refusals.append(o)
            return
        rid = rng.choice(ids)
        call = {"cancel": cancel, "release": release, "renew": renew,
                "extend": lambda w, r: extend(w, r, by="10m")}[op]
        o = outcome(call, world, rid)
        if not isinstance(o, (pb.Reservation, pb.ExtendReservationResponse)):
            refusals.append(o)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(120)))
    assert {r[1] for r in refusals} <= {"QUOTA_EXCEEDED", "INVALID_STATE", "CONFLICT"}, refusals
    for rid in ids:
        eventually(world, rid, lambda x: x.state != "queued", seconds=20)
        no_extend_leftovers(world, rid)
    check_invariants(world.conninfo, world.tenant)
