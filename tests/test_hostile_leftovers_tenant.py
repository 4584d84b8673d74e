"""Leftovers of earlier hostile reviews, attacked as a tenant and an agent would: a cancel after the
start (spec "Release and cancel": cancel withdraws only what has not started), an agent acting for
a platform operator (root-only calls skip IAM, so a delegation could not hold it there), and a
malformed server variable in the CLI's environment (the CLI reads only what it needs)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import message_factory

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.common.status import error_info
from tests.invariants import check_invariants
from tests.nodes_support import ControlPlane
from tests.promise_support import SigningNodes, poll
from tests.support import World, clock_now, eventually, make_world, rpc_error
from tests.test_cli import connection_flags
from tests.test_hostile_tenant import invoke, methods
from tests.vps_support import own_stack

REPO = pathlib.Path(__file__).resolve().parents[1]
MIN = 60_000
HOUR = 60 * MIN
CLI_TIMEOUT_S = 60


# Cancel checks the clock, not only the state ------------------------------------------------------


@pytest.fixture
def quiet(database: str) -> Iterator[ControlPlane]:
    """A control plane whose reconciler runs only when the test says so: a placed reservation
    stays placed after its start until then, as it does between the start and the worker's turn."""
    cp = ControlPlane(database)
    for _ in range(2):
        cp.world.add_node()
    yield cp
    cp.stop()


def _cancel(world: World, rid: str) -> pb.Reservation:
    return world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def _charged(world: World) -> int:
    return world.sql("SELECT coalesce(sum(amount), 0) FROM quota_charges WHERE tenant_id = %s"
                     " AND resource = 'gpu' AND refunded_at IS NULL", (world.tenant,))[0][0]


def test_a_placed_reservation_past_its_start_is_not_cancelled_before_the_reconciler_moves_it(
    quiet: ControlPlane,
) -> None:
    world = quiet.world
    start = clock_now(world) + HOUR
    r = world.create(count=2, start=start, duration="2h")
    assert r.state == "placed" and _charged(world) == 2
    quiet.advance(HOUR + 1000)  # its start has passed; nothing has run the reconciler
    assert quiet.get(r.id).state == "placed"

    with pytest.raises(grpc.RpcError) as exc:
        _cancel(world, r.id)
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE")
    assert details["state"] == "placed" and details["reservationId"] == r.id
    assert details["reason"] == "started" and int(details["start"]) == start
    after = quiet.get(r.id)
    assert after.state == "placed" and after.during == r.during and _charged(world) == 2
    assert "reservation.cancelled" not in [t for (t,) in world.sql(
        "SELECT type FROM events WHERE subject = %s", (f"reservation/{r.id}",))]

    # Release still ends it at compute_now(); the reconciler then has nothing to start.
    released = world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    assert released.state == "released" and released.during.end > start and _charged(world) == 0
    quiet.drain()
    quiet.check_invariants()


def test_a_pending_reservation_past_its_requested_start_is_still_cancellable(quiet: ControlPlane) -> None:
    world = quiet.world
    start = clock_now(world) + HOUR
    fillers = [world.create(count=8, start=start, duration="2h") for _ in range(2)]
    waiting = world.create(count=8, start=start, duration="2h")
    assert [f.state for f in fillers] == ["placed", "placed"] and waiting.state == "pending"
    quiet.advance(HOUR + 1000)
    assert _cancel(world, waiting.id).state == "cancelled" and _charged(world) == 16
    quiet.check_invariants()



def test_a_reservation_past_its_end_cannot_be_renewed_before_the_reconciler_ends_it(quiet: ControlPlane) -> None:
    """Renew, like extend, checks the clock: a window that ended (its lease still running) is over,
    not renewed, though the reconciler has not released it yet."""
    world = quiet.world
    r = world.create(count=1, duration="1h", lease_seconds=7200)
    assert r.state == "placed" and r.lease_deadline > r.during.end
    quiet.advance(HOUR + 1000)  # the window ended; the lease has an hour left
    with pytest.raises(grpc.RpcError) as exc:
        world.user.res("Renew", pb.RenewReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INVALID_STATE"), details
    assert details["reason"] == "window-ended" and details["reservationId"] == r.id, details
    assert quiet.get(r.id).lease_deadline == r.lease_deadline
    quiet.drain()
    assert quiet.get(r.id).state == "released"
    quiet.check_invariants()

# An agent acting for a platform operator ----------------------------------------------------------


def _root_agent(world: World) -> tuple[str, object, object]:
    """A person in the root tenant (a platform operator) and an agent acting for them there."""
    person, person_client = world.identity(tenants=[bootstrap.ROOT_TENANT])
    _, agent = world.identity(kind="agent", tenants=[bootstrap.ROOT_TENANT], person_identity_id=person,
                              confirm_actions=["compute:reservations:create"])
    return person, person_client, agent


def test_an_agent_for_a_root_member_is_denied_every_admin_and_node_admin_call(world: World) -> None:
    person, person_client, agent = _root_agent(world)
    # The person is an operator: Admin answers them.
    assert person_client.admin("GetClock", apb.GetClockRequest()).now > 0
    swept = 0
    for service in ("Admin", "NodeAdmin"):
        for method in methods(service):
            request = message_factory.GetMessageClass(method.input_type)()
            with pytest.raises(grpc.RpcError) as exc:
                invoke(agent, method, request)
            code, reason, details = rpc_error(exc)
            assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED"), (service, method.name)
            swept += 1
    assert swept >= 25


def test_an_agent_for_a_root_member_cannot_mint_its_person_an_undelegated_token(world: World) -> None:
    person, _, agent = _root_agent(world)
    before = world.sql("SELECT count(*) FROM api_tokens WHERE identity_id = %s", (person,))[0][0]
    for call in (lambda: agent.admin("CreateToken", apb.CreateTokenRequest(identity_id=person)),
                 lambda: agent.admin("CreateTenant", apb.CreateTenantRequest(id="agent-made", name="x")),
                 lambda: agent.admin("SetQuota", apb.SetQuotaRequest(tenant_id=world.tenant, resource="gpu",
                                                                     limit=10_000))):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert rpc_error(exc)[1] == "ACCESS_DENIED"
    assert world.sql("SELECT count(*) FROM api_tokens WHERE identity_id = %s", (person,))[0][0] == before
    assert world.sql("SELECT count(*) FROM tenants WHERE id = 'agent-made'") == [(0,)]
    nodes_stub = __import__("bettercompute.v1.nodes_pb2_grpc", fromlist=["_"]).NodeAdminStub(agent.channel)
    with pytest.raises(grpc.RpcError) as exc:
        nodes_stub.CreateJoinToken(npb.CreateJoinTokenRequest(pool_id=world.pool_id, node_name="evil"),
                                   metadata=agent.metadata, timeout=30)
    assert rpc_error(exc)[1] == "ACCESS_DENIED"


# The CLI reads only what it needs from the environment --------------------------------------------


def _cli(tmp_path: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ, BC_DATA_DIR=str(tmp_path / "no-dev"), PYTHONUNBUFFERED="1")
    environ.update(env)
    environ.pop("DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


MALFORMED = {"BC_PLACER_BATCH": "abc", "BC_WEBHOOK_ALLOW": "not-a-network", "BC_PENDING_RETRY_SECONDS": "soon"}


@pytest.mark.parametrize(("name", "value"), MALFORMED.items(), ids=MALFORMED.keys())
def test_a_malformed_server_variable_does_not_break_the_cli(
    world: World, tmp_path: pathlib.Path, name: str, value: str
) -> None:
    r = world.create(count=1, start=world.later())
    done = _cli(tmp_path, *connection_flags(world), "get", r.id, "--json", **{name: value})
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    assert f'"id": "{r.id}"' in done.stdout
    # The connection file is still found under BC_DATA_DIR.
    data = tmp_path / "data"
    data.mkdir()
    flags = connection_flags(world)
    (data / "connection.json").write_text(
        '{"endpoint": "%s", "token": "%s", "tenantId": "%s", "poolId": "%s"}' % tuple(flags[1::2]))
    (data / "connection.json").chmod(0o600)  # private, as `dev` writes it (a found file must be)
    done = _cli(tmp_path, "get", r.id, "--json", BC_DATA_DIR=str(data), **{name: value})
    assert done.returncode == 0 and f'"id": "{r.id}"' in done.stdout, (done.returncode, done.stderr)
    check_invariants(world.conninfo, world.tenant)



def test_the_mcp_server_reads_its_connection_file_under_bc_data_dir_past_a_malformed_server_variable(
    tmp_path: pathlib.Path,
) -> None:
    """An agent's MCP server finds its connection file as the CLI does: a bad file is the usage
    error naming it, never a traceback about a variable of the server's."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "connection.json").write_text("[]")
    (data / "connection.json").chmod(0o600)
    done = _cli(tmp_path, "mcp", BC_DATA_DIR=str(data), BC_PLACER_BATCH="abc")
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    assert "connection file" in done.stderr and not done.stdout


# The CLI's address space, capped at 1 GiB: a regression that reads /dev/zero fails in it, not the
# machine. Set by a shell that then execs the CLI, not by a preexec_fn: that runs Python in a child
# forked from this process while gRPC threads of the module's servers run in it, and gRPC aborted
# that child once (SIGABRT before exec: "Epoll1Poller encountered epoll_wait error").
_ADDRESS_SPACE_CAPPED = ["sh", "-c", f'ulimit -v {1 << 20} && exec "$0" "$@"']


@pytest.mark.parametrize("kind", ["pipe", "device"])
@pytest.mark.parametrize("which", ["connection file", "ca"])
def test_a_connection_file_or_ca_that_is_a_pipe_or_device_is_a_usage_error(
    tmp_path: pathlib.Path, kind: str, which: str
) -> None:
    """A connection file (found under BC_DATA_DIR, as a planted `.dev` would be) or a CA that is a
    pipe nobody writes or /dev/zero: exit 2 naming it, never a hang or a read without end."""
    data = tmp_path / "data"
    data.mkdir()
    special = tmp_path / "special"
    if kind == "pipe":
        os.mkfifo(special)
    else:
        special.symlink_to("/dev/zero")
    if which == "ca":
        (data / "connection.json").write_text(
            '{"endpoint": "127.0.0.1:1", "token": "t", "tenantId": "t1", "ca": "%s"}' % special)
        (data / "connection.json").chmod(0o600)
    else:
        (data / "connection.json").symlink_to(special)
    environ = dict(os.environ, BC_DATA_DIR=str(data), PYTHONUNBUFFERED="1")
    environ.pop("DATABASE_URL", None)
    done = subprocess.run([*_ADDRESS_SPACE_CAPPED, sys.executable, "-m", "controlplane.cli", "get", "rsv_x"],
                          cwd=REPO, env=environ, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-2000:])
    assert "is not a regular file" in done.stderr and not done.stdout, done.stderr

# Billing after a failed bind ----------------------------------------------------------------------


@pytest.fixture
def metered(pg_uri: str) -> Iterator[World]:
    """A control plane of the test's own (it moves the clock), metering every 0.2 s, two nodes."""
    stack = own_stack(pg_uri)
    server, root = next(stack)
    try:
        w = make_world(server.endpoint, root, server.conninfo, nodes=2)
        yield w
        w.close()
    finally:
        stack.close()  # runs the generator's finally: stop the server, drop the database


def test_a_reservation_placed_again_after_a_failed_bind_is_billed_for_the_gpus_it_holds_once(
    metered: World,
) -> None:
    world, nodes = metered, SigningNodes(metered)
    r = world.create(count=2, start=clock_now(world) + 30 * MIN, duration="6h")
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=31 * MIN))
    first = eventually(world, r.id, lambda x: x.state == "binding").allocations[0]
    assert nodes.report(first.node_id, first.id, kind="failed") == "stored"
    eventually(world, r.id, lambda x: x.state == "binding" and any(
        a.state == "binding" and a.node_id != first.node_id for a in x.allocations))
    nodes.activate(r.id)
    activated = world.sql("SELECT epoch_ms(time) FROM events WHERE subject = %s AND type = 'reservation.active'",
                          (f"reservation/{r.id}",))[0][0]
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=2 * HOUR))
    ended = world.user.res("Release", pb.ReleaseReservationRequest(
        tenant_id=world.tenant, reservation_id=r.id)).during.end
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=3 * HOUR))
    poll(lambda: world.sql("SELECT metered_until >= from_epoch_ms(%s) FROM metering_progress WHERE source = 'gpu'",
                           (ended + HOUR,)) == [(True,)], seconds=60, what="gpu.hours metered past the release")
    billed = world.sql("SELECT sum(quantity)::float8 FROM usage_records WHERE tenant_id = %s AND meter = 'gpu.hours'",
                       (world.tenant,))[0][0]
    # Two GPUs from active to release: the failed node's two, booked before it was active, are not billed.
    assert billed == pytest.approx(2 * (ended - activated) / HOUR, abs=2e-5)


# Cancels racing the start -------------------------------------------------------------------------


def test_cancels_racing_the_clock_past_the_start_either_withdraw_or_leave_a_started_reservation(
    clock_world: World,
) -> None:
    """Each cancel sent while the clock moves past the start either withdraws the reservation
    before its start (cancelled, refunded, never bound) or is INVALID_STATE and the reservation
    starts (binding, still charged): never both, never neither."""
    world = clock_world
    start = clock_now(world) + HOUR
    rids = [world.create(count=1, start=start, duration="1h").id for _ in range(12)]

    def cancel(rid: str) -> str:
        try:
            return _cancel(world, rid).state
        except grpc.RpcError as exc:
            info = error_info(exc)
            reason, details = info.reason, dict(info.metadata)
            assert reason == "INVALID_STATE", (exc.code(), reason, details)
            assert details["state"] in ("binding", "placed"), details
            return "refused"

    with ThreadPoolExecutor(13) as pool:
        answers = [pool.submit(cancel, rid) for rid in rids]
        pool.submit(world.root.admin, "AdvanceClock", apb.AdvanceClockRequest(by_ms=HOUR + 1000)).result()
        outcomes = dict(zip(rids, [a.result() for a in answers]))
    assert set(outcomes.values()) <= {"cancelled", "refused"}, outcomes
    for rid, outcome in outcomes.items():
        final = eventually(world, rid, lambda x: x.state in ("cancelled", "binding"))
        assert final.state == ("cancelled" if outcome == "cancelled" else "binding"), (outcome, final)
    assert _charged(world) == sum(1 for o in outcomes.values() if o == "refused")
    check_invariants(world.conninfo, world.tenant)
