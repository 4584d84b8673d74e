"""The node binding (whole-machine leases), end to end through the real control plane, gateway and
nodesim processes: metal deploys the profile from the start, the node reimages (simulated) and
reports the profile in its inventory, the worker verifies it and the reservation is active; after
the lease the node wipes the machine and returns to the platform. While leased, the node's
certificates carry the role node-tenant, which the node cannot choose.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from bettercompute.node.v1 import node_pb2, node_pb2_grpc
from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import capacity_pb2_grpc, nodes_pb2_grpc
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.devtools import devstack
from controlplane.reservations import reports
from nodesim.identity import Identity, IdentityStore
from nodesim.metal import IMAGE_FILE, STATE_FILE
from nodesim.node import REPROVISIONED_TOKEN
from tests.conftest import clone_database
from tests.support import Client, World, clock_now, make_world
from tests.test_e2e import Fleet, Stack, eventually, stack  # noqa: F401 (fixtures)
from tests.test_node_profiles import checksum, register

FAST = ("--reimage-seconds", "0.5", "--wipe-seconds", "0.5")


@pytest.fixture
def world(stack: Stack) -> Iterator[World]:  # noqa: F811
    """A tenant whose own pool has policy.tenantRoot (no nodes until a fleet joins it)."""
    w = metal_world(stack)
    yield w
    w.close()


@pytest.fixture
def fleets(stack: Stack, world: World) -> Iterator:  # noqa: F811
    started: list[Fleet] = []

    def make(count: int, *extra: str) -> Fleet:
        fleet = Fleet(stack, world, count)
        started.append(fleet)
        fleet.start(*extra)
        return fleet

    yield make
    for fleet in started:
        fleet.stop()


def lease(world: World, profile_id: str, version: int | None = None, **kw) -> pb.Reservation:
    node = pb.NodeLease(profile_id=profile_id)
    if version is not None:
        node.profile_version = version
    return world.create(count=8, binding="node", node=node, duration=kw.pop("duration", "8h"), **kw)


def until(check, seconds: float = 30, poll: float = 0.1):
    """Poll `check()` until it returns something truthy; that value."""
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


def disk(fleet: Fleet, node_id: str) -> dict | None:
    path = fleet.node_dir(node_id) / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def node_state(world: World, node_id: str) -> str:
    return world.sql("SELECT state FROM nodes WHERE id = %s", (node_id,))[0][0]


def live_tls_roles(world: World, node_id: str) -> set[str]:
    """The roles of the node's TLS certificates that are current and not revoked."""
    return {role for (role,) in world.sql(
        "SELECT c.role FROM node_certs c LEFT JOIN revocations r USING (serial)"
        " WHERE c.node_id = %s AND c.usage = 'tls' AND r.serial IS NULL AND now() < c.not_after", (node_id,))}


def quota_used(world: World) -> int:
    usage = world.root.admin("GetQuotaUsage", apb.GetQuotaUsageRequest(tenant_id=world.tenant))
    return sum(line.used for line in usage.lines if line.resource == "gpu")


def events_of(world: World, rid: str, type_: str) -> list[dict]:
    return [d for (d,) in world.sql("SELECT data FROM events WHERE subject = %s AND type = %s ORDER BY id",
                                    (f"reservation/{rid}", type_))]


def renew_claiming_the_node_role(stack: Stack, fleet: Fleet, node_id: str,  # noqa: F811
                                 identity: Identity | None = None) -> str:
    """Renew over mutual TLS with the node's own identity (or `identity`, keys copied from it),
    with CSRs whose subject claims the platform role (OU=node): the role of the certificate the
    gateway answers with."""
    identity = identity or IdentityStore(fleet.node_dir(node_id)).load()
    assert identity is not None
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "node"),
                         x509.NameAttribute(NameOID.COMMON_NAME, node_id)])
    sign_key, tls_key = ed25519.Ed25519PrivateKey.generate(), ec.generate_private_key(ec.SECP256R1())
    csrs = b"".join(x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, algorithm)
                    .public_bytes(serialization.Encoding.PEM)
                    for key, algorithm in ((sign_key, None), (tls_key, hashes.SHA256())))
    credentials = grpc.ssl_channel_credentials(stack.ca.read_bytes(), identity.tls_key_pem, identity.tls_cert_pem)
    with grpc.secure_channel(stack.session, credentials) as channel:
        answer = node_pb2_grpc.NodeGatewayStub(channel).Renew(node_pb2.RenewRequest(csr_pem=csrs), timeout=30)
    roles = {c.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value
             for c in x509.load_pem_x509_certificates(answer.certificate_pem)}
    assert len(roles) == 1
    return roles.pop()


def test_a_node_lease_deploys_its_profile_then_the_wiped_node_returns_to_the_platform(
        stack: Stack, world: World, fleets) -> None:  # noqa: F811
    profile_id = register(world.root, 1, 2)
    fleet = fleets(2, *FAST)
    r = lease(world, profile_id)  # no version: the newest, pinned now
    assert r.state == "placed" and r.request.node.profile_version == 2
    [alloc] = r.allocations
    node_id = alloc.node_id
    gpus = sorted(g for (g,) in world.sql("SELECT device_uuid FROM atoms WHERE node_id = %s AND kind = 'gpu'",
                                          (node_id,)))
    assert sorted(alloc.device_ids) == gpus  # the whole machine: every GPU ...
    booked = world.sql("SELECT count(*) FROM bookings WHERE allocation_id = %s", (alloc.id,))[0][0]
    assert booked == world.sql("SELECT count(*) FROM atoms WHERE node_id = %s AND bookable", (node_id,))[0][0] == 8

    active = eventually(world, r.id, lambda x: x.state == "active")
    assert active.allocations[0].state == "bound" and active.binding.node_id == node_id
    assert not active.binding.attested and not active.binding.cdi_devices  # bound by metal, not a report
    image = f"registry.example.com/metal/{profile_id}:2"
    on_disk = disk(fleet, node_id)
    assert on_disk == {"allocation_id": alloc.id, "profile_id": profile_id, "version": 2, "image": image,
                       "checksum": checksum(image), "state": "deployed", "message": ""}
    assert f"image {image}\n" in (fleet.node_dir(node_id) / IMAGE_FILE).read_text()
    inventory = world.sql("SELECT inventory->'deployed' FROM nodes WHERE id = %s", (node_id,))[0][0]
    assert inventory["state"] == "deployed" and inventory["checksum"] == checksum(image)
    assert not list((fleet.node_dir(node_id) / "etc/cdi").glob(f"*{alloc.id}*"))  # no hold: a machine
    assert node_state(world, node_id) == "leased"
    assert [e["deadline"] for e in events_of(world, r.id, "reservation.binding")]

    # Nothing else is placed on a leased machine; the pool's timeline counts it booked, not gone.
    hold = world.create(count=1)
    assert hold.state == "placed" and hold.allocations[0].node_id != node_id
    with grpc.insecure_channel(stack.endpoint) as channel:
        timeline = capacity_pb2_grpc.CapacityStub(channel).Timeline(cpb.TimelineRequest(
            tenant_id=world.tenant, pool_id=world.pool_id), metadata=world.user.metadata, timeout=30)
    assert timeline.allocatable == 16 and (timeline.buckets[0].booked, timeline.buckets[0].free) == (9, 7)

    # While leased its certificates carry node-tenant (the node renewed on the hint, and its
    # platform certificates were revoked); a renewal claiming the platform role still gets node-tenant.
    until(lambda: live_tls_roles(world, node_id) == {"node-tenant"})
    assert renew_claiming_the_node_role(stack, fleet, node_id) == "node-tenant"
    copied = IdentityStore(fleet.node_dir(node_id)).load()  # what a tenant with root can take along
    assert copied is not None and copied.node_id == node_id
    with pytest.raises(grpc.RpcError) as cordon:
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node_id, state="cordoned"))
    assert cordon.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # The lease ends: the assignment leaves, the node wipes, metal returns it to the platform with
    # every certificate revoked (all of them were on the machine while the tenant had root).
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    until(lambda: (disk(fleet, node_id) or {}).get("state") == "wiped")
    assert not (fleet.node_dir(node_id) / IMAGE_FILE).exists()
    until(lambda: node_state(world, node_id) == "ready")
    assert live_tls_roles(world, node_id) == set()
    # The keys the tenant copied renew into nothing, platform role or any other.
    with pytest.raises(grpc.RpcError) as stolen:
        renew_claiming_the_node_role(stack, fleet, node_id, copied)
    assert stolen.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The operator re-provisions a join token to the re-imaged machine; the node enrols again, in
    # the platform role.
    name = fleet.node_dir(node_id).name
    token = nodes_pb2_grpc.NodeAdminStub(world.root.channel).CreateJoinToken(
        npb.CreateJoinTokenRequest(pool_id=world.pool_id, node_name=name), metadata=world.root.metadata, timeout=30)
    (fleet.node_dir(node_id) / REPROVISIONED_TOKEN).write_text(token.secret)
    until(lambda: live_tls_roles(world, node_id) == {"node"})
    # Spent: the node deletes it once it has stored the certificates the enrolment committed.
    until(lambda: not (fleet.node_dir(node_id) / REPROVISIONED_TOKEN).exists())
    wiped = world.sql("SELECT state, wiped_at IS NOT NULL FROM metal_deploys WHERE allocation_id = %s", (alloc.id,))
    assert wiped == [("ended", True)]
    assert quota_used(world) == 1  # the hold's; the lease's 8 were refunded

    # A platform node again: leasable for the next tenant.
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=hold.id))
    again = lease(world, profile_id, 1)
    assert again.state == "placed" and again.request.node.profile_version == 1
    eventually(world, again.id, lambda x: x.state == "active")
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=again.id))


def test_a_pending_node_lease_takes_a_machine_once_one_joins(world: World, fleets) -> None:
    """Pending (no platform node yet), it is retried like any pending reservation when capacity
    appears, and places on the whole machine."""
    profile_id = register(world.root, 1)
    r = lease(world, profile_id)
    assert r.state == "pending" and r.conditions[0].message == "the pool has no nodes"
    fleets(1, *FAST)
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert len(active.allocations) == 1 and len(active.allocations[0].device_ids) == 8
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))


def test_a_failed_reimage_fails_the_reservation_with_no_second_placement(world: World, fleets) -> None:
    profile_id = register(world.root, 1)
    fleet = fleets(2, *FAST, "--reimage-fail-rate", "1")
    r = lease(world, profile_id)
    failed = eventually(world, r.id, lambda x: x.state == "failed")
    assert failed.operation.state == "failed"
    [alloc] = failed.allocations  # never placed again, though the other machine is free
    assert alloc.state == "failed"
    [event] = events_of(world, r.id, "reservation.failed")
    assert event["reason"].startswith("deploy-failed: injected fault")
    assert world.sql("SELECT end_reason FROM reservations WHERE id = %s", (r.id,))[0][0].startswith("deploy-failed")
    assert quota_used(world) == 0
    # The failed machine is wiped and back.
    until(lambda: (disk(fleet, alloc.node_id) or {}).get("state") == "wiped")
    until(lambda: node_state(world, alloc.node_id) == "ready")


def test_a_node_reporting_a_wrong_checksum_never_binds_and_fails_the_lease(world: World, fleets) -> None:
    profile_id = register(world.root, 1)
    fleets(1, *FAST, "--metal-lie", "bad-checksum")
    r = lease(world, profile_id)
    failed = eventually(world, r.id, lambda x: x.state == "failed")
    assert failed.allocations[0].state == "failed"
    assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s AND state = 'bound'",
                     (r.id,))[0][0] == 0
    assert events_of(world, r.id, "reservation.failed")[0]["reason"].startswith("deploy-checksum-mismatch")
    assert events_of(world, r.id, "reservation.binding-rejected")[0]["reason"].startswith("deploy-checksum-mismatch")
    assert quota_used(world) == 0


def test_a_node_reporting_a_profile_it_was_not_asked_for_never_binds(world: World, fleets) -> None:
    profile_id = register(world.root, 1)
    fleets(1, *FAST, "--metal-lie", "unasked")
    r = lease(world, profile_id)
    [rejected] = until(lambda: events_of(world, r.id, "reservation.binding-rejected"))
    assert rejected["reason"].startswith("deployed profile not asked for: rogue v1")
    now = eventually(world, r.id, lambda x: True)
    assert now.state == "binding" and now.allocations[0].state == "binding"  # waits for its deadline
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))


# -- the deadline --------------------------------------------------------------------------------


def send_signed_bound(stack: Stack, fleet: Fleet, node_id: str, allocation_id: str) -> node_pb2.ReportAck:  # noqa: F811
    """The node's genuine signature over AllocationBound for `allocation_id`, sent on a session of
    its own (which takes over from nodesim's until it reconnects); the gateway's ack."""
    identity = IdentityStore(fleet.node_dir(node_id)).load()
    assert identity is not None
    report = node_pb2.Report(node_id=node_id, sequence=10**12, time=int(time.time() * 1000),
                             bound=node_pb2.AllocationBound(allocation_id=allocation_id,
                                                            cdi_devices=["bcd.dev/gpu=GPU-forged"]))
    body = report.SerializeToString()
    message = node_pb2.NodeMessage(report=node_pb2.AttestedReport(
        body=body, key_id=identity.key_id, signature=identity.sign(body)))
    done = threading.Event()

    def requests():
        yield message
        done.wait(30)

    credentials = grpc.ssl_channel_credentials(stack.ca.read_bytes(), identity.tls_key_pem, identity.tls_cert_pem)
    with grpc.secure_channel(stack.session, credentials) as channel:
        call = node_pb2_grpc.NodeGatewayStub(channel).Session(requests(), timeout=30)
        try:
            for answer in call:
                if answer.WhichOneof("msg") == "report_ack":
                    return answer.report_ack
        finally:
            done.set()
            call.cancel()
    raise AssertionError("no ack")


def test_a_node_signed_bind_report_never_binds_a_node_lease(stack: Stack, world: World, fleets) -> None:  # noqa: F811
    """Node leases are exempt from attested bindings: metal binds them after verifying the deploy,
    and even the node's genuinely signed AllocationBound about its lease never counts."""
    profile_id = register(world.root, 1)
    fleet = fleets(1, *FAST)
    r = lease(world, profile_id)
    active = eventually(world, r.id, lambda x: x.state == "active")
    alloc = active.allocations[0]
    until(lambda: live_tls_roles(world, alloc.node_id) == {"node-tenant"})  # signs with its current key
    ack = send_signed_bound(stack, fleet, alloc.node_id, alloc.id)
    assert ack.outcome == node_pb2.REPORT_STORED
    [rejected] = until(lambda: events_of(world, r.id, "reservation.binding-rejected"))
    assert rejected["reason"] == reports.NODE_LEASE and rejected["allocationId"] == alloc.id
    after = eventually(world, r.id, lambda x: True)
    assert after.state == "active" and not after.binding.cdi_devices  # what the report said: ignored
    assert not [c for c in after.conditions if c.type == "Degraded"]
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))


def own_stack(pg_uri: str, tmp: pathlib.Path, env: dict[str, str]) -> Iterator[Stack]:
    """A control plane and gateway of their own, on a database of their own, with `env`."""
    conninfo = clone_database(pg_uri)
    root_token = bootstrap.ensure_root(conninfo)
    cp, endpoint = devstack.controlplane(conninfo, tmp / "controlplane.log", env=env)
    try:
        gw, session, enrol = devstack.gateway(conninfo, tmp / "gateway.log", tmp / "ca.pem")
    except Exception:
        cp.stop()
        raise
    root = Client(endpoint, root_token)
    try:
        yield Stack(conninfo, endpoint, session, enrol, tmp / "ca.pem", root, tmp)
    finally:
        root.close()
        gw.stop()
        cp.stop()


def metal_world(stack_: Stack) -> World:
    w = make_world(stack_.endpoint, stack_.root, stack_.conninfo, nodes=0)
    w.pool_id = stack_.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=w.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(tenant_root=True))).id
    return w


@pytest.fixture(scope="module")
def short_deadline(pg_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Deploys have 3 seconds (BC_METAL_DEPLOY_TIMEOUT_SECONDS)."""
    yield from own_stack(pg_uri, tmp_path_factory.mktemp("metal-deadline"), {"BC_METAL_DEPLOY_TIMEOUT_SECONDS": "3"})


@pytest.fixture
def clock_stack(pg_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Clock control on a database of its own: moving the clock wakes only this test's items."""
    yield from own_stack(pg_uri, tmp_path_factory.mktemp("metal-clock"), {"BC_CLOCK_CONTROL": "1"})


def test_a_deploy_past_its_deadline_fails_the_reservation_and_refunds(short_deadline: Stack) -> None:
    stack_ = short_deadline
    w = metal_world(stack_)
    fleet = Fleet(stack_, w, 2)
    fleet.start("--reimage-seconds", "600")  # never done in time
    try:
        profile_id = register(w.root, 1, profile_id=f"slow-{uuid.uuid4().hex[:6]}")
        r = lease(w, profile_id)
        failed = eventually(w, r.id, lambda x: x.state == "failed")
        [alloc] = failed.allocations
        assert alloc.state == "failed"
        assert events_of(w, r.id, "reservation.failed")[0]["reason"] == "deploy-timeout"
        assert quota_used(w) == 0
        # The node stops the reimage and wipes the machine when the assignment leaves.
        until(lambda: (disk(fleet, alloc.node_id) or {}).get("state") == "wiped")
    finally:
        fleet.stop()
        w.close()


def test_a_node_that_never_heard_of_the_deploy_returns_to_the_platform_after_the_deadline(
        short_deadline: Stack) -> None:
    """Unreachable for the deploy (it takes desired states but never acts on them): the lease fails
    at its deadline, and since the node never reported the deploy, the tenant never had the
    machine: no wipe is waited for, the node is ready and leasable again."""
    w = metal_world(short_deadline)
    fleet = Fleet(short_deadline, w, 1)
    fleet.start("--never-answer")
    try:
        profile_id = register(w.root, 1, profile_id=f"deaf-{uuid.uuid4().hex[:6]}")
        r = lease(w, profile_id)
        node_id = r.allocations[0].node_id
        eventually(w, r.id, lambda x: x.state == "failed")
        assert events_of(w, r.id, "reservation.failed")[0]["reason"] == "deploy-timeout"
        until(lambda: node_state(w, node_id) == "ready")
        assert disk(fleet, node_id) is None  # nothing was ever written
        until(lambda: live_tls_roles(w, node_id) == {"node"})
    finally:
        fleet.stop()
        w.close()


# -- BookingRepair (spec 004: a node lease is judged by whether its node is still leasable, and
# only before its window begins) ----------------------------------------------------------------


def test_booking_repair_moves_a_node_lease_off_a_node_no_longer_leasable_before_its_window(
        clock_stack: Stack) -> None:
    w = metal_world(clock_stack)
    fleet = Fleet(clock_stack, w, 2)
    fleet.start(*FAST)
    try:
        profile_id = register(w.root, 1, profile_id=f"cal-{uuid.uuid4().hex[:6]}")
        start = w.later(hours=1)
        r = lease(w, profile_id, start=start)
        assert r.state == "placed"
        first = r.allocations[0].node_id
        w.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=first, state="cordoned"))
        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=start - clock_now(w) - 10 * 60_000))
        [repaired] = until(lambda: events_of(w, r.id, "reservation.repaired"))
        second = repaired["nodeIds"][0]
        assert repaired["from"] == [first] and second != first
        moved = eventually(w, r.id, lambda x: x.state == "placed")
        assert [(a.node_id, a.state) for a in moved.allocations] == [(first, "released"), (second, "placed")]
        assert (moved.during.start, moved.during.end) == (r.during.start, r.during.end)  # the same window

        # From its start the node is metal's: deployed on the new node, no five-minute bind deadline.
        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=start - clock_now(w) + 1))
        active = eventually(w, r.id, lambda x: x.state == "active")
        assert active.binding.node_id == second and node_state(w, second) == "leased"
        assert node_state(w, first) == "cordoned"
        w.user.res("Release", pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=r.id))
        until(lambda: node_state(w, second) == "ready")  # back in the state it had: ready
    finally:
        fleet.stop()
        w.close()


def test_a_lease_whose_profile_version_vanished_before_its_start_fails_without_touching_the_node(
        clock_stack: Stack) -> None:
    """No Admin RPC removes a version; one removed by hand before the start fails the lease at the
    start (refunded) and the node is never leased."""
    w = metal_world(clock_stack)
    fleet = Fleet(clock_stack, w, 1)
    fleet.start(*FAST)
    try:
        profile_id = register(w.root, 1, profile_id=f"gone-{uuid.uuid4().hex[:6]}")
        start = w.later(hours=1)
        r = lease(w, profile_id, start=start)
        w.sql("DELETE FROM node_profile_versions WHERE profile_id = %s", (profile_id,))
        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=start - clock_now(w) + 1))
        failed = eventually(w, r.id, lambda x: x.state == "failed")
        assert events_of(w, r.id, "reservation.failed")[0]["reason"] == "deploy-profile-missing"
        assert quota_used(w) == 0 and node_state(w, failed.allocations[0].node_id) == "ready"
    finally:
        fleet.stop()
        w.close()


def test_a_node_that_kept_its_platform_keys_through_a_lease_loses_them_after_the_wipe(
        world: World, fleets) -> None:
    """A node that ignores the hint to renew keeps its `node` certificate while a tenant has root
    on the machine: those keys may be the tenant's now. When the machine comes back they are
    revoked, so the node is no longer platform-trusted (never leased again until re-enrolled)."""
    profile_id = register(world.root, 1)
    fleet = fleets(1, *FAST, "--ignore-renew-hints")
    r = lease(world, profile_id)
    node_id = r.allocations[0].node_id
    eventually(world, r.id, lambda x: x.state == "active")
    assert live_tls_roles(world, node_id) == {"node"}  # it never renewed into node-tenant
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    until(lambda: node_state(world, node_id) == "ready")
    assert live_tls_roles(world, node_id) == set()
    reasons = {reason for (reason,) in world.sql(
        "SELECT r.reason FROM revocations r JOIN node_certs c USING (serial) WHERE c.node_id = %s", (node_id,))}
    assert "on the machine while a tenant leased it" in reasons
    again = lease(world, profile_id)
    why = again.conditions[0].message  # its session ends with the revocation: soon not connected either
    assert again.state == "pending" and ("without a platform certificate" in why or "not connected" in why)
    world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=again.id))
