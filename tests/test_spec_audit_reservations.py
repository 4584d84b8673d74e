"""Promises of the reservations page that no other test held the product to, each driven through
the real API: which IAM action renew, release and cancel are decided on, wait left out of the
request hash, an Unschedulable create that asks to wait, the list's default page, renew and
cancel outside their states, extend's idempotency key, terminal releases, and the data of
reservation.binding-rejected."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from structlog.testing import capture_logs

from bettercompute.v1 import reservations_pb2 as pb
from tests.invariants import check_invariants
from tests.conftest import module_stack
from tests.promise_support import SigningNodes, poll, wake_up_times
from tests.test_mcp import run_agent
from tests.support import (PERMISSIVE, Client, ServerThread, World, clock_now, eventually, get, invalid,
                           make_world, refused)

REPO = pathlib.Path(__file__).resolve().parents[1]


def call(world: World, method: str, rid: str, client=None) -> pb.Reservation:
    request = getattr(pb, f"{method}ReservationRequest")(tenant_id=world.tenant, reservation_id=rid)
    return (client or world.user).res(method, request)


def events_of(world: World, rid: str, kind: str) -> list[dict]:
    return [d for (d,) in world.sql("SELECT data FROM events WHERE subject = %s AND type = %s ORDER BY id",
                                    (f"reservation/{rid}", kind))]


def forbid(action: str) -> str:
    return PERMISSIVE + f' forbid(principal, action == Action::"{action}", resource);'


# "reservations.renew (compute:reservations:extend)" and "Both are compute:reservations:release".

def test_renew_is_decided_as_compute_reservations_extend(world: World) -> None:
    leased = world.create(count=1, lease_seconds=600, start=world.later())
    world.policy(forbid("compute:reservations:extend"))
    code, reason, details = refused(call, world, "Renew", leased.id)
    assert (code, reason, details["reservationId"]) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED", leased.id)
    assert get(world, leased.id).lease_deadline == leased.lease_deadline  # refused: nothing moved
    # Release and cancel are not extend: still allowed under this policy.
    assert call(world, "Cancel", leased.id).state == "cancelled"
    world.policy(PERMISSIVE)


def test_release_and_cancel_are_decided_as_compute_reservations_release(world: World) -> None:
    leased = world.create(count=1, lease_seconds=600, start=world.later())
    world.policy(forbid("compute:reservations:release"))
    for method in ("Release", "Cancel"):
        code, reason, details = refused(call, world, method, leased.id)
        assert (code, reason, details["reservationId"]) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED",
                                                            leased.id), method
    assert get(world, leased.id).state == "placed"
    # Renew is extend, not release: allowed under this policy.
    assert call(world, "Renew", leased.id).state == "placed"
    world.policy(PERMISSIVE)
    check_invariants(world.conninfo, world.tenant)


# "wait is excluded from the request hash".

def test_a_repeat_that_waits_differently_or_not_at_all_is_the_same_request(world: World) -> None:
    first = world.user.res("Create", world.create_request(key="waits", count=1, start=world.later(),
                                                          wait=pb.Wait(timeout_ms=1000)))
    for wait in (pb.Wait(timeout_ms=5000), None):
        request = world.create_request(key="waits", count=1, start=first.request.start)
        if wait is not None:
            request.wait.CopyFrom(wait)
        again = world.user.res("Create", request)
        assert (again.id, again.created_at, again.state) == (first.id, first.created_at, "placed")
    # Not vacuous: another request under the key is a CONFLICT.
    code, reason, details = refused(world.user.res, "Create", world.create_request(
        key="waits", count=2, start=first.request.start))
    assert (reason, details["reservationId"]) == ("CONFLICT", first.id)


# "With the inline placer a create is placed or Unschedulable at once, so wait returns immediately."

def test_an_unschedulable_create_that_asks_to_wait_answers_pending_at_once(world: World) -> None:
    with capture_logs() as logs:
        r = world.user.res("Create", world.create_request(count=8, model="B200", wait=pb.Wait(timeout_ms=20_000)))
    assert r.state == "pending" and r.operation.state == "succeeded"
    assert [c.type for c in r.conditions] == ["Unschedulable"]
    # At most the one read that finds the operation stopped: no pause of the back-off.
    waits = [e for e in logs if e.get("event") == "operation wait" and e.get("reservation_id") == r.id]
    assert all(e["pauses_ms"] == [] for e in waits), waits


# "pages with limit (1 to 200, default 50) and cursor, the last reservation's id".

def test_list_pages_50_by_default_and_takes_up_to_200(world: World) -> None:
    made = [world.create(count=1, duration="30m", start=world.later(1 + i)).id for i in range(51)]

    def page(**kw) -> pb.ListReservationsResponse:
        return world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, **kw))

    first = page()
    assert [r.id for r in first.items] == made[:0:-1]  # newest first, 50 of them
    assert first.next_cursor == made[1]
    rest = page(cursor=first.next_cursor)
    assert [r.id for r in rest.items] == [made[0]] and rest.next_cursor == ""
    assert [r.id for r in page(limit=200).items] == made[::-1]
    for limit in (-1, 201):
        invalid("limit", world.user.res, "List", pb.ListReservationsRequest(tenant_id=world.tenant, limit=limit))


# "reservations.renew ... in states placed, binding and active" and "Renewing a reservation
# created without leaseSeconds is INVALID_STATE".

def test_renew_moves_a_placed_lease_and_is_invalid_state_when_pending_or_terminal(world: World) -> None:
    placed = world.create(count=1, lease_seconds=600, start=world.later())
    before = clock_now(world)
    renewed = call(world, "Renew", placed.id)
    after = clock_now(world)
    assert renewed.state == "placed" and renewed.during == placed.during
    assert before + 600_000 <= renewed.lease_deadline <= after + 600_000  # now plus leaseSeconds

    pending = world.create(count=8, model="B200", lease_seconds=600)
    assert pending.state == "pending"
    released = world.create(count=1, lease_seconds=600, start=world.later())
    call(world, "Release", released.id)
    for rid, state in ((pending.id, "pending"), (released.id, "released")):
        code, reason, details = refused(call, world, "Renew", rid)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE"), details
        assert (details["reservationId"], details["state"]) == (rid, state)
        assert get(world, rid).state == state
    check_invariants(world.conninfo, world.tenant)


# "reservations.extend takes exactly one of until (epoch milliseconds) or by (a duration), plus an
# idempotencyKey."

def test_extend_without_an_idempotency_key_is_invalid_input_naming_it(world: World) -> None:
    r = world.create(count=1, start=world.later())
    invalid("idempotencyKey", world.user.res, "Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=r.id, by="1h"))
    assert get(world, r.id).during == r.during


# "reservations.cancel withdraws one that has not started (pending or placed); anything else is
# INVALID_STATE." A request awaiting its person's confirmation is neither.

def test_cancel_of_a_request_awaiting_confirmation_is_invalid_state(world: World) -> None:
    world.policy("permit(principal, action, resource) unless { context.delegated };")
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id,
                              confirm_actions=["compute:reservations:create"])
    code, reason, details = refused(world.create, agent, key="held", count=1)
    assert reason == "CONFIRMATION_REQUIRED"
    rid = details["reservationId"]
    code, reason, details = refused(call, world, "Cancel", rid)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
    assert (details["reservationId"], details["state"]) == (rid, "awaiting-confirmation")
    assert get(world, rid).state == "awaiting-confirmation"
    world.policy(PERMISSIVE)


# "releasing a terminal one changes nothing" (a cancelled one as well as a released one).

def test_releasing_a_cancelled_reservation_changes_nothing(world: World) -> None:
    r = world.create(count=1, start=world.later())
    cancelled = call(world, "Cancel", r.id)
    again = call(world, "Release", r.id)
    assert (again.state, again.version, again.during) == ("cancelled", cancelled.version, cancelled.during)
    assert events_of(world, r.id, "reservation.released") == []
    assert len(events_of(world, r.id, "reservation.cancelled")) == 1


# "reservation.binding-rejected (with allocationId, nodeId and reason ...)", with state and poolId.

def test_binding_rejected_carries_allocation_node_reason_state_and_pool(world: World) -> None:
    nodes = SigningNodes(world)
    r = world.create(count=1, duration="2h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0]
    # Signed by the node, but naming a device that is not the allocation's: it never counts.
    assert nodes.report(alloc.node_id, alloc.id, cdi_devices=["bcd.dev/gpu=GPU-not-this-one"]) == "stored"
    [data] = poll(lambda: events_of(world, r.id, "reservation.binding-rejected"), what="binding-rejected")
    assert (data["allocationId"], data["nodeId"], data["state"], data["poolId"]) == (
        alloc.id, alloc.node_id, "binding", world.pool_id)
    assert data["reason"]
    assert get(world, r.id).state == "binding"


# "The capacity.reservations reconciler drives each reservation, woken by the work queue at the
# moments that matter: the start, 15 minutes before it, ..., the end and the lease deadline."
# Each way a reservation is placed writes them: a create placed at once, and a pending one placed
# by its retry when capacity frees.

MIN = 60_000


def moments_of(r: pb.Reservation) -> set[int]:
    return {r.during.start - 15 * MIN, r.during.start, r.during.end, r.lease_deadline}


def test_every_placement_wakes_the_reconciler_at_start_15_minutes_before_end_and_lease(world: World) -> None:
    at_once = world.create(count=1, duration="2h", start=world.later(24), lease_seconds=3600)
    assert at_once.state == "placed" and at_once.HasField("lease_deadline")
    assert moments_of(at_once) <= set(wake_up_times(world, at_once.id)), wake_up_times(world, at_once.id)

    start = world.later(48)
    blockers = [world.create(count=8, start=start, duration="1h") for _ in world.nodes]
    waiting = world.create(count=8, start=start, duration="1h", lease_seconds=3600)
    assert waiting.state == "pending" and not waiting.HasField("lease_deadline")
    call(world, "Cancel", blockers[0].id)  # frees capacity: the pool's pending reservations are retried now
    placed = eventually(world, waiting.id, lambda x: x.state == "placed")
    assert placed.during.start == start and placed.HasField("lease_deadline")
    assert moments_of(placed) <= set(wake_up_times(world, waiting.id)), wake_up_times(world, waiting.id)
    check_invariants(world.conninfo, world.tenant)


# "The better-compute reserve command sends wait (its --wait, 20 seconds by default) and, if the
# answer is still Queued, keeps polling reservations.get until the same deadline." Run as a real
# process against a lease pool whose server holds a create at most 1 s: the answer comes back
# queued and only the CLI's own polling can see it placed.

LEASE_WAIT_CAP_S = 1.0


@pytest.fixture(scope="module")
def lease_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, default_placer="lease", placer_lease_seconds=1.5,
                            create_wait_cap_seconds=LEASE_WAIT_CAP_S)


def held_lease_world(lease_stack: tuple[ServerThread, Client]) -> World:
    """A lease pool whose lease an absent holder holds: nothing places a reservation until
    `lapse_lease` lets the server's own lease worker take it."""
    server, root = lease_stack
    world = make_world(server.endpoint, root, server.conninfo)
    world.sql("INSERT INTO pool_leases (pool_id, holder, epoch, deadline) "
              "VALUES (%s, 'elsewhere', 7, clock_timestamp() + interval '1 hour') "
              "ON CONFLICT (pool_id) DO UPDATE SET holder = 'elsewhere', epoch = pool_leases.epoch + 1, "
              "deadline = EXCLUDED.deadline", (world.pool_id,))
    return world


def lapse_lease(world: World) -> None:
    world.sql("UPDATE pool_leases SET deadline = clock_timestamp() WHERE pool_id = %s", (world.pool_id,))


def rpcs(logs: list[dict], world: World, method: str) -> list[dict]:
    return [e for e in list(logs) if e.get("event") == "rpc" and e.get("tenant") == world.tenant
            and e.get("method") == f"/bettercompute.v1.Reservations/{method}"]


def test_reserve_keeps_polling_get_after_a_queued_answer_by_default(
        lease_stack: tuple[ServerThread, Client], tmp_path: pathlib.Path) -> None:
    world = held_lease_world(lease_stack)
    token = world.user.metadata[0][1].removeprefix("Bearer ")
    env = dict(os.environ, BC_DATA_DIR=str(tmp_path / "none"), PYTHONUNBUFFERED="1")
    env.pop("DATABASE_URL", None)
    with capture_logs() as logs:
        process = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "--endpoint", world.endpoint, "--token", token,
             "--tenant", world.tenant, "--pool", world.pool_id, "--json", "reserve", "--gpus", "1",
             "--start", "+2h", "--for", "1h"],  # no --wait: its default
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            [created] = poll(lambda: rpcs(logs, world, "Create"), what="the CLI's create answered")
            # It sent wait: the server held the answer up to its cap before answering queued.
            assert created["code"] == "OK" and created["duration_ms"] >= LEASE_WAIT_CAP_S * 900, created
            poll(lambda: rpcs(logs, world, "Get"), what="the CLI polling get after the queued answer")
            lapse_lease(world)
            out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert process.returncode == 0, err
    answer = json.loads(out)
    assert answer["state"] == "placed" and answer["operation"]["state"] == "succeeded", answer
    assert get(world, answer["id"]).state == "placed"
    world.close()


# "The MCP reserve_gpus tool sends wait from its waitSeconds" (and polls like the CLI).

def test_mcp_reserve_gpus_waits_for_placement_for_its_wait_seconds(
        lease_stack: tuple[ServerThread, Client], tmp_path: pathlib.Path) -> None:
    world = held_lease_world(lease_stack)
    token = world.user.metadata[0][1].removeprefix("Bearer ")
    answers: list[dict] = []

    async def script(call) -> None:
        failed, booked = await call("reserve_gpus", gpus=1, topology="", duration="1h", start="+2h", waitSeconds=20)
        assert not failed, booked
        answers.append(booked)

    with capture_logs() as logs:
        def lapse_once_polled() -> None:
            poll(lambda: rpcs(logs, world, "Get"), seconds=30, what="the tool polling get after the queued answer")
            lapse_lease(world)

        with ThreadPoolExecutor(1) as pool:
            lapsed = pool.submit(lapse_once_polled)
            run_agent(world, tmp_path, token, script)
            lapsed.result(timeout=5)
    [booked] = answers
    assert booked["status"] == "placed" and booked["reservation"]["operation"]["state"] == "succeeded", booked
    [created] = rpcs(logs, world, "Create")
    assert created["code"] == "OK" and created["duration_ms"] >= LEASE_WAIT_CAP_S * 900, created  # it sent wait
    world.close()


def test_a_batch_placement_wakes_the_reconciler_at_its_moments_too(lease_stack: tuple[ServerThread, Client]) -> None:
    world = held_lease_world(lease_stack)
    queued = world.create(count=1, duration="2h", start=world.later(24), lease_seconds=3600)
    assert queued.state == "queued"
    lapse_lease(world)
    placed = eventually(world, queued.id, lambda x: x.state == "placed", seconds=20)
    assert placed.HasField("lease_deadline")
    assert moments_of(placed) <= set(wake_up_times(world, placed.id)), wake_up_times(world, placed.id)
    world.close()
