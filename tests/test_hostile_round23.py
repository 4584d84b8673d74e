"""Hostile review, round 23: a member removed from the tenant (or offboarded) and added back,
its agents, and the successor its reservations pass to (real control plane on loopback, embedded
PostgreSQL). The first six tests reproduced the two broken promises below, fixed since (extend
decides on the row's owner and state, REASSIGN_OWNER moves the stored owner too, migration 0060
mends rows moved before; leaving withdraws approved, unused extend confirmations); the last two
keep the stored owner in step:

- **Extend decides on a stale owner after a reassignment.** RemoveMembership and
  OffboardIdentity hand a live reservation to the successor (offboarding.hand_over ->
  reservations/queries.py REASSIGN_OWNER), which updates `reservations.owner_identity_id` but not
  `authz_projection.attributes.ownerIdentityId`. Get, Release, Cancel and Renew decide on the
  reservation row (reads.resource_attributes); Extend decides on the projection
  (extend._stage reads AUTHZ_ATTRIBUTES). Under an owner-only policy the re-added creator, no
  longer the owner and refused everything else, extends the successor's reservation; and the
  successor, the owner now, is refused extending it.
- **An approved, unused extend confirmation survives its person leaving.**
  confirmations.withdraw_of_identities withdraws an approved confirmation only while its
  reservation is `awaiting-confirmation` (a create's), never an extend's. After RemoveMembership
  or OffboardIdentity it stays `approved` and keeps the reservation's one confirmation slot
  (confirmations_open): the successor's own agent, asking to extend the reservation it now owns,
  is CONFLICT `confirmation-open` naming the departed agent's confirmation, for up to 30 minutes.
  And once the person and its agent are added back (CreateIdentity with the tenant), the agent's
  retry is decided on that old approval and extends the successor's reservation, which nobody
  asked (docs/decisions.md: adding back "gives back none of what moved").

Tried and held (not kept as tests, each covered by an existing file or obvious): every numeric
field of Create and Capacity.Preview at int64/int32 extremes, -1 and 0 (INVALID_INPUT naming the
field, or the spec's answer); a re-added creator's Get, List, Renew, Cancel, Release, and Extend
with an `until` already reached or past the longest length, under an owner-only policy
(ACCESS_DENIED, nothing told); an agent approving its own confirmation; an approval by a person the
policy refuses (the retry stays ACCESS_DENIED); an agent refused what its person is refused; what
a guest tenant's create, preview, rollup and extend tell of the owner tenant's bookings (only the
aggregate counts, reasons and availableUntil the spec names).
"""

from __future__ import annotations

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import Client, World, outcome, refused

HOUR = 3_600_000
EXTEND = "compute:reservations:extend"
DENIED = (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")




def _remove(world: World, identity: str, successor: str) -> apb.RemoveMembershipResponse:
    return world.root.admin("RemoveMembership", apb.RemoveMembershipRequest(
        identity_id=identity, tenant_id=world.tenant, successor_identity_id=successor))


def _leave(world: World, identity: str, successor: str, how: str) -> list[str]:
    """`identity` leaves the tenant (RemoveMembership) or the platform (OffboardIdentity), its
    live reservations passed to `successor`; the confirmations withdrawn."""
    if how == "removed":
        return list(_remove(world, identity, successor).withdrawn_confirmation_ids)
    return list(world.root.admin("OffboardIdentity", apb.OffboardIdentityRequest(
        identity_id=identity, successor_identity_id=successor)).withdrawn_confirmation_ids)


def _add_back(world: World, identity: str, person: str = "") -> None:
    req = apb.CreateIdentityRequest(id=identity, kind="agent" if person else "user", tenant_ids=[world.tenant])
    if person:
        req.delegation.CopyFrom(apb.Delegation(person_identity_id=person))
    world.root.admin("CreateIdentity", req)


def _get(client: Client, world: World, rid: str) -> pb.Reservation:
    return client.res("Get", pb.GetReservationRequest(tenant_id=world.tenant, reservation_id=rid))


def _extend(client: Client, world: World, rid: str, key: str, **change):
    return client.res("Extend", pb.ExtendReservationRequest(tenant_id=world.tenant, reservation_id=rid,
                                                            idempotency_key=key, **change))


def _only_own(*identities: str) -> str:
    """Everyone may do anything, except that each of `identities` may touch only reservations it
    owns (a common 'owner only' policy)."""
    rules = "".join(
        f'\nforbid(principal == Identity::"{i}", action, resource) '
        f'when {{ resource has ownerIdentityId && resource.ownerIdentityId != "{i}" }};' for i in identities)
    return "permit(principal, action, resource);" + rules


# -- The authorization row keeps the creator as owner after a reassignment -----------------------


def test_a_re_added_creator_cannot_extend_its_successors_reservation_under_an_owner_only_policy(
        world: World) -> None:
    """RemoveMembership (and OffboardIdentity) pass a live reservation to the successor
    (REASSIGN_OWNER) but leave its authorization row (authz_projection.attributes) naming the
    creator as ownerIdentityId. Get, Release, Cancel and Renew decide on the reservation row and
    refuse the re-added creator under an owner-only policy; Extend decides on the stale
    authorization row (extend._stage reads AUTHZ_ATTRIBUTES), so the creator, no longer the owner,
    extends the successor's reservation."""
    member_id, member = world.identity()
    successor_id, successor = world.identity()
    t = world.tenant
    r = member.res("Create", world.create_request(key="job-1", count=1, start=world.later(), duration="1h",
                                                  lease_seconds=3600))
    assert r.state == "placed"
    _remove(world, member_id, successor_id)
    _add_back(world, member_id)
    world.policy(_only_own(member_id))
    moved = _get(successor, world, r.id)
    assert moved.owner_identity_id == successor_id
    # The policy holds on every other call on the reservation.
    for method, request in (
        ("Get", pb.GetReservationRequest(tenant_id=t, reservation_id=r.id)),
        ("Renew", pb.RenewReservationRequest(tenant_id=t, reservation_id=r.id)),
        ("Cancel", pb.CancelReservationRequest(tenant_id=t, reservation_id=r.id)),
        ("Release", pb.ReleaseReservationRequest(tenant_id=t, reservation_id=r.id)),
    ):
        assert refused(member.res, method, request)[:2] == DENIED, method
    got = outcome(_extend, member, world, r.id, "stretch", by="2h")
    after = _get(successor, world, r.id)
    [(seen,)] = world.sql("SELECT attributes->>'ownerIdentityId' FROM authz_projection WHERE reservation_id = %s",
                          (r.id,))
    assert after.during.end == moved.during.end, (
        f"the re-added creator {member_id} extended the successor's reservation {r.id} by "
        f"{(after.during.end - moved.during.end) // HOUR}h (answer {type(got).__name__}); IAM saw "
        f"ownerIdentityId={seen}")
    assert got[:2] == DENIED, got


@pytest.mark.parametrize("how", ["removed", "offboarded"])
def test_a_successor_may_extend_the_reservation_it_was_handed_under_an_owner_only_policy(world: World,
                                                                                         how: str) -> None:
    """The other face of the stale authorization row: the successor, now the owner (Get,
    Renew answer it), is refused extending it under an owner-only policy, because IAM is told the
    reservation's owner is still the member who left."""
    member_id, member = world.identity()
    successor_id, successor = world.identity()
    r = member.res("Create", world.create_request(key="job-2", count=1, start=world.later(), duration="1h",
                                                  lease_seconds=3600))
    _leave(world, member_id, successor_id, how)
    world.policy(_only_own(successor_id))
    assert _get(successor, world, r.id).owner_identity_id == successor_id
    successor.res("Renew", pb.RenewReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    got = outcome(_extend, successor, world, r.id, "mine-now", by="1h")
    assert isinstance(got, pb.ExtendReservationResponse), f"the owner was refused extending its reservation: {got}"
    assert got.extended and got.reservation.during.end == r.during.end + HOUR


# -- An approved extend confirmation outlives the person's membership ----------------------------

POLICY = "permit(principal, action, resource) unless { context.delegated };"


def _approved_extend(world: World) -> tuple[str, Client, pb.Reservation, str]:
    """The world's person, its agent holding extends for confirmation, the person's placed
    reservation, and the agent's extend of it by 1h (key a-1) that the person approved."""
    world.policy(POLICY)
    agent_id, agent = world.identity(kind="agent", person_identity_id=world.user_id, confirm_actions=[EXTEND])
    r = world.create(count=1, duration="1h", start=world.later())
    assert r.state == "placed"
    code, reason, details = refused(_extend, agent, world, r.id, "a-1", by="1h")
    assert reason == "CONFIRMATION_REQUIRED", details
    cid = details["confirmationId"]
    world.user.conf("Approve", pb.DecideConfirmationRequest(tenant_id=world.tenant, confirmation_id=cid))
    return agent_id, agent, r, cid


@pytest.mark.parametrize("how", ["removed", "offboarded"])
def test_the_successors_agent_may_ask_to_extend_a_reservation_whose_leavers_agent_had_an_approval(
        world: World, how: str) -> None:
    """docs/decisions.md "Removing a membership": "open confirmations there are withdrawn". An
    approved extend confirmation not yet used is open (it holds the reservation's one
    confirmation slot, confirmations_open), but confirmations.withdraw_of_identities withdraws an
    approved one only while its reservation is awaiting-confirmation (a create's), never an
    extend's: it stays `approved` after its person and agent left. The reservation, now the
    successor's, is then closed to the successor's own agent for up to 30 minutes: its extend is
    CONFLICT `confirmation-open`, naming the confirmation of the agent that left."""
    agent_id, agent, r, cid = _approved_extend(world)
    successor_id, successor = world.identity()
    _, successor_agent = world.identity(kind="agent", person_identity_id=successor_id, confirm_actions=[EXTEND])
    withdrawn = _leave(world, world.user_id, successor_id, how)
    assert _get(successor, world, r.id).owner_identity_id == successor_id
    state = world.sql("SELECT state FROM confirmations WHERE id = %s", (cid,))[0][0]
    asked = outcome(_extend, successor_agent, world, r.id, "b-1", by="2h")
    assert not isinstance(asked, pb.ExtendReservationResponse), asked
    assert asked[1] == "CONFIRMATION_REQUIRED" and asked[2]["confirmationId"] != cid, (
        f"the successor's agent is refused asking its person about the reservation it now owns: {asked}; "
        f"the departed agent's confirmation {cid} is still {state!r}")
    assert state == "withdrawn" and cid in withdrawn, (state, withdrawn)


def test_an_agent_added_back_cannot_extend_the_successors_reservation_on_an_approval_from_before(
        world: World) -> None:
    """The same approval after the person and its agent are added back (CreateIdentity with the
    tenant; decisions: adding back "gives back none of what moved"): the agent's retry of the
    approved change finds it `approved`, is decided on the person's authority, and extends the
    reservation that now belongs to the successor, which nobody asked."""
    agent_id, agent, r, cid = _approved_extend(world)
    successor_id, successor = world.identity()
    _remove(world, world.user_id, successor_id)
    _add_back(world, world.user_id)
    _add_back(world, agent_id, person=world.user_id)
    before = _get(successor, world, r.id)
    assert before.owner_identity_id == successor_id
    got = outcome(_extend, agent, world, r.id, "a-1", by="1h")
    after = _get(successor, world, r.id)
    assert after.during.end == before.during.end, (
        f"the re-added agent extended the successor's reservation {r.id} on its person's approval {cid} "
        f"given before they left (answer: {got if isinstance(got, tuple) else 'extended=' + str(got.extended)})")


def _stored_owner(world: World, rid: str) -> str:
    return world.sql("SELECT attributes->>'ownerIdentityId' FROM authz_projection WHERE reservation_id = %s",
                     (rid,))[0][0]


@pytest.mark.parametrize("how", ["removed", "offboarded"])
def test_a_reassignment_moves_the_owner_iam_sees_with_the_reservation(world: World, how: str) -> None:
    member_id, member = world.identity()
    successor_id, _ = world.identity()
    r = world.create(member, key="k", start=world.later(), duration="1h")
    assert _stored_owner(world, r.id) == member_id
    _leave(world, member_id, successor_id, how)
    assert _get(world.user, world, r.id).owner_identity_id == successor_id
    assert _stored_owner(world, r.id) == successor_id


def test_migration_0060_mends_the_owner_of_rows_reassigned_before_it(world: World) -> None:
    """Rows moved before REASSIGN_OWNER moved the stored owner: the migration's statement sets it
    to the row's owner, and leaves rows already in step alone."""
    from pathlib import Path

    import controlplane
    member_id, member = world.identity()
    kept = world.create(member, key="kept", start=world.later(), duration="1h")
    stale = world.create(member, key="stale", start=world.later(), duration="1h")
    world.sql("UPDATE authz_projection SET attributes = jsonb_set(attributes, '{ownerIdentityId}', "
              "'\"user-gone\"') WHERE reservation_id = %s", (stale.id,))
    sql = (Path(controlplane.__file__).parent / "migrations" / "0060_reassigned_owner_in_authz.sql").read_text()
    world.sql(sql)
    assert (_stored_owner(world, stale.id), _stored_owner(world, kept.id)) == (member_id, member_id)
