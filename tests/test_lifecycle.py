"""Release, cancel, renew, extend (not yet served), list, and async-with-wait."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import grpc
import psycopg
import pytest
import structlog

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.config import Settings
from tests.conftest import module_stack
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, make_world, rpc_error


def call(world: World, method: str, rid: str, client=None) -> pb.Reservation:
    request = getattr(pb, f"{method}ReservationRequest")(tenant_id=world.tenant, reservation_id=rid)
    return (client or world.user).res(method, request)


def bookings(world: World, rid: str) -> list[tuple]:
    return world.sql(
        "SELECT epoch_ms(lower(b.during)), epoch_ms(upper(b.during)) FROM bookings b"
        " JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = %s", (rid,))


def test_release_truncates_the_booking_at_compute_now_and_refunds(world: World) -> None:
    r = world.create(count=2, duration="8h")
    before = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    released = call(world, "Release", r.id)
    after = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    assert released.state == "released"
    assert before <= released.during.end <= after
    assert all(before <= end <= after for _, end in bookings(world, r.id))
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL",
                     (r.id,))[0][0] == 0
    assert [a.state for a in released.allocations] == ["released"]
    (data,) = world.sql("SELECT data FROM events WHERE subject = %s AND type = 'reservation.released'",
                        (f"reservation/{r.id}",))[0]
    assert data == {"state": "released", "poolId": world.pool_id, "reason": "release"}


def test_release_deletes_future_bookings(world: World) -> None:
    now_ms = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    r = world.create(count=1, start=now_ms + 86_400_000)
    call(world, "Release", r.id)
    assert bookings(world, r.id) == []


def test_releasing_a_pending_reservation_cancels_it(world: World) -> None:
    r = world.create(count=8, model="none-such")
    assert r.state == "pending"
    out = call(world, "Release", r.id)
    assert out.state == "cancelled"
    assert world.sql("SELECT count(*) FROM quota_charges WHERE reservation_id = %s AND refunded_at IS NULL",
                     (r.id,))[0][0] == 0


def test_releasing_a_terminal_reservation_changes_nothing(world: World) -> None:
    r = world.create(count=1)
    first = call(world, "Release", r.id)
    again = call(world, "Release", r.id)
    assert again.state == "released" and again.version == first.version and again.during == first.during
    assert world.sql("SELECT count(*) FROM events WHERE subject = %s AND type = 'reservation.released'",
                     (f"reservation/{r.id}",))[0][0] == 1


def test_cancel_withdraws_pending_or_placed_and_refuses_anything_else(world: World) -> None:
    placed = world.create(count=1, start=world.later())
    assert call(world, "Cancel", placed.id).state == "cancelled"
    pending = world.create(count=8, model="none-such")
    assert call(world, "Cancel", pending.id).state == "cancelled"
    released = world.create(count=1)
    call(world, "Release", released.id)
    for rid in (released.id, placed.id):
        with pytest.raises(grpc.RpcError) as exc:
            call(world, "Cancel", rid)
        code, reason, details = rpc_error(exc)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
        assert details["reservationId"] == rid
    assert world.sql("SELECT count(*) FROM quota_charges WHERE refunded_at IS NULL AND tenant_id = %s",
                     (world.tenant,))[0][0] == 0


def test_renew_moves_the_lease_and_needs_lease_seconds(clock_world: World) -> None:
    world = clock_world  # its own database: moving the clock wakes no other test's work items
    leased = world.create(count=1, lease_seconds=600)
    assert leased.HasField("lease_deadline")
    assert leased.lease_deadline - leased.during.start == pytest.approx(600_000, abs=2000)
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=60_000))
    renewed = call(world, "Renew", leased.id)
    assert renewed.lease_deadline >= leased.lease_deadline + 59_000
    assert renewed.during == leased.during
    plain = world.create(count=1)
    with pytest.raises(grpc.RpcError) as exc:
        call(world, "Renew", plain.id)
    assert rpc_error(exc)[1] == "INVALID_STATE"
    check_invariants(world.conninfo, world.tenant)


def test_list_mine_by_default_all_on_request_newest_first_with_filters_and_paging(world: World) -> None:
    other_id, other = world.identity()
    mine = [world.create(count=1, start=world.later()) for _ in range(5)]
    theirs = world.create(other, count=1)
    call(world, "Release", mine[0].id)

    def ids(**kw) -> list[str]:
        return [r.id for r in world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, **kw)).items]

    assert ids() == [r.id for r in reversed(mine)]
    assert ids(scope="all")[0] == theirs.id and len(ids(scope="all")) == 6
    assert ids(states=["released"]) == [mine[0].id]
    assert ids(pool_id=world.pool_id, states=["placed"]) == [r.id for r in reversed(mine[1:])]
    page1 = world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, limit=2))
    assert [r.id for r in page1.items] == [mine[4].id, mine[3].id] and page1.next_cursor == mine[3].id
    page2 = ids(limit=2, cursor=page1.next_cursor)
    assert page2 == [mine[2].id, mine[1].id]
    assert ids(limit=2, cursor=page2[-1]) == [mine[0].id]
    for bad in ({"limit": 201}, {"scope": "everyone"}, {"states": ["draft"]}):
        with pytest.raises(grpc.RpcError) as exc:
            ids(**bad)
        assert rpc_error(exc)[1] == "INVALID_INPUT"


# Async-with-wait -----------------------------------------------------------------------------
#
# A create holds its answer while its operation runs. With the inline placer the only running
# operation is a request awaiting a person's confirmation, and an agent's retry of such a request
# is answered CONFIRMATION_REQUIRED at once. What waits is a concurrent twin: two first attempts
# with one key both reach transaction 2; the one that commits second finds the request decided
# meanwhile, answers with the stored reservation, and so waits on its running operation until the
# person confirms and a retry places it. A lock on the confirmations table (no row written) keeps
# both twins in transaction 2 until both are there, so the order is certain.

AGENT_POLICY = "permit(principal, action, resource) unless { context.delegated };"
CREATE = "compute:reservations:create"


@dataclass
class Twins:
    world: World
    agent: Client
    key: str
    confirmation_id: str
    rid: str
    waiter: Future  # the twin that waits: ("ok", reservation) or ("error", RpcError), and when
    released: float  # monotonic time the twins were let go


@dataclass
class _Raised:
    """What rpc_error reads from a pytest.raises result: the exception as `value`."""

    value: grpc.RpcError


def _attempt(client: Client, request: pb.CreateReservationRequest, timeout: float) -> tuple[str, Any, float]:
    try:
        out: tuple[str, Any] = ("ok", client.res("Create", request, timeout=timeout))
    except grpc.RpcError as exc:
        out = ("error", exc)
    return (*out, time.monotonic())


def _lock_waiters(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()").fetchone()[0]


def held_create(world: World, pool: ThreadPoolExecutor, wait_ms: int, rpc_timeout: float = 60) -> Twins:
    """Send the twins (each with wait.timeoutMs `wait_ms`); return once one of them has been
    answered CONFIRMATION_REQUIRED, with the other, the waiter, still in flight."""
    world.policy(AGENT_POLICY)
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id, confirm_actions=[CREATE])
    key = f"twin-{uuid.uuid4().hex[:8]}"
    request = world.create_request(key=key, count=1, wait=pb.Wait(timeout_ms=wait_ms))
    with psycopg.connect(world.conninfo) as lock:
        lock.execute("LOCK TABLE confirmations IN SHARE MODE")  # blocks the first twin's insert
        twins = [pool.submit(_attempt, agent, request, rpc_timeout) for _ in range(2)]
        deadline = time.monotonic() + 30
        while _lock_waiters(lock) < 2:  # one at the insert, the other behind its row lock
            assert time.monotonic() < deadline and not any(t.done() for t in twins), \
                [t.result() for t in twins if t.done()]
            time.sleep(0.02)
        lock.rollback()
        released = time.monotonic()
    first = next(as_completed(twins, timeout=30))
    kind, exc, _ = first.result()
    assert kind == "error", f"the first twin to answer is refused for confirmation: {exc}"
    code, reason, details = rpc_error(_Raised(exc))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CONFIRMATION_REQUIRED"), details
    (waiter,) = [t for t in twins if t is not first]
    return Twins(world, agent, key, details["confirmationId"], details["reservationId"], waiter, released)


def confirm_and_place(twins: Twins) -> pb.Reservation:
    """The person confirms and the agent retries: the operation stops running (placed, or binding
    already, since it starts now)."""
    twins.world.user.conf("Approve", pb.DecideConfirmationRequest(
        tenant_id=twins.world.tenant, confirmation_id=twins.confirmation_id))
    placed = twins.world.create(twins.agent, key=twins.key, count=1)
    assert placed.id == twins.rid and placed.operation.state == "succeeded"
    assert placed.state in ("placed", "binding"), placed  # binding already: it starts now
    return placed


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def test_wait_returns_at_once_with_the_inline_placer(world: World) -> None:
    started = time.monotonic()
    r = world.create(count=1, wait=pb.Wait(timeout_ms=20_000))
    assert r.state == "placed" and time.monotonic() - started < 10  # at once, not after 20 s


def test_wait_timeout_is_not_an_error_and_returns_the_last_read(world: World, pool: ThreadPoolExecutor) -> None:
    twins = held_create(world, pool, wait_ms=1200)
    kind, answer, ended = twins.waiter.result(timeout=60)
    assert kind == "ok", answer
    assert answer.id == twins.rid and answer.state == "awaiting-confirmation"
    assert answer.operation.state == "running"
    assert 1.1 <= ended - twins.released < 10  # the wait began after the release
    check_invariants(world.conninfo, world.tenant)


def test_wait_answers_as_soon_as_the_operation_stops_running(world: World, pool: ThreadPoolExecutor) -> None:
    twins = held_create(world, pool, wait_ms=20_000)
    time.sleep(max(0.0, twins.released + 0.6 - time.monotonic()))
    assert not twins.waiter.done(), twins.waiter.result()  # still waiting on the running operation
    stopped = time.monotonic()
    confirm_and_place(twins)
    kind, answer, ended = twins.waiter.result(timeout=60)
    assert kind == "ok", answer
    assert answer.id == twins.rid and answer.operation.state == "succeeded"
    assert answer.state in ("placed", "binding"), answer
    # Answered after the stop (it carries the placement), within the 1 s back-off plus a margin,
    # long before the 20 s the client asked to wait.
    assert 0.5 <= ended - twins.released and ended - stopped < 10
    check_invariants(world.conninfo, world.tenant)


CAP_S = 1.0


@pytest.fixture(scope="module")
def capped_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, create_wait_cap_seconds=CAP_S)


def test_the_server_caps_the_wait(capped_stack: tuple[ServerThread, Client], pool: ThreadPoolExecutor,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A create asking to wait 20 s answers after the server's cap (30 s by default; 1 s here),
    with the operation still running."""
    monkeypatch.delenv("BC_CREATE_WAIT_CAP_SECONDS", raising=False)
    assert Settings(database_url="").create_wait_cap_seconds == 30
    server, root = capped_stack
    world = make_world(server.endpoint, root, server.conninfo)
    twins = held_create(world, pool, wait_ms=20_000)
    kind, answer, ended = twins.waiter.result(timeout=60)
    assert kind == "ok", answer
    assert answer.state == "awaiting-confirmation" and answer.operation.state == "running"
    assert CAP_S - 0.1 <= ended - twins.released < 10, ended - twins.released  # not the 20 s asked
    check_invariants(world.conninfo, world.tenant)


def test_a_client_that_goes_away_stops_the_wait(world: World, pool: ThreadPoolExecutor) -> None:
    with structlog.testing.capture_logs() as logs:
        twins = held_create(world, pool, wait_ms=20_000, rpc_timeout=6)
        kind, exc, _ = twins.waiter.result(timeout=60)
        assert kind == "error" and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
        deadline = time.monotonic() + 10
        while not any(e.get("event") == "rpc" and e.get("code") == "CANCELLED" for e in logs):
            assert time.monotonic() < deadline, logs
            time.sleep(0.05)
    cancelled = [e for e in logs if e.get("event") == "create wait cancelled"]
    assert [e["reservation_id"] for e in cancelled] == [twins.rid], logs
    check_invariants(world.conninfo, world.tenant)
