"""Hostile review, round 22: a tenant member the policy refuses, a client that hides a node
selector inside a map entry, and a node re-reporting a binding. Each test reproduces a broken
promise on the current code (real control plane on loopback, embedded PostgreSQL, real node keys
and certificates from the control-plane CA).

- Extend answers before IAM decides anything: a member the tenant's policy refuses every action
  (Get, List, Renew, Cancel, Release all ACCESS_DENIED) reads another member's whole reservation
  through Extend with an `until` it already reaches, and its state or start through Extend's
  refusals (DESIGN.md section 7: within a tenant, IAM decides who sees what).
- An unknown field inside a `nodeSelector` map entry makes the parser keep the whole entry as an
  unknown field of the request under the map's own (known) field number: the unknown-field check
  does not see it, and the selector entry is silently dropped. The create is placed on any node
  instead of INVALID_INPUT (spec: "Unknown fields are INVALID_INPUT"; DESIGN.md section 6:
  "unknown protobuf fields are detected, not silently dropped").
- A node's bound re-report of an active allocation replaces the binding `get` answers (its env
  file) without bumping the reservation's version (DESIGN.md section 10: "Every write bumps
  `version`").
"""

from __future__ import annotations

import time

import grpc
import pytest

from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import Client, World, eventually, get, outcome, refused, rpc_error
from tests.test_pki import Enrolled
from tests.test_hostile_surface import node, node_world  # noqa: F401 (fixtures)
from tests.test_reports import report

HOUR = 3_600_000


# An identity the tenant's policy refuses every action ----------------------------------------


def _refused_member(world: World) -> tuple[str, Client]:
    spy_id, spy = world.identity()
    world.policy("permit(principal, action, resource);\n"
                 f'forbid(principal == Identity::"{spy_id}", action, resource);')
    return spy_id, spy



def test_a_member_iam_refuses_cannot_read_a_reservation_through_an_extend_it_already_reaches(
        world: World) -> None:
    r = world.create(count=1, start=world.later(), duration="1h")
    _, spy = _refused_member(world)
    t = world.tenant
    # The policy holds everywhere else: the reservation is the spy's to read nowhere.
    for method, request in (
        ("Get", pb.GetReservationRequest(tenant_id=t, reservation_id=r.id)),
        ("Renew", pb.RenewReservationRequest(tenant_id=t, reservation_id=r.id)),
        ("Cancel", pb.CancelReservationRequest(tenant_id=t, reservation_id=r.id)),
        ("Release", pb.ReleaseReservationRequest(tenant_id=t, reservation_id=r.id)),
    ):
        assert refused(spy.res, method, request)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED"), method
    # An `until` the reservation already reaches: answered with the whole reservation (request,
    # window, owner, allocations and their devices), no decision taken at all.
    extend = pb.ExtendReservationRequest(tenant_id=t, reservation_id=r.id, until=1, idempotency_key="peek")
    answer = outcome(spy.res, "Extend", extend)
    if not isinstance(answer, tuple):
        pytest.fail(f"a member IAM refuses read the reservation through Extend: owner "
                    f"{answer.reservation.owner_identity_id}, devices "
                    f"{list(answer.reservation.allocations[0].device_ids)}, window {answer.reservation.during}")
    assert answer[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    # A member the policy lets read it gets the answer, still without an extend decision.
    _, reader = world.identity()
    seen = reader.res("Extend", pb.ExtendReservationRequest(tenant_id=t, reservation_id=r.id, until=1,
                                                            idempotency_key="peek"))
    assert not seen.extended and seen.reservation.id == r.id
    # Nothing changed.
    assert get(world, r.id).during.end == r.during.end


@pytest.mark.parametrize("how", ["released", "too-long"])
def test_a_member_iam_refuses_learns_nothing_of_a_reservation_from_extends_refusals(world: World, how: str) -> None:
    """Renew, Cancel and Release decide before they look at the state; Extend tells the refused
    member the state (released) or the start (maxUntil = start + the longest length) first."""
    r = world.create(count=1, start=world.later(), duration="1h")
    _, spy = _refused_member(world)
    t = world.tenant
    if how == "released":
        world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=t, reservation_id=r.id))
        change = {"by": "1h"}
    else:
        change = {"until": r.during.start + 400 * 24 * HOUR}
    code, reason, details = refused(spy.res, "Extend", pb.ExtendReservationRequest(
        tenant_id=t, reservation_id=r.id, idempotency_key="peek", **change))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED"), details
    assert "state" not in details and "maxUntil" not in details, details


# A node selector entry hiding an unknown field -----------------------------------------------


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out += bytes([low | 0x80])
        else:
            return out + bytes([low])


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited field."""
    return _varint((number << 3) | 2) + _varint(len(data)) + data


# nodeSelector is field 11 of CreateReservationRequest; a map entry is {1: key, 2: value}.
SELECTOR_ENTRIES = {
    "unknown-field": (_field(11, _field(1, b"rack") + _field(2, b"r7") + _field(3, b"junk")), "nodeSelector[]#3"),
    # the value as a varint (wire type 0) instead of a string: unknown to the entry as well
    "value-as-varint": (_field(11, _field(1, b"rack") + _varint(2 << 3) + _varint(7)), "nodeSelector[]#2"),
}


@pytest.mark.parametrize("entry", sorted(SELECTOR_ENTRIES))
@pytest.mark.parametrize("method", ["/bettercompute.v1.Reservations/Create", "/bettercompute.v1.Capacity/Preview"])
def test_a_node_selector_entry_with_an_unknown_field_is_invalid_input_not_dropped(
        world: World, method: str, entry: str) -> None:
    """No node of the pool carries rack=r7: with the selector the create would be pending. The
    entry with an unknown field must be refused, never read as a request without the selector."""
    key = f"hidden-selector-{method.rsplit('/', 1)[1].lower()}-{entry}"
    wire, path = SELECTOR_ENTRIES[entry]
    payload = world.create_request(key=key, count=1).SerializeToString() + wire
    answer_type = pb.Reservation if method.endswith("Create") else cpb.PreviewResponse
    call = world.user.channel.unary_unary(method, response_deserializer=answer_type.FromString)
    with pytest.raises(grpc.RpcError) as exc:
        placed = call(payload, metadata=world.user.metadata, timeout=30)
        pytest.fail(f"accepted without its node selector: {str(placed)[:400]}")
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT"), details
    assert details["field"] == path, details
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s AND idempotency_key = %s",
                     (world.tenant, key))[0][0] == 0


# A node re-reporting a binding ---------------------------------------------------------------


def test_a_bound_re_report_that_changes_the_binding_bumps_the_version(node_world: World, node: Enrolled) -> None:
    world = node_world
    r = world.create(count=2, duration="8h")
    alloc = eventually(world, r.id, lambda x: x.state == "binding").allocations[0].id
    report(node, world, alloc, "bound", env_file="/run/bcd/allocations/first.env")
    active = eventually(world, r.id, lambda x: x.state == "active")
    assert active.binding.env_file == "/run/bcd/allocations/first.env"
    # The node binds again (a daemon restart) and says so: the binding get answers changes.
    report(node, world, alloc, "bound", env_file=f"/run/bcd/allocations/{alloc}.env")
    changed = eventually(world, r.id, lambda x: x.binding.env_file.endswith(f"{alloc}.env"))
    assert changed.state == "active"
    assert changed.version > active.version, (
        f"the binding changed ({active.binding.env_file} -> {changed.binding.env_file}) "
        f"but the version stayed {changed.version}")
    # The same binding reported once more (a heartbeat's worth of nothing new) is no write.
    report(node, world, alloc, "bound", env_file=f"/run/bcd/allocations/{alloc}.env")
    judged = lambda: world.sql("SELECT count(*) FROM node_reports WHERE allocation_id = %s AND judged_at IS NULL",  # noqa: E731
                               (alloc,))[0][0] == 0
    deadline = time.monotonic() + 30
    while not judged():
        assert time.monotonic() < deadline, "the re-report was never judged"
        time.sleep(0.05)
    [(verdict,)] = world.sql("SELECT verdict FROM node_reports WHERE allocation_id = %s ORDER BY id DESC LIMIT 1",
                             (alloc,))
    assert verdict == "accepted"
    assert get(world, r.id).version == changed.version
