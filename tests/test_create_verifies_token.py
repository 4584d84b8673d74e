"""Reservations.Create verifies a token the process has seen before in its first statement (the
facts read) instead of a read of its own before it: one round trip less for the busiest call. Each
way a token stops authenticating, or its identity stops belonging, must still refuse the next
create at once, with the answer any other call gets, and write nothing (real server, real
PostgreSQL)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import auth
from tests.support import Client, World, rpc_error

HOUR = 3_600_000


def _refused(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return rpc_error(exc)


def _rows_of(world: World, identity: str) -> int:
    return world.sql("SELECT count(*) FROM reservations WHERE owner_identity_id = %s", (identity,))[0][0]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The token reads of their own (auth.authenticate_hash) the in-process server makes, counted
    as they pass through to the real function."""
    seen: list[bytes] = []
    real = auth.authenticate_hash

    async def counted(pool: Any, digest: bytes) -> auth.Caller:
        seen.append(digest)
        return await real(pool, digest)

    monkeypatch.setattr(auth, "authenticate_hash", counted)
    return seen


def _digest(client: Client) -> bytes:
    return auth.token_hash(dict(client.metadata)["authorization"].removeprefix("Bearer "))


def test_a_known_token_is_read_once_then_verified_in_the_creates_own_read(world: World, reads: list[bytes]) -> None:
    ident, client = world.identity()
    mine = _digest(client)
    first = world.create(client)
    assert reads.count(mine) == 1  # not known yet: the interceptor read it
    second = world.create(client)
    third = world.create(client, count=2)
    assert reads.count(mine) == 1, "a create with a known token read it again in a statement of its own"
    assert {first.state, second.state, third.state} == {"placed"} and first.id != second.id
    assert {r.owner_identity_id for r in (first, second, third)} == {ident}
    # Other calls still authenticate in their own read.
    client.res("List", pb.ListReservationsRequest(tenant_id=world.tenant))
    assert reads.count(mine) == 2


def test_a_known_token_revoked_since_refuses_the_next_create_whatever_it_asks(world: World,
                                                                            reads: list[bytes]) -> None:
    ident, client = world.identity()
    world.create(client)
    before = _rows_of(world, ident)
    world.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident))
    reads.clear()
    # A good request, a bad one (INVALID_INPUT otherwise), another tenant's (ACCESS_DENIED
    # otherwise) and a retry of the stored key: UNAUTHENTICATED first, as for every call.
    for request in (world.create_request(), world.create_request(count=0),
                    world.create_request(duration="-1h"), pb.CreateReservationRequest(
                        tenant_id="t-someone-else", pool_id=world.pool_id, idempotency_key="k",
                        devices=[pb.DeviceRequest(device_class="gpu", count=1)], duration="1h")):
        code, reason, _ = _refused(lambda: client.res("Create", request))
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"), request
    assert _rows_of(world, ident) == before
    # The two invalid requests were checked against the token in a read of its own before their
    # answer; the good one and the other tenant's were refused by the facts read itself.
    assert reads.count(_digest(client)) == 2


def test_a_known_token_of_an_offboarded_identity_refuses_the_next_create(world: World) -> None:
    ident, client = world.identity()
    world.create(client, start=world.later())
    world.root.admin("OffboardIdentity", apb.OffboardIdentityRequest(identity_id=ident,
                                                                     successor_identity_id=world.user_id))
    code, reason, _ = _refused(lambda: world.create(client))
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert _rows_of(world, ident) == 0  # its one reservation went to the successor


def test_a_known_token_whose_identity_left_the_tenant_is_refused_there_and_writes_nothing(world: World) -> None:
    ident, client = world.identity()
    world.create(client)
    world.root.admin("RemoveMembership", apb.RemoveMembershipRequest(
        identity_id=ident, tenant_id=world.tenant, successor_identity_id=world.user_id))
    code, reason, details = _refused(lambda: world.create(client))
    assert (code, reason, details) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED", {"tenantId": world.tenant})
    assert _rows_of(world, ident) == 0


def test_an_agent_whose_person_left_the_tenant_is_refused_there(world: World) -> None:
    person, _ = world.identity()
    agent, client = world.identity(kind="agent", person_identity_id=person)
    world.create(client)
    world.root.admin("RemoveMembership", apb.RemoveMembershipRequest(
        identity_id=person, tenant_id=world.tenant, successor_identity_id=world.user_id))
    code, reason, _ = _refused(lambda: world.create(client))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")


def test_a_known_token_expired_by_the_product_clock_refuses_the_next_create(clock_world: World) -> None:
    w = clock_world
    ident, _ = w.identity()
    short = w.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="1h"))
    client = Client(w.endpoint, short.secret)
    try:
        w.create(client, start=w.later())
        w.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=HOUR + 1000))
        assert _refused(lambda: w.create(client)) == (
            grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", {"tokenId": short.id})
    finally:
        client.close()


def test_the_known_tokens_are_bounded_and_forget_the_oldest() -> None:
    known = auth.TokenIdentities(entries=2)
    for secret, ident in (("a", "i-a"), ("b", "i-b"), ("c", "i-c")):
        known.remember(auth.token_hash(secret), ident)
    assert known.unverified("a") is None
    assert known.unverified("c") == auth.Unverified(auth.token_hash("c"), "i-c")
    known.forget(auth.token_hash("c"))
    assert known.unverified("c") is None and known.unverified("b") is not None


def test_a_verified_row_naming_another_identity_is_refused_and_forgotten() -> None:
    digest = auth.token_hash("s")
    auth.KNOWN.remember(digest, "i-one")
    unverified = auth.KNOWN.unverified("s")
    assert unverified is not None
    row = {"id": "i-two", "kind": "user", "delegator_id": None, "delegator_kind": None, "confirm_actions": [],
           "token_id": "tok_x", "expires_ms": 0, "expired": False, "tenant_ids": ["t"]}
    with pytest.raises(Exception) as exc:
        auth.verify(unverified, row)
    assert type(exc.value).__name__ == "Unauthenticated"
    assert auth.KNOWN.unverified("s") is None and unverified.caller is None
    assert auth.verify(auth.Unverified(digest, "i-two"), row).identity_id == "i-two"


def test_an_earliest_start_create_verifies_a_known_token_before_it_waits_on_the_index(
        world: World, reads: list[bytes]) -> None:
    """A create asking for the earliest start waits for the capacity index first: a known token is
    read before that wait, so a revoked one is refused without it, and a good one still books."""
    ident, client = world.identity()
    world.create(client)
    mine = _digest(client)
    placed = world.create(client, duration="30m", start_earliest=True)
    assert placed.state == "placed" and reads.count(mine) == 2
    world.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident))
    code, reason, _ = _refused(lambda: world.create(client, duration="30m", start_earliest=True))
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert reads.count(mine) == 3 and _rows_of(world, ident) == 2
