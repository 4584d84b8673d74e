"""Waiting for placement (spec "Waiting for placement"): the server re-reads the reservation,
backing off from 50 ms to 1 s, until the operation stops running or timeoutMs passes; the answer
is the last read either way. With the inline placer a create is placed at once, so wait returns
after one read; extend does not wait.

The reads are observed through the one line each wait logs (its reads and the pauses between
them), so nothing here depends on how fast the machine is."""

from __future__ import annotations

import grpc
import pytest
from structlog.testing import capture_logs

from bettercompute.v1 import reservations_pb2 as pb
from controlplane.ids import draft_id
from controlplane.reservations.wait import wait_for_operation
from tests.support import Client, ServerThread, World, rpc_error

LADDER_MS = [50, 100, 200, 400, 800] + [1000] * 40


def waits(logs: list[dict], rid: str) -> list[dict]:
    return [e for e in logs if e.get("event") == "operation wait" and e.get("reservation_id") == rid]


def test_the_wait_backs_off_from_50_ms_to_1_s_and_answers_the_last_read(
    stack: tuple[ServerThread, Client], world: World
) -> None:
    server, _ = stack
    # A draft whose operation is still running: the one a QUOTA_EXCEEDED create leaves behind.
    world.quota(1)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(key="too-big", count=2)
    assert rpc_error(exc)[1] == "QUOTA_EXCEEDED"
    rid = draft_id(world.tenant, world.user_id, "too-big")
    with capture_logs() as logs:
        view = server.call(wait_for_operation(server.app.runtime, world.tenant, rid, 4000))
    assert (view["id"], view["operation_state"]) == (rid, "running")  # a timeout is not an error
    [line] = waits(logs, rid)
    pauses = line["pauses_ms"]
    assert line["reads"] == len(pauses) + 1
    assert len(pauses) >= 6, pauses  # 50+100+200+400+800 ms pass well inside 4 s: the cap is reached
    assert pauses[:-1] == LADDER_MS[:len(pauses) - 1], pauses  # doubling from 50 ms, capped at 1 s
    assert 0 < pauses[-1] <= LADDER_MS[len(pauses) - 1]  # the last pause is cut at the timeout


def test_a_placed_create_answers_at_once_and_extend_does_not_wait(world: World) -> None:
    """Placed by the inline placer, a create asking to wait answers the reservation as placed,
    read in the placing transaction: no wait and no read after it."""
    with capture_logs() as logs:
        r = world.user.res("Create", world.create_request(count=1, start=world.later(1),
                                                          wait=pb.Wait(timeout_ms=20_000)))
        assert r.state == "placed" and r.operation.state == "succeeded"
        out = world.user.res("Extend", pb.ExtendReservationRequest(tenant_id=world.tenant, reservation_id=r.id,
                                                                   by="1h", idempotency_key="longer"))
        assert out.extended
    assert waits(logs, r.id) == []  # neither the create nor the extend waited
    assert "wait" not in pb.ExtendReservationRequest.DESCRIPTOR.fields_by_name  # extend cannot ask to wait


def test_a_create_placed_to_start_now_answers_placed_as_committed(world: World) -> None:
    """The reconciler moves a reservation that starts now on to binding as soon as the create
    commits; the create answers the reservation as it placed it, read before the commit, so the
    answer never races the reconciler (and needs no read after it)."""
    with capture_logs() as logs:
        answers = [world.user.res("Create", world.create_request(count=1, wait=pb.Wait(timeout_ms=20_000)))
                   for _ in range(5)]
    assert [(r.state, r.operation.state) for r in answers] == [("placed", "succeeded")] * 5
    assert all(len(r.allocations) == 1 for r in answers)
    assert not any(waits(logs, r.id) for r in answers)
