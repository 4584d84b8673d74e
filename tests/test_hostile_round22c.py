"""Hostile review, round 22c: a hostile tenant member, agent and re-admitted member against the
reservation reads (real control plane on loopback, embedded PostgreSQL). The first two tests
reproduced broken promises, fixed since (docs/decisions.md, twenty-third session); the rest keep
what the fixes must not break.

- Reservations.List decides only compute:reservations:list on the tenant: a member the policy
  refuses compute:reservations:read (Get is ACCESS_DENIED) reads every reservation of the tenant
  through scope 'all', request, window and binding included.
- A member removed from the tenant (its reservation passed to a successor) and added again reads
  the successor's reservation by replaying its old idempotency key: the replay answers the stored
  row without any decision, though Get refuses it.
"""

from __future__ import annotations

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import World, outcome, refused




DENIED = (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")


def test_a_member_refused_reading_reservations_cannot_list_them(world: World) -> None:
    """Get decides compute:reservations:read on the reservation; List decides only
    compute:reservations:list on the tenant and returns the rows unchecked, so a listing is
    weaker than reading the items it lists (the pattern fixed for Webhooks.ListDeliveries)."""
    r = world.create(count=1, start=world.later(), duration="1h")
    spy_id, spy = world.identity()
    world.policy("permit(principal, action, resource);\n"
                 f'forbid(principal == Identity::"{spy_id}", action == Action::"compute:reservations:read", '
                 "resource);")
    t = world.tenant
    assert refused(spy.res, "Get", pb.GetReservationRequest(tenant_id=t, reservation_id=r.id))[:2] == DENIED
    listed = outcome(spy.res, "List", pb.ListReservationsRequest(tenant_id=t, scope="all"))
    if isinstance(listed, tuple):  # refused outright: fine
        assert listed[:2] == DENIED, listed
        return
    leaked = [i for i in listed.items if i.id == r.id]
    assert not leaked, (f"a member IAM refuses compute:reservations:read listed {r.id} "
                        f"(owner {leaked[0].owner_identity_id}, nodes {leaked[0].binding}, "
                        f"during {leaked[0].during}) through List scope 'all'")


def test_a_re_added_member_cannot_read_its_successors_reservation_by_replaying_its_key(world: World) -> None:
    """RemoveMembership passes the member's live reservations to the successor (docs/decisions.md
    "Removing a membership": adding it again "gives back none of what moved"). Added again, the
    member's Get of the successor's reservation is refused by the policy, yet a create replaying
    the old key answers the whole reservation (or CONFLICT naming it), with no decision."""
    member_id, member = world.identity()
    successor_id, _ = world.identity()
    t = world.tenant
    req = world.create_request(key="train-1", count=1, start=world.later(), duration="1h")
    r = member.res("Create", req)
    assert r.state == "placed"
    world.root.admin("RemoveMembership", apb.RemoveMembershipRequest(
        identity_id=member_id, tenant_id=t, successor_identity_id=successor_id))
    world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=member_id, kind="user", tenant_ids=[t]))
    # The policy lets the member read only what it owns.
    world.policy("permit(principal, action, resource);\n"
                 f'forbid(principal == Identity::"{member_id}", action == Action::"compute:reservations:read", '
                 f'resource) when {{ resource.ownerIdentityId != "{member_id}" }};')
    assert refused(member.res, "Get", pb.GetReservationRequest(tenant_id=t, reservation_id=r.id))[:2] == DENIED
    replayed = outcome(member.res, "Create", req)
    if isinstance(replayed, tuple):
        code, reason, details = replayed
        assert details.get("reservationId") != r.id or (code, reason) == DENIED, replayed
        return
    assert replayed.id != r.id, (
        f"the re-added member read the successor's reservation {replayed.id} (owner "
        f"{replayed.owner_identity_id}, state {replayed.state}) by replaying its old key")
    # A different request under the old key must not name it either.
    other = world.create_request(key="train-1", count=2, start=world.later(), duration="1h")
    code, reason, details = refused(member.res, "Create", other)
    assert details.get("reservationId") != r.id, (code, reason, details)


def _page_through(client, tenant: str, limit: int, **kw) -> tuple[list[str], list[str]]:
    """Every reservation id a listing pages through, and the cursors it handed out."""
    ids: list[str] = []
    cursors: list[str] = []
    cursor = ""
    while True:
        page = client.res("List", pb.ListReservationsRequest(tenant_id=tenant, limit=limit, cursor=cursor, **kw))
        ids += [i.id for i in page.items]
        if not page.next_cursor:
            return ids, cursors
        cursors.append(page.next_cursor)
        cursor = page.next_cursor


def test_a_listing_leaves_out_what_its_caller_may_not_read_and_still_pages_through_the_rest(world: World) -> None:
    """Rows the policy refuses the caller to read are left out of each page, pages stay full,
    every readable reservation comes exactly once, newest first, and no cursor names one the
    caller may not read (the cursor is the last reservation answered)."""
    reader_id, reader = world.identity()
    other_id, other = world.identity()
    mine, theirs = [], []
    for i in range(5):  # interleaved in time, so every page meets both
        mine.append(world.create(reader, key=f"m{i}", start=world.later(1 + i), duration="1h").id)
        theirs.append(world.create(other, key=f"o{i}", start=world.later(1 + i), duration="1h").id)
    world.policy("permit(principal, action, resource);\n"
                 f'forbid(principal == Identity::"{reader_id}", action == Action::"compute:reservations:read", '
                 f'resource) when {{ resource.ownerIdentityId == "{other_id}" }};')
    ids, cursors = _page_through(reader, world.tenant, 2, scope="all")
    assert set(ids) & set(theirs) == set()
    assert ids == list(reversed(mine)), ids  # newest first, each once
    assert not set(cursors) & set(theirs), cursors
    # The other member, allowed to read everything, still lists all ten.
    assert len(_page_through(other, world.tenant, 3, scope="all")[0]) == 10
    # Scope 'mine' is decided the same way: a member refused reading its own gets none of them.
    world.policy("permit(principal, action, resource);\n"
                 f'forbid(principal == Identity::"{reader_id}", action == Action::"compute:reservations:read", '
                 "resource);")
    assert _page_through(reader, world.tenant, 50)[0] == []


def test_a_listing_that_meets_only_unreadable_rows_stops_at_its_scan_cap_with_a_cursor(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page examines at most LIST_SCAN_CAP reservations: a caller that may read none of a long
    run gets a short (here empty) page and a cursor to go on from, not a scan of the whole tenant
    in one call; paging on reaches the readable ones behind the run."""
    from controlplane.reservations import reads
    monkeypatch.setattr(reads, "LIST_SCAN_CAP", 4)
    reader_id, reader = world.identity()
    other_id, other = world.identity()
    old = world.create(reader, key="old", start=world.later(), duration="1h").id
    for i in range(6):
        world.create(other, key=f"o{i}", start=world.later(), duration="1h")
    world.policy("permit(principal, action, resource);\n"
                 f'forbid(principal == Identity::"{reader_id}", action == Action::"compute:reservations:read", '
                 f'resource) when {{ resource.ownerIdentityId == "{other_id}" }};')
    first = reader.res("List", pb.ListReservationsRequest(tenant_id=world.tenant, scope="all", limit=2))
    assert list(first.items) == [] and first.next_cursor, first
    assert _page_through(reader, world.tenant, 2, scope="all")[0] == [old]


def test_a_re_added_member_allowed_to_read_its_successors_reservation_gets_it_on_replay(world: World) -> None:
    """Where IAM lets the re-added member read the reservation its key made, the replay answers
    it as Get would (owned by the successor now), and another request under the key is CONFLICT
    naming it: the key stays its creator's (it makes no second reservation)."""
    member_id, member = world.identity()
    successor_id, _ = world.identity()
    t = world.tenant
    req = world.create_request(key="train-2", count=1, start=world.later(), duration="1h")
    r = member.res("Create", req)
    world.root.admin("RemoveMembership", apb.RemoveMembershipRequest(
        identity_id=member_id, tenant_id=t, successor_identity_id=successor_id))
    world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=member_id, kind="user", tenant_ids=[t]))
    replayed = member.res("Create", req)
    assert (replayed.id, replayed.owner_identity_id) == (r.id, successor_id)
    other = world.create_request(key="train-2", count=2, start=world.later(), duration="1h")
    code, reason, details = refused(member.res, "Create", other)
    assert (reason, details.get("reservationId")) == ("CONFLICT", r.id), (code, reason, details)
