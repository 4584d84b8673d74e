"""Leftovers of admission (DESIGN.md sections 7, 7a and 8; spec "Drafts and idempotency",
"Waiting for placement" and "Start"), each an attack or a race that broke a promise before its
fix: the live-drafts cap under concurrent creates, a wait that outlived its token, a window
planned at transaction 1's clock, and ids and cursors that reached another identity's draft."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.common.status import error_info
from controlplane.ids import draft_id
from tests.conftest import module_stack
from tests.promise_support import pool_locked
from tests.support import Client, ServerThread, World, clock_now, gpus, invalid, make_world, refused
from tests.test_hostile_time import lock_waited

HOUR = 3_600_000


def live_drafts(world: World, identity_id: str) -> int:
    return world.sql("SELECT count(*) FROM reservations WHERE owner_identity_id = %s"
                     " AND state IN ('draft', 'awaiting-confirmation')", (identity_id,))[0][0]


def outcome(call, *args) -> str:
    """The reservation's state, or the spec code the call failed with ('draft-limit' for the
    live-drafts cap's refusal)."""
    try:
        return call(*args).state
    except grpc.RpcError as exc:
        info = error_info(exc)
        assert info is not None, f"no ErrorInfo on {exc}"
        return "draft-limit" if info.metadata.get("reason") == "draft-limit" else info.reason


def refused_concurrently(world: World, creates: int, threads: int = 16) -> list[str]:
    """`creates` creates of 2 GPUs with distinct keys, at once, from the world's user: its quota
    (1 GPU) refuses each one that gets a draft (QUOTA_EXCEEDED), so each leaves its draft."""
    requests = [world.create_request(key=f"burst-{i}", count=2) for i in range(creates)]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda r: outcome(world.user.res, "Create", r), requests))


def max_connections(pg_uri: str) -> int:
    with psycopg.connect(pg_uri) as conn:
        return int(conn.execute("SHOW max_connections").fetchone()[0])


@pytest.fixture(scope="module")
def capped(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, max_drafts_per_identity=3)


@pytest.fixture(scope="module")
def wide(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """A cap just above max_connections: far from it, creates count under the shared lock."""
    yield from module_stack(pg_uri, max_drafts_per_identity=max_connections(pg_uri) + 4)


# The live-drafts cap under concurrency -------------------------------------------------------


def test_concurrent_creates_with_distinct_keys_never_take_an_identity_past_its_draft_cap(capped) -> None:
    """Transaction 1 counted the identity's drafts in one statement and inserted in another: 24
    creates at once each saw room, and the identity held far more than 3 drafts."""
    server, root = capped
    w = make_world(server.endpoint, root, server.conninfo, nodes=1, quota=1)
    try:
        outcomes = refused_concurrently(w, 24)
        assert live_drafts(w, w.user_id) == 3
        assert sorted(set(outcomes)) == ["QUOTA_EXCEEDED", "draft-limit"]
        assert outcomes.count("QUOTA_EXCEEDED") == 3 and outcomes.count("draft-limit") == 21
        # The held keys are still decided on retry, and another identity has room of its own.
        assert outcome(w.create) == "draft-limit"  # a new key: still capped
        assert outcome(w.user.res, "Create", w.create_request(key=next(
            f"burst-{i}" for i, o in enumerate(outcomes) if o == "QUOTA_EXCEEDED"), count=2)) == "QUOTA_EXCEEDED"
        _, other = w.identity()
        assert w.create(other, count=1).state == "placed"
    finally:
        w.close()


def test_the_cap_holds_when_a_burst_crosses_it_from_far_below(wide) -> None:
    """Far from the cap the identity's lock is shared (creates do not wait for each other); a
    burst that crosses from far below to past the cap still stops exactly at it."""
    server, root = wide
    cap = server.settings.max_drafts_per_identity
    w = make_world(server.endpoint, root, server.conninfo, nodes=1, quota=1)
    try:
        outcomes = refused_concurrently(w, cap + 12)
        assert live_drafts(w, w.user_id) == cap
        assert outcomes.count("QUOTA_EXCEEDED") == cap and outcomes.count("draft-limit") == 12
    finally:
        w.close()


# A wait ends with its token ------------------------------------------------------------------


def lease_pool(world: World) -> None:
    """The world's pool becomes a new lease-policy pool with one node: a create there is queued
    for the pool's lease holder, whose batch takes the pool lock (pool_locked holds it back)."""
    world.pool_id = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
    world.add_node(gpus("lease-" + world.tenant))


def queued(world: World, rid: str) -> None:
    while world.sql("SELECT state FROM reservations WHERE id = %s", (rid,)) != [("queued",)]:
        lock_waited(world, "advisory")  # the batch waits for the pool lock the test holds


@pytest.mark.parametrize("ending", ["revoked", "expired"])
def test_a_create_waiting_for_placement_ends_unauthenticated_when_its_token_ends(clock_world: World,
                                                                              ending: str) -> None:
    """The wait kept reading and answered the reservation to a token revoked (or expired on the
    product clock) while it waited; a Watch stream ends UNAUTHENTICATED, and so does the wait."""
    w = clock_world
    lease_pool(w)
    ident, _ = w.identity()
    secret = w.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="1h")).secret
    caller = Client(w.endpoint, secret)
    request = w.create_request(key="waits", count=1, wait=pb.Wait(timeout_ms=10_000))
    rid = draft_id(w.tenant, ident, "waits")
    try:
        with ThreadPoolExecutor(1) as pool, pool_locked(w):
            answer = pool.submit(outcome, caller.res, "Create", request)
            queued(w, rid)
            if ending == "revoked":
                w.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident))
            else:
                w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=2 * HOUR))
            assert answer.result(timeout=60) == "UNAUTHENTICATED"
        # The reservation stays as created: the identity's new token reaches it by its key.
        fresh = Client(w.endpoint, w.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident)).secret)
        try:
            assert fresh.res("Create", request).id == rid
        finally:
            fresh.close()
    finally:
        caller.close()


# The window at the clock of the placement ----------------------------------------------------


def created_while_the_clock_jumps(world: World, by_ms: int, **kw) -> tuple[pb.Reservation, int]:
    """A create whose transaction 2 waits for the pool lock while the clock moves `by_ms`; its
    answer and the clock just after the jump."""
    with ThreadPoolExecutor(1) as pool:
        with pool_locked(world):
            answer = pool.submit(world.create, count=1, **kw)
            lock_waited(world, "advisory")
            world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=by_ms))
            moved = clock_now(world)
        return answer.result(timeout=60), moved


@pytest.mark.parametrize("gang", [False, True], ids=["one-node", "gang"])
def test_a_start_that_passes_before_placement_begins_at_placement_with_the_full_duration(
    clock_world: World, gang: bool
) -> None:
    """The window was planned at transaction 1's clock: a start one hour ahead that passed while
    transaction 2 waited was booked as it was asked, an hour in the past at placement."""
    w = clock_world
    start = clock_now(w) + HOUR
    extra = {"gang": pb.Gang(size=2)} if gang else {}
    r, moved = created_while_the_clock_jumps(w, 2 * HOUR, start=start, duration="3h", **extra)
    assert r.state == "placed", r
    assert r.during.start >= moved and r.during.end - r.during.start == 3 * HOUR
    booked = w.sql("SELECT min(epoch_ms(lower(b.during))), max(epoch_ms(upper(b.during))) FROM bookings b"
                   " JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = %s", (r.id,))
    assert booked == [(r.during.start, r.during.end)]
    event = w.sql("SELECT (data->>'start')::bigint, (data->>'end')::bigint FROM events"
                  " WHERE subject = %s AND type = 'reservation.placed'", ("reservation/" + r.id,))
    assert event == [(r.during.start, r.during.end)]


def test_a_window_without_a_start_begins_at_placement_not_at_transaction_1(clock_world: World) -> None:
    w = clock_world
    r, moved = created_while_the_clock_jumps(w, 2 * HOUR, duration="3h")
    assert r.during.start >= moved and r.during.end - r.during.start == 3 * HOUR
    # Still ahead at placement: the start asked for is kept.
    start = clock_now(w) + 3 * HOUR
    kept, _ = created_while_the_clock_jumps(w, HOUR, start=start, duration="1h")
    assert (kept.during.start, kept.during.end) == (start, start + HOUR)


def test_a_lease_counts_from_the_clock_at_placement_not_at_transaction_1(clock_world: World) -> None:
    """leaseSeconds run from placement (the clock read under the locks, migration 0059): a create
    whose transaction 2 waited while the clock moved two hours gets its full lease from the moved
    clock, not one that lapsed before it was placed; its lease wake-up is due then too."""
    w = clock_world
    start = clock_now(w) + 24 * HOUR  # far ahead: the window itself stays as asked
    r, moved = created_while_the_clock_jumps(w, 2 * HOUR, start=start, duration="1h", lease_seconds=600)
    assert r.state == "placed" and r.during.start == start, r
    assert moved + 600_000 <= r.lease_deadline <= clock_now(w) + 600_000
    due = w.sql("SELECT min(epoch_ms(run_at)) FROM work_items WHERE kind = 'reservation' AND subject = %s"
                " AND epoch_ms(run_at) < %s", (r.id, start))
    assert due == [(r.lease_deadline,)]


# A hostile tenant ----------------------------------------------------------------------------


def listed(client: Client, world: World, **kw) -> list[str]:
    return [r.id for r in client.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, **kw)).items]


def test_another_identitys_draft_is_not_found_by_id_through_every_call(world: World) -> None:
    """Drafts are internal (spec "Drafts and idempotency"): reached by id, a draft of another
    identity of the tenant (or the caller's own) is NOT_FOUND to get, release, cancel, extend and
    renew, and list neither shows it nor pages from it."""
    older = world.create(start=world.later(2), lease_seconds=600)  # the user's, before the draft
    mallory_id, mallory = world.identity()
    world.quota(1)
    assert refused(world.create, key="secret-plan", count=2)[1] == "QUOTA_EXCEEDED"  # the user's draft
    rid = draft_id(world.tenant, world.user_id, "secret-plan")
    assert world.sql("SELECT state FROM reservations WHERE id = %s", (rid,)) == [("draft",)]
    ref = {"tenant_id": world.tenant, "reservation_id": rid}
    for client in (mallory, world.user):
        for method, request in [("Get", pb.GetReservationRequest(**ref)),
                                ("Release", pb.ReleaseReservationRequest(**ref)),
                                ("Cancel", pb.CancelReservationRequest(**ref)),
                                ("Renew", pb.RenewReservationRequest(**ref)),
                                ("Extend", pb.ExtendReservationRequest(**ref, by="1h", idempotency_key="x"))]:
            code, reason, details = refused(client.res, method, request)
            assert (code, reason, details.get("reservationId")) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", rid), method
        assert rid not in listed(client, world, scope="all")
    assert world.sql("SELECT state, version FROM reservations WHERE id = %s", (rid,)) == [("draft", 1)]
    # A cursor is the last reservation of a page: a draft's id pages like an unknown id, to
    # nothing (it paged from the draft, telling whether another identity had used a key), and
    # so does another identity's reservation for scope 'mine'.
    unknown = draft_id(world.tenant, world.user_id, "never-used")
    assert listed(mallory, world, scope="all", cursor=unknown) == []
    assert listed(mallory, world, scope="all", cursor=rid) == []
    assert listed(world.user, world, scope="mine", cursor=rid) == []
    world.quota(64)
    own = world.create(mallory, start=world.later(3), key="mallory-own")
    assert listed(mallory, world, scope="mine", cursor=older.id) == []
    assert listed(mallory, world, scope="all", cursor=own.id) == [older.id]


def test_idempotency_keys_at_the_patterns_edges(world: World) -> None:
    """The key is full-matched against [A-Za-z0-9._:-]{1,128}: its longest form, made of every
    allowed character, is one request, case matters, and anything past the edges is
    INVALID_INPUT naming idempotencyKey, with nothing stored."""
    longest = ("Aa0._:-" * 19)[:128]
    first = world.create(key=longest, start=world.later(2))
    assert first.idempotency_key == longest and first.id == draft_id(world.tenant, world.user_id, longest)
    again = world.user.res("Create", world.create_request(key=longest, start=first.during.start))
    assert (again.id, again.version) == (first.id, first.version)
    upper = world.create(key=longest.upper(), start=world.later(2))
    assert upper.id != first.id
    for bad in [longest + "a", " k", "k ", "k\n", "\nk", "k\x00", "k/1", "k\u00e9", "\uff4b", "k\u200b", "k;1"]:
        invalid("idempotencyKey", world.create, key=bad, start=world.later(2))
    empty = world.create_request(start=world.later(2))
    empty.idempotency_key = ""
    invalid("idempotencyKey", world.user.res, "Create", empty)
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,)) == [(2,)]


def test_a_refused_key_stays_refused_and_another_request_with_it_is_a_conflict(world: World) -> None:
    """Spec "Drafts and idempotency": a refused key stays ACCESS_DENIED with the same request
    (no second decision), and another request with the key is CONFLICT naming the reservation;
    neither changes the refused row, and neither places anything."""
    world.policy('forbid(principal, action, resource) when { resource has gangSize && resource.gangSize == 1 '
                 '&& resource has durationHours && resource.durationHours > 2 };\n'
                 'permit(principal, action, resource);')
    code, reason, details = refused(world.create, key="refused", duration="3h")
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    rid = details["reservationId"]
    before = world.sql("SELECT state, version, request_hash FROM reservations WHERE id = %s", (rid,))
    assert before[0][0] == "denied"
    # The same request, even once the policy would allow it: the key stays refused.
    world.policy("permit(principal, action, resource);")
    assert refused(world.create, key="refused", duration="3h")[1] == "ACCESS_DENIED"
    code, reason, details = refused(world.create, key="refused", duration="1h")
    assert (code, reason, details["reservationId"]) == (grpc.StatusCode.ABORTED, "CONFLICT", rid)
    assert world.sql("SELECT state, version, request_hash FROM reservations WHERE id = %s", (rid,)) == before
    assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (rid,)) == [(0,)]
