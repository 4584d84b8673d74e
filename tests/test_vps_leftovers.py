"""Leftovers of the hostile review of instances, grants and metering (spec 001): minutes billed
twice (or not at all) when a grant's start or end is applied late, an instance a create's retry
confirmed vanishing under the first call's give-up, an account deleted under running instances,
and gpu.hours of node leases counted back or twice. providersim is the only stand-in; the gpu.hours
test stages a node lease's machine gaining atoms as rows (what migration 0033's join writes)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest

from bettercompute.provider.v1 import provider_pb2 as ppb
from bettercompute.v1 import providers_pb2 as vpb
from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import module_stack
from tests.promise_support import SigningNodes
from tests.support import Client, ServerThread, World, eventually, rpc_error
from tests.vps_support import HOUR, MIN, Vps, metered, progress, sim, v, world_of  # noqa: F401 (fixtures)

PROVIDER_SECONDS = 4  # how long a provider call is waited for, in this module


@pytest.fixture
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """vps_support's own_stack, with time for a retry while a provider call is outstanding."""
    yield from module_stack(pg_uri, clock_control=True, metering_seconds=0.2, metering_settle_seconds=0,
                            provider_call_seconds=PROVIDER_SECONDS)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> Iterator[World]:
    yield from world_of(stack)


def until(check: Callable[[], bool], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def created_ms(v: Vps, instance_id: str) -> int:
    return v.world.sql("SELECT epoch_ms(created_at) FROM instances WHERE id = %s", (instance_id,))[0][0]


# --- 1. a grant that starts before it is activated -------------------------------------------------

def test_instances_stopped_or_deleted_after_a_grant_started_but_before_it_was_activated_are_billed_once(
        v: Vps) -> None:
    """startsAt five minutes in the past (or a late worker): an instance stopped, and one deleted,
    after the grant's start but before it was activated ran in the grant's term at the reservation
    rate. The grant's slot-hours pay for those minutes: they must not be billed at the reservation
    rate too."""
    stopped, deleted = v.instance(), v.instance()
    v.advance(10 * MIN)
    v.instance_call("Stop", stopped.id)
    v.instance_call("Delete", deleted.id)
    v.advance(2 * MIN)
    start = v.now() - 4 * MIN  # two minutes before the stop and the delete
    g = v.grant(slots=2, starts_at=start, ends_at=start + HOUR)
    until(lambda: v.get_grant(g.id).state == "active")
    # The stopped one is the grant's now (it keeps its slot); the deleted one's last minutes were.
    assert v.instance_call("Get", stopped.id).grant_id == g.id
    v.advance(3 * HOUR)
    until(lambda: progress(v, "vps.instances") >= start + HOUR)
    for made in (stopped, deleted):
        subject = f"instance/{made.id}"
        assert metered(v, "vm.reserved.instance.hours", subject) == pytest.approx(
            (start - created_ms(v, made.id)) / HOUR, abs=1e-6)
        gone = v.world.sql("SELECT epoch_ms(max(ended_at)) FROM instance_segments WHERE instance_id = %s",
                           (made.id,))[0][0]
        assert metered(v, "vm.grant.usage.hours", subject) == pytest.approx((gone - start) / HOUR, abs=1e-6)


def test_instances_stopped_or_deleted_after_a_grant_ended_but_before_it_was_handled_are_billed_from_its_end(
        v: Vps) -> None:
    """A late worker: the grant's term ended, its instances were stopped and deleted after that but
    before the worker ended the grant. Their minutes after the end are not the grant's (its
    slot-hours stop at endsAt): they are billed at the reservation rate, not left unbilled."""
    stopped, deleted = v.instance(), v.instance()
    start = v.now()
    g = v.grant(slots=2, starts_at=start, ends_at=start + HOUR)
    until(lambda: v.get_grant(g.id).state == "active")
    with psycopg.connect(v.world.conninfo) as holder:  # the worker skips the grant's end while held
        assert holder.execute("SELECT id FROM work_items WHERE subject = %s AND run_at = from_epoch_ms(%s)"
                              " FOR UPDATE", (g.id, start + HOUR)).fetchall()
        v.advance(HOUR + 10 * MIN)
        v.instance_call("Stop", stopped.id)
        v.instance_call("Delete", deleted.id)
        assert v.get_grant(g.id).state == "active"
        holder.rollback()
    until(lambda: v.get_grant(g.id).state == "ended")
    v.advance(3 * HOUR)
    until(lambda: progress(v, "vps.instances") >= start + 2 * HOUR)
    for made in (stopped, deleted):
        subject = f"instance/{made.id}"
        gone = v.world.sql("SELECT epoch_ms(max(ended_at)) FROM instance_segments WHERE instance_id = %s",
                           (made.id,))[0][0]
        assert metered(v, "vm.grant.usage.hours", subject) == pytest.approx(
            (start + HOUR - max(start, created_ms(v, made.id))) / HOUR, abs=1e-6)
        assert metered(v, "vm.reserved.instance.hours", subject) == pytest.approx(
            (gone - (start + HOUR) + max(0, start - created_ms(v, made.id))) / HOUR, abs=1e-6)


# --- 2. a create's retry answered while the first call gives up ------------------------------------

def at_provider(v: Vps, name: str) -> str:
    return v.sim.provider.GetInstance(ppb.InstanceRef(account=v.external, name=name)).state


def test_a_retry_that_the_provider_answered_while_the_first_create_gave_up_keeps_its_instance(v: Vps) -> None:
    """The provider stalls the first create past the control plane's deadline; the tenant retries
    under the same key meanwhile, and the provider (no longer stalling) makes the instance: the
    retry answers "running". The first call's give-up must not then delete that instance."""
    v.sim.faults(stall_ms=(PROVIDER_SECONDS + 20) * 1000)
    try:
        with ThreadPoolExecutor(1) as pool:
            began = time.monotonic()
            first = pool.submit(lambda: v.instance(key="retried", name="vm-retried"))
            until(lambda: v.sim.stalls.held["create_instance"] == 1)  # the first create is held at the provider
            v.sim.faults()
            retry = v.instance(key="retried", name="vm-retried")
            assert retry.state == "running" and at_provider(v, retry.id) == "running"
            try:
                answer = first.result(timeout=60)
            except grpc.RpcError as exc:
                answer = exc
            # Staged as meant: the provider held the first create until the control plane gave up.
            assert time.monotonic() - began >= PROVIDER_SECONDS
    finally:
        v.sim.faults()
    assert v.instance_call("Get", retry.id).state == "running"
    assert at_provider(v, retry.id) == "running"
    # The first call answers the instance its retry made.
    assert not isinstance(answer, grpc.RpcError), f"{answer.code()} {answer.details()}"
    assert answer.id == retry.id and answer.state == "running"
    v.scan()
    assert at_provider(v, retry.id) == "running"
    assert v.instance(key="retried", name="vm-retried").id == retry.id  # the key still answers it


# --- 3. an account deleted under its instances -------------------------------------------------------

def test_an_account_with_instances_not_deleted_cannot_be_deleted(v: Vps) -> None:
    """Deleting the account would leave its machines running at the provider, unbilled, and the
    tenant unable to stop them: refused while any instance on it is not deleted (a stopped one
    still holds a machine there)."""
    running, stopped = v.instance(), v.instance()
    v.instance_call("Stop", stopped.id)
    delete = vpb.GetProviderAccountRequest(tenant_id="root", account_id=v.account_id)
    for oldest, left in ((running, 2), (stopped, 1)):
        with pytest.raises(grpc.RpcError) as refused:
            v.root("accounts", "Delete", delete)
        assert rpc_error(refused) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE", {
            "accountId": v.account_id, "instanceId": oldest.id, "instances": str(left)})
        assert at_provider(v, oldest.id) == ("running" if oldest is running else "stopped")
        v.instance_call("Delete", oldest.id)
    assert v.root("accounts", "Delete", delete).id == v.account_id


# --- 4. gpu.hours of a node lease whose machine changes ----------------------------------------------

def join(v: Vps, rid: str, kind: str, parent: str | None, share: float) -> int:
    """An atom that became bookable on the reservation's node, booked for it from now to the end of
    its window, as a node lease takes it (migration 0033's join); the moment, in epoch ms."""
    [(allocation, node, upper, model)] = v.world.sql(
        "SELECT al.id, al.node_id, max(upper(b.during)), max(a.model) FROM allocations al"
        " JOIN bookings b ON b.allocation_id = al.id JOIN atoms a ON a.id = b.atom_id"
        " WHERE al.reservation_id = %s GROUP BY al.id, al.node_id", (rid,))
    atom = f"atm_{uuid.uuid4().hex[:20]}"
    v.world.sql("INSERT INTO atoms (id, node_id, kind, parent_id, device_uuid, model, gpu_equivalent, bookable)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, false)",
                (atom, node, kind, parent, f"GPU-{uuid.uuid4()}", model, share))
    return v.world.sql("INSERT INTO bookings (atom_id, allocation_id, during)"
                       " VALUES (%s, %s, tstzrange(compute_now(), %s, '[)')) RETURNING epoch_ms(lower(during))",
                       (atom, allocation, upper))[0][0]


def test_gpu_hours_count_each_gpu_for_the_time_it_was_held_and_a_gpu_beside_its_mig_instances_once(
        v: Vps) -> None:
    """A node lease takes the GPUs its machine gains while leased, and the MIG instances of a GPU it
    holds whole: a GPU that joined half an hour in is billed from then (not from the start of the
    lease, nor of the hour), and the GPU's MIG instances add nothing beside it."""
    v.world.add_node()
    r = v.world.create(count=1, start=v.now() + 30 * MIN, duration="6h")
    v.advance(31 * MIN)
    eventually(v.world, r.id, lambda x: x.state == "binding")
    SigningNodes(v.world).activate(r.id)
    activated = v.world.sql("SELECT epoch_ms(time) FROM events WHERE subject = %s AND type = 'reservation.active'",
                            (f"reservation/{r.id}",))[0][0]
    [(gpu,)] = v.world.sql("SELECT b.atom_id FROM bookings b JOIN allocations al ON al.id = b.allocation_id"
                           " WHERE al.reservation_id = %s", (r.id,))
    v.advance(30 * MIN)
    joined = join(v, r.id, "gpu", None, 1)
    for _ in range(7):
        join(v, r.id, "gpu.mig", gpu, 1 / 7)
    v.advance(2 * HOUR)
    ended = v.world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=v.world.tenant,
                                                                      reservation_id=r.id)).during.end
    v.advance(3 * HOUR)
    until(lambda: progress(v, "gpu") >= ended + HOUR)
    billed = v.world.sql("SELECT coalesce(sum(quantity), 0)::float8 FROM usage_records WHERE meter = 'gpu.hours'"
                         " AND subject = %s", (f"reservation/{r.id}",))[0][0]
    assert billed == pytest.approx(((ended - activated) + (ended - joined)) / HOUR, abs=1e-4)
