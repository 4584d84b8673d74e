"""A hostile or careless tenant against spot reservations and preemption, through the real API
(real servers on loopback, real TLS, the embedded PostgreSQL): a victim always gets the pool's
whole notice, counted from when it is given; spot never outranks a regular reservation; a
preemptor that goes away before the notice's end gives its victims their time back; nothing is
ever booked twice."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.workers import pending
from tests.invariants import check_invariants, snapshot
from tests.promise_support import pool_locked
from tests.support import ServerThread, World, clock_now, eventually, get, gpus, make_world

NOTICE_S = 2
HOUR = 3_600_000


def spot_world(server: ServerThread, root, notice_s: int = NOTICE_S) -> World:
    w = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=256)
    w.sql("UPDATE pools SET policy = policy || %s::jsonb WHERE id = %s",
          ('{"spot": {"noticeSeconds": %d}}' % notice_s, w.pool_id))
    w.server = server
    return w


@pytest.fixture
def bare(stack) -> Iterator[World]:
    server, root = stack
    w = spot_world(server, root)
    yield w
    w.close()


@pytest.fixture
def clocked(clock_stack) -> Iterator[World]:
    """A pool of its own control plane whose clock the test moves."""
    server, root = clock_stack
    w = spot_world(server, root)
    yield w
    w.close()


def mk(world: World, **kw) -> pb.Reservation:
    """Create, then wait until the capacity index heard of it (the next create plans on it)."""
    r = world.create(**kw)
    world.server.call(world.server.app.runtime.capacity.barrier())
    return r


def node(world: World) -> str:
    return world.add_node(gpus(f"h{len(world.nodes)}-{world.tenant}", 8)).id


def events_of(world: World, rid: str, type_: str) -> list[dict]:
    return [d for (d,) in world.sql("SELECT data FROM events WHERE subject = %s AND type = %s ORDER BY id",
                                    (f"reservation/{rid}", type_))]


def advance(world: World, ms: int) -> None:
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=ms))


def waiting_for_a_lock(world: World) -> None:
    """Until a session of the world's database waits for a lock (the create's transaction 2)."""
    deadline = time.monotonic() + 15
    while not world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database()")[0][0]:
        assert time.monotonic() < deadline, "the create never queued behind the pool lock"
        time.sleep(0.02)


# -- The notice --------------------------------------------------------------------------------


def test_a_victim_gets_the_whole_notice_even_when_the_preemptor_waited_for_the_pool_lock(clocked: World) -> None:
    """The preemptor's transaction 2 waited for the pool lock while the clock moved on: the
    notice is counted from when it is given, not from the create's first transaction (it was
    already over when the victim heard of it)."""
    w = clocked
    node(w)
    spot = mk(w, count=8, spot=True, duration="8h")
    with ThreadPoolExecutor(1) as pool, pool_locked(w):
        pending = pool.submit(w.create, count=8, duration="1h")
        waiting_for_a_lock(w)
        advance(w, 120_000)  # within the spot's bind timeout: it stays booked
        given_from = clock_now(w)
    r = pending.result(timeout=30)
    assert r.state == "placed"
    (notice,) = events_of(w, spot.id, "reservation.preempting")
    assert notice["noticeUntil"] == r.during.start
    assert r.during.start >= given_from + NOTICE_S * 1000, (r.during.start, given_from)
    assert get(w, spot.id).during.end == r.during.start
    check_invariants(w.conninfo, w.tenant)


# -- A preemptor that goes away before the notice's end ------------------------------------------


@pytest.fixture
def long_notice(stack) -> Iterator[World]:
    """A pool whose notice (5 minutes) leaves the test time to act within it."""
    server, root = stack
    w = spot_world(server, root, notice_s=300)
    yield w
    w.close()


def booking_ends(world: World, rid: str) -> set[int]:
    return {e for (e,) in world.sql(
        "SELECT epoch_ms(upper(b.during)) FROM bookings b JOIN allocations a ON a.id = b.allocation_id"
        " WHERE a.reservation_id = %s AND a.state IN ('placed', 'binding', 'bound')", (rid,))}


def end_it(world: World, how: str, rid: str) -> None:
    method = {"cancel": "Cancel", "release": "Release"}[how]
    request = {"cancel": pb.CancelReservationRequest, "release": pb.ReleaseReservationRequest}[how]
    world.user.res(method, request(tenant_id=world.tenant, reservation_id=rid))


@pytest.mark.parametrize("how", ["cancel", "release"])
@pytest.mark.parametrize("calendar", [False, True])
def test_a_preemptor_that_goes_away_during_the_notice_gives_the_victim_its_time_back(
        long_notice: World, how: str, calendar: bool) -> None:
    """A tenant books regular GPUs over a spot reservation and withdraws at once: nobody needs
    the spot's devices any more, so it keeps them to its own end (it used to be released at the
    notice's end all the same, for nothing)."""
    w = long_notice
    node(w)
    spot = mk(w, count=8, spot=True, duration="8h")
    end = spot.during.end
    kw = {"start": w.later(hours=2)} if calendar else {}
    r = mk(w, count=8, duration="1h", **kw)
    assert r.state == "placed" and get(w, spot.id).during.end == r.during.start
    end_it(w, how, r.id)
    back = get(w, spot.id)
    assert back.during.end == end and back.state in ("placed", "binding", "active")
    assert not [c for c in back.conditions if c.type == "Preempting"]
    assert booking_ends(w, spot.id) == {end}
    (extended,) = events_of(w, spot.id, "reservation.extended")
    assert (extended["from"], extended["to"]) == (r.during.start, end)
    assert w.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL"
                 " AND resource = 'gpu'", (spot.id,))[0][0] == 1  # still charged, once
    # Its devices are its own again: a regular request needs to preempt it anew.
    again = mk(w, count=8, duration="1h")
    assert again.state == "placed" and get(w, spot.id).during.end == again.during.start
    check_invariants(w.conninfo, w.tenant)


def test_a_victim_of_two_preemptors_gets_back_what_each_took_as_each_goes_away(long_notice: World) -> None:
    """A calendar preemptor cuts the spot at its start, a second one earlier: withdrawing the
    second leaves the spot under the first's notice; withdrawing the first too, it keeps all."""
    w = long_notice
    node(w)
    spot = mk(w, count=8, spot=True, duration="8h")
    end = spot.during.end
    first = mk(w, count=8, duration="1h", start=w.later(hours=2))
    second = mk(w, count=8, duration="1h")
    assert get(w, spot.id).during.end == second.during.start
    end_it(w, "cancel", second.id)
    under_first = get(w, spot.id)
    assert under_first.during.end == first.during.start and booking_ends(w, spot.id) == {first.during.start}
    (held,) = [c for c in under_first.conditions if c.type == "Preempting"]
    assert first.id in held.message
    end_it(w, "cancel", first.id)
    assert get(w, spot.id).during.end == end and booking_ends(w, spot.id) == {end}
    assert not [c for c in get(w, spot.id).conditions if c.type == "Preempting"]
    check_invariants(w.conninfo, w.tenant)


def test_a_preemptor_withdrawn_with_the_first_of_two_still_there_leaves_the_second_notice(long_notice: World) -> None:
    """The reverse order: the earlier preemptor (the calendar one, cut later) goes first; the spot
    stays under the second's notice, and once that one goes too it keeps its whole window."""
    w = long_notice
    node(w)
    spot = mk(w, count=8, spot=True, duration="8h")
    end = spot.during.end
    first = mk(w, count=8, duration="1h", start=w.later(hours=2))
    second = mk(w, count=8, duration="1h")
    end_it(w, "cancel", first.id)
    assert get(w, spot.id).during.end == second.during.start  # the second still needs it
    end_it(w, "cancel", second.id)
    assert get(w, spot.id).during.end == end and booking_ends(w, spot.id) == {end}
    check_invariants(w.conninfo, w.tenant)


# -- Spot booked so as never to be preempted ------------------------------------------------------


def test_a_spot_booking_that_starts_after_the_notice_does_not_hold_off_a_regular_one(long_notice: World) -> None:
    """A spot tenant books its window to start just past now plus the notice: it had not begun at
    the cut, so it was never a candidate, and the regular request waited pending behind spot work
    (a chain of such bookings held it off for as long as the chain lasted). Such a booking is
    preempted whole now, back to pending (it never ran, and learns of it at least a notice before
    its start); withdrawn, the preemptor leaves it room to be placed again at its start."""
    w = long_notice
    node(w)
    soon = w.later(hours=0) + 300_000 + 60_000
    chain = [mk(w, count=8, spot=True, start=soon + i * HOUR, duration="1h") for i in range(3)]
    assert all(s.state == "placed" for s in chain)
    r = mk(w, count=8, duration="2h")
    assert r.state == "placed", r.conditions
    taken = [s for s in chain if s.during.start < r.during.end]
    assert [s.id for s in taken] == [s.id for s in chain[:2]]
    for s in taken:
        bumped = get(w, s.id)
        assert bumped.state == "pending" and not booking_ends(w, s.id)
        (why,) = bumped.conditions
        assert (why.type, why.reason) == ("Unschedulable", "Preempted") and r.id in why.message
        assert [d["by"] for d in events_of(w, s.id, "reservation.preempting")] == [r.id]
        assert [d["reason"] for d in events_of(w, s.id, "reservation.pending")] == ["Preempted"]
        assert w.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL"
                     " AND resource = 'gpu'", (s.id,))[0][0] == 1  # a pending reservation keeps its charge
    # A retry that still finds no room keeps the message that names the preemptor.
    w.server.call(pending.retry_pool(w.server.app.runtime, w.pool_id))
    for s in taken:
        (why,) = get(w, s.id).conditions
        assert why.reason == "Preempted" and r.id in why.message, why
    assert get(w, chain[2].id).state == "placed" and get(w, chain[2].id).during == chain[2].during
    check_invariants(w.conninfo, w.tenant)
    end_it(w, "cancel", r.id)  # the pool's pending reservations are woken: both fit again
    for s in taken:
        again = eventually(w, s.id, lambda x: x.state == "placed", seconds=30)
        assert again.during == s.during
    check_invariants(w.conninfo, w.tenant)


def test_a_calendar_reservation_is_not_held_off_by_spot_starting_inside_its_window(bare: World) -> None:
    w = bare
    node(w)
    spot = mk(w, count=8, spot=True, start=w.later(hours=2), duration="8h")
    r = mk(w, count=8, start=w.later(hours=1), duration="2h")
    assert r.state == "placed" and get(w, spot.id).state == "pending"
    check_invariants(w.conninfo, w.tenant)


# -- Taking more than the shortfall -------------------------------------------------------------

FABRIC = "fabric.domain"


def fabric_node(world: World, fabric: str) -> str:
    return world.add_node(gpus(f"h{len(world.nodes)}-{world.tenant}", 8), system_labels={FABRIC: fabric}).id


def test_one_allocation_does_not_take_a_spot_gang_when_a_smaller_spot_frees_as_much(bare: World) -> None:
    """A spot gang over two nodes and a single spot on a third are one victim each; taking the
    gang ends sixteen GPUs of spot work for the eight the regular request needs."""
    w = bare
    for _ in range(2):
        fabric_node(w, "fab-a")
    spot_gang = mk(w, count=8, spot=True, gang=pb.Gang(size=2, topology_key=FABRIC), duration="8h")
    assert spot_gang.state == "placed"
    fabric_node(w, "fab-b")
    single = mk(w, count=8, spot=True, duration="8h")
    r = mk(w, count=8, duration="1h")
    assert r.state == "placed"
    assert [d["by"] for d in events_of(w, single.id, "reservation.preempting")] == [r.id]
    assert not events_of(w, spot_gang.id, "reservation.preempting")
    assert get(w, spot_gang.id).during == spot_gang.during
    check_invariants(w.conninfo, w.tenant)


# -- Another tenant's spot work -------------------------------------------------------------------


def guest_of(world: World) -> World:
    """A second tenant the pool is offered to."""
    guest = make_world(world.endpoint, world.root, world.conninfo, nodes=0, quota=256)
    world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
    guest.pool_id = world.pool_id
    guest.server = world.server
    return guest


def test_a_victim_of_another_tenant_never_learns_the_preemptors_id_and_gets_its_time_back(
        long_notice: World) -> None:
    w = long_notice
    node(w)
    guest = guest_of(w)
    try:
        spot = mk(guest, count=8, spot=True, duration="8h")
        r = mk(w, count=8, duration="1h")
        assert r.state == "placed"
        victim = get(guest, spot.id)
        (held,) = [c for c in victim.conditions if c.type == "Preempting"]
        assert r.id not in held.message and "another tenant" in held.message
        (notice,) = events_of(guest, spot.id, "reservation.preempting")
        assert notice["by"] == "" and notice["noticeUntil"] == r.during.start
        guest_events = w.sql("SELECT data::text FROM events WHERE tenant_id = %s", (guest.tenant,))
        assert not [d for (d,) in guest_events if r.id in d]
        end_it(w, "cancel", r.id)
        assert get(guest, spot.id).during == spot.during
        check_invariants(w.conninfo, w.tenant)
    finally:
        guest.close()


def test_preemption_never_reaches_into_another_pool(bare: World) -> None:
    """Spot work of the same tenant in another pool is never a victim of this pool's request."""
    w = bare
    node(w)
    other = w.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=w.tenant, name="other", region="eu-1", policy=apb.PoolPolicy(spot_notice_seconds=NOTICE_S)))
    home = w.pool_id
    w.pool_id = other.id
    node(w)
    elsewhere = mk(w, count=8, spot=True, duration="8h")
    w.pool_id = home
    full = mk(w, count=8, duration="8h")  # a regular reservation fills this pool
    r = mk(w, count=8, duration="1h")
    assert full.state == "placed" and r.state == "pending"
    assert not events_of(w, elsewhere.id, "reservation.preempting")
    assert get(w, elsewhere.id).during == elsewhere.during


# -- Shared GPUs, races, extends ------------------------------------------------------------------


def test_a_regular_slot_request_preempts_spot_slots_and_never_a_slot_twice(bare: World) -> None:
    """Preemption in a time-slice pool works on slots like on GPUs: the fewest spot reservations,
    their slots only, and no slot booked twice for any instant."""
    w = bare
    w.pool_id = w.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=w.tenant, name="slots", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="time-slice"), spot_notice_seconds=NOTICE_S))).id
    node(w)  # 8 GPUs of 4 slots
    big = mk(w, device_class="gpu.slot", count=24, spot=True, duration="8h")
    small = mk(w, device_class="gpu.slot", count=8, spot=True, duration="8h")
    r = mk(w, device_class="gpu.slot", count=6, duration="1h")
    assert r.state == "placed"
    assert [d["by"] for d in events_of(w, small.id, "reservation.preempting")] == [r.id]
    assert not events_of(w, big.id, "reservation.preempting")
    assert set(r.allocations[0].device_ids) <= set(small.allocations[0].device_ids)
    assert snapshot(w.conninfo, w.tenant)["double_booked"] == []  # (the charge check counts whole GPUs)


def test_regular_creates_racing_for_spot_work_preempt_each_victim_once_and_book_nothing_twice(bare: World) -> None:
    w = bare
    node(w)
    spots = [mk(w, count=1, spot=True, duration="8h") for _ in range(8)]
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda _: w.create(count=1, duration="1h"), range(12)))
    placed = [r for r in got if r.state == "placed"]
    assert len(placed) == 8 and all(r.state == "pending" for r in got if r not in placed)
    notices = {s.id: events_of(w, s.id, "reservation.preempting") for s in spots}
    assert all(len(n) == 1 for n in notices.values()), notices
    assert sorted(n[0]["by"] for n in notices.values()) == sorted(r.id for r in placed)
    for s in spots:
        released = eventually_released(w, s.id)
        assert [d["reason"] for d in events_of(w, s.id, "reservation.released")] == ["preempted"]
        assert released.state == "released"
    refunds = w.sql("SELECT reservation_id, count(*) FROM quota_charges WHERE reservation_id = ANY(%s)"
                    " AND resource = 'gpu' GROUP BY 1", ([s.id for s in spots],))
    assert sorted(n for _, n in refunds) == [1] * 8  # one charge each, refunded once
    assert not w.sql("SELECT 1 FROM quota_charges WHERE reservation_id = ANY(%s) AND refunded_at IS NULL",
                     ([s.id for s in spots],))
    check_invariants(w.conninfo, w.tenant)


def eventually_released(world: World, rid: str) -> pb.Reservation:
    deadline = time.monotonic() + 30
    while (r := get(world, rid)).state != "released":
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def test_a_spot_reservation_cannot_extend_into_a_regular_booking(bare: World) -> None:
    w = bare
    node(w)
    spot = mk(w, count=8, spot=True, duration="1h")
    later = mk(w, count=8, start=spot.during.end + HOUR, duration="1h")
    assert later.state == "placed"
    got = w.user.res("Extend", pb.ExtendReservationRequest(tenant_id=w.tenant, reservation_id=spot.id,
                                                           idempotency_key="past-it", by="4h"))
    assert not got.extended and got.available_until == later.during.start
    assert get(w, spot.id).during == spot.during and get(w, later.id).during == later.during
    check_invariants(w.conninfo, w.tenant)


def test_a_preemptor_whose_lease_lapses_before_its_start_gives_the_victim_its_time_back(clock_stack) -> None:
    """An agent books regular GPUs over spot work with a lease shorter than the notice and dies:
    its lease lapses before its window begins, and the spot keeps its devices."""
    server, root = clock_stack
    w = spot_world(server, root, notice_s=300)
    try:
        node(w)
        spot = mk(w, count=8, spot=True, duration="8h")
        r = mk(w, count=8, duration="1h", lease_seconds=60)
        assert r.state == "placed" and get(w, spot.id).during.end == r.during.start
        advance(w, 61_000)
        deadline = time.monotonic() + 30
        while (gone := get(w, r.id)).state != "released":
            assert time.monotonic() < deadline, gone
            time.sleep(0.05)
        assert [d["reason"] for d in events_of(w, r.id, "reservation.released")] == ["lease-lapsed"]
        assert get(w, spot.id).during == spot.during and booking_ends(w, spot.id) == {spot.during.end}
        check_invariants(w.conninfo, w.tenant)
    finally:
        w.close()


def slot_pool(world: World) -> None:
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="slots", region="eu-1",
        policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="time-slice"), spot_notice_seconds=NOTICE_S))).id
    node(world)  # 8 GPUs of 4 slots


def test_spot_split_into_one_slot_reservations_is_still_preempted_and_only_as_much_as_needed(bare: World) -> None:
    """A spot tenant books a node's 32 slots as 32 reservations of one: the victim search tried
    sets of victims by size up to a cap (256 sets per node), so a regular request for three
    slots, which needs three victims, gave up after the pairs and waited pending for good."""
    w = bare
    slot_pool(w)
    spots = [mk(w, device_class="gpu.slot", count=1, spot=True, duration="8h") for _ in range(32)]
    assert all(s.state == "placed" for s in spots)
    r = mk(w, device_class="gpu.slot", count=3, duration="1h")
    assert r.state == "placed", r.conditions
    taken = [s.id for s in spots if events_of(w, s.id, "reservation.preempting")]
    assert len(taken) == 3
    assert snapshot(w.conninfo, w.tenant)["double_booked"] == []


def test_a_preemptor_withdrawn_while_others_preempt_the_same_victims_books_nothing_twice(long_notice: World) -> None:
    w = long_notice
    node(w)
    spots = [mk(w, count=1, spot=True, duration="8h") for _ in range(8)]
    big = mk(w, count=8, duration="1h")
    assert big.state == "placed"
    with ThreadPoolExecutor(5) as pool:
        cancelled = pool.submit(end_it, w, "cancel", big.id)
        got = list(pool.map(lambda _: w.create(count=1, duration="1h"), range(4)))
        cancelled.result(timeout=60)
    # A create that came before the cancel went pending; the cancel woke it to preempt then.
    placed = [eventually(w, r.id, lambda x: x.state == "placed", seconds=30) for r in got]
    under_notice = [s for s in spots if get(w, s.id).during.end != s.during.end]
    assert len(under_notice) == 4  # four given back, four preempted again by the four creates
    for s in under_notice:
        (held,) = [c for c in get(w, s.id).conditions if c.type == "Preempting"]
        assert any(r.id in held.message for r in placed)
    assert snapshot(w.conninfo, w.tenant)["double_booked"] == []
    check_invariants(w.conninfo, w.tenant)


def test_creates_racing_for_the_last_slot_book_it_once(bare: World) -> None:
    w = bare
    slot_pool(w)
    first = mk(w, device_class="gpu.slot", count=31, duration="2h")
    assert first.state == "placed"
    with ThreadPoolExecutor(10) as pool:
        got = list(pool.map(lambda _: w.create(device_class="gpu.slot", count=1, duration="1h"), range(10)))
    assert sorted(r.state for r in got) == ["pending"] * 9 + ["placed"]
    assert snapshot(w.conninfo, w.tenant)["double_booked"] == []


def test_a_shortfall_of_host_cpus_preempts_spot_and_a_withdrawal_gives_the_cpus_back(long_notice: World) -> None:
    """The GPUs are free but the host's CPUs are spot's: the regular request preempts the spot
    reservation for them, and withdrawn, gives them back (host bookings follow the devices')."""
    from tests.test_host_resources import host_bookings, host_node, peak_over_capacity

    w = long_notice
    host_node(w, w.server, vcpu=66, memory=512)  # 64 bookable vCPUs
    w.quota(10_000, "vcpu")
    w.quota(10_000, "memoryGiB")
    spot = mk(w, count=1, spot=True, duration="8h", resources=pb.HostResources(vcpu=60, memory_gib=10))
    assert spot.state == "placed"
    r = mk(w, count=1, duration="1h", resources=pb.HostResources(vcpu=30, memory_gib=10))
    assert r.state == "placed" and get(w, spot.id).during.end == r.during.start
    ends = {e for (e,) in w.sql("SELECT DISTINCT epoch_ms(upper(h.during)) FROM host_bookings h JOIN allocations a"
                                " ON a.id = h.allocation_id WHERE a.reservation_id = %s", (spot.id,))}
    assert ends == {r.during.start}
    end_it(w, "cancel", r.id)
    assert get(w, spot.id).during == spot.during
    ends = {e for (e,) in w.sql("SELECT DISTINCT epoch_ms(upper(h.during)) FROM host_bookings h JOIN allocations a"
                                " ON a.id = h.allocation_id WHERE a.reservation_id = %s", (spot.id,))}
    assert ends == {spot.during.end} and host_bookings(w, spot.id)["vcpu"] == 60
    assert peak_over_capacity(w) == []
    check_invariants(w.conninfo, w.tenant)


def test_a_withdrawn_preemptor_gives_nothing_back_that_another_booking_took_since(long_notice: World) -> None:
    """The spot's CPUs past the cut were booked by a later regular reservation: withdrawing the
    preemptor cannot give them back without overbooking the host, so the notice stands."""
    from tests.test_host_resources import host_node, peak_over_capacity

    w = long_notice
    host_node(w, w.server, vcpu=66, memory=512)  # 64 bookable vCPUs
    w.quota(10_000, "vcpu")
    w.quota(10_000, "memoryGiB")
    spot = mk(w, count=1, spot=True, duration="8h", resources=pb.HostResources(vcpu=60, memory_gib=10))
    r = mk(w, count=1, duration="1h", resources=pb.HostResources(vcpu=30, memory_gib=10))
    cut = r.during.start
    later = mk(w, count=1, start=cut + 1_000, duration="1h", resources=pb.HostResources(vcpu=30, memory_gib=10))
    assert r.state == later.state == "placed"
    end_it(w, "cancel", r.id)
    kept = get(w, spot.id)
    assert kept.during.end == cut and [c.type for c in kept.conditions] == ["Preempting"]
    assert not events_of(w, spot.id, "reservation.extended")
    assert peak_over_capacity(w) == []
    check_invariants(w.conninfo, w.tenant)
