"""Operator creates are safe to retry after a lost answer: CreatePool and CreateToken with an
idempotency key answer the same object (a token under a new secret, the lost one dead), another
request under the key is CONFLICT; CreateTenant again with another name is CONFLICT."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from tests.support import Client, World, refused


def _key() -> str:
    return f"k-{uuid.uuid4().hex[:12]}"


def _pools(world: World) -> list[apb.Pool]:
    return list(world.root.admin("ListPools", apb.ListPoolsRequest(owner_tenant_id=world.tenant)).items)


def test_create_pool_retried_with_its_key_answers_the_same_pool(world: World) -> None:
    before = len(_pools(world))
    request = apb.CreatePoolRequest(owner_tenant_id=world.tenant, name="gpu-a", region="eu-1", idempotency_key=_key(),
                                    policy=apb.PoolPolicy(sharing=apb.SharingPolicy(mode="time-slicing")))
    first = world.root.admin("CreatePool", request)
    again = world.root.admin("CreatePool", request)
    assert again == first
    assert len(_pools(world)) == before + 1
    # The same request spelled with the alias and defaults filled is the same request.
    request.policy.sharing.mode = "time-slice"
    assert world.root.admin("CreatePool", request).id == first.id


def test_concurrent_retries_of_a_keyed_create_pool_make_one_pool(world: World) -> None:
    before = len(_pools(world))
    request = apb.CreatePoolRequest(owner_tenant_id=world.tenant, name="gpu-c", idempotency_key=_key())
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: world.root.admin("CreatePool", request), range(4)))
    assert len({a.id for a in answers}) == 1
    assert len(_pools(world)) == before + 1


def test_create_pool_with_a_used_key_and_another_request_is_conflict(world: World) -> None:
    key = _key()
    first = world.root.admin("CreatePool", apb.CreatePoolRequest(owner_tenant_id=world.tenant, name="gpu-a",
                                                                 idempotency_key=key))
    code, reason, details = refused(world.root.admin, "CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="gpu-b", idempotency_key=key))
    assert (code, reason) == (grpc.StatusCode.ABORTED, "CONFLICT")
    assert details["poolId"] == first.id
    assert [p.name for p in _pools(world)].count("gpu-b") == 0


def test_create_pool_without_a_key_still_creates_each_time(world: World) -> None:
    request = apb.CreatePoolRequest(owner_tenant_id=world.tenant, name="gpu-a")
    assert world.root.admin("CreatePool", request).id != world.root.admin("CreatePool", request).id


def _list(client: Client, tenant: str) -> pb.ListReservationsResponse:
    return client.res("List", pb.ListReservationsRequest(tenant_id=tenant))


def _live_tokens(world: World) -> list[apb.Token]:
    return list(world.root.admin("ListTokens", apb.ListTokensRequest(identity_id=world.user_id)).items)


def test_create_token_retried_with_its_key_leaves_one_live_secret(world: World) -> None:
    before = len(_live_tokens(world))
    request = apb.CreateTokenRequest(identity_id=world.user_id, ttl="8h", idempotency_key=_key())
    lost = world.root.admin("CreateToken", request)
    _list(Client(world.endpoint, lost.secret), world.tenant)
    again = world.root.admin("CreateToken", request)
    # The same token (id, expiry) under a new secret; the secret of the lost answer is dead.
    assert (again.id, again.expires_at, again.created_at) == (lost.id, lost.expires_at, lost.created_at)
    assert again.secret and again.secret != lost.secret and again.secret.startswith(again.prefix)
    code, reason, _ = refused(_list, Client(world.endpoint, lost.secret), world.tenant)
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    _list(Client(world.endpoint, again.secret), world.tenant)
    assert len(_live_tokens(world)) == before + 1
    # "480m" is the same lifetime as "8h": the same request.
    request.ttl = "480m"
    assert world.root.admin("CreateToken", request).id == lost.id


def test_create_token_with_a_used_key_and_another_request_is_conflict(world: World) -> None:
    key = _key()
    first = world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=world.user_id, idempotency_key=key))
    code, reason, details = refused(world.root.admin, "CreateToken", apb.CreateTokenRequest(
        identity_id=world.user_id, ttl="1h", idempotency_key=key))
    assert (code, reason) == (grpc.StatusCode.ABORTED, "CONFLICT")
    assert details["tokenId"] == first.id
    _list(Client(world.endpoint, first.secret), world.tenant)  # the first secret still works


def test_create_token_retried_after_its_revocation_answers_it_without_a_secret(world: World) -> None:
    request = apb.CreateTokenRequest(identity_id=world.user_id, idempotency_key=_key())
    first = world.root.admin("CreateToken", request)
    world.root.admin("RevokeTokens", apb.RevokeTokensRequest(token_id=first.id))
    again = world.root.admin("CreateToken", request)
    assert (again.id, again.secret) == (first.id, "") and again.revoked_at > 0
    code, _, _ = refused(_list, Client(world.endpoint, first.secret), world.tenant)
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_create_tenant_again_answers_it_and_with_another_name_is_conflict(world: World) -> None:
    tenant = f"t{uuid.uuid4().hex[:10]}"
    first = world.root.admin("CreateTenant", apb.CreateTenantRequest(id=tenant, name="Acme"))
    assert world.root.admin("CreateTenant", apb.CreateTenantRequest(id=tenant, name="Acme")) == first
    code, reason, details = refused(world.root.admin, "CreateTenant", apb.CreateTenantRequest(id=tenant, name="Other"))
    assert (code, reason) == (grpc.StatusCode.ABORTED, "CONFLICT")
    assert details["tenantId"] == tenant


def test_create_identity_again_answers_it_and_with_another_name_or_delegation_is_conflict(world: World) -> None:
    person = f"p-{uuid.uuid4().hex[:10]}"
    request = apb.CreateIdentityRequest(id=person, kind="user", name="Ada", tenant_ids=[world.tenant])
    first = world.root.admin("CreateIdentity", request)
    assert world.root.admin("CreateIdentity", request) == first
    code, reason, details = refused(world.root.admin, "CreateIdentity", apb.CreateIdentityRequest(
        id=person, kind="user", name="Bob", tenant_ids=[world.tenant]))
    assert (code, reason, details["identityId"]) == (grpc.StatusCode.ABORTED, "CONFLICT", person)
    agent = f"a-{uuid.uuid4().hex[:10]}"
    request = apb.CreateIdentityRequest(id=agent, kind="agent", name=agent, tenant_ids=[world.tenant],
                                        delegation=apb.Delegation(person_identity_id=person))
    assert world.root.admin("CreateIdentity", request) == world.root.admin("CreateIdentity", request)
    for change in ({"person_identity_id": world.user_id}, {"confirm_actions": ["compute:reservations:create"]}):
        other = apb.CreateIdentityRequest()
        other.CopyFrom(request)
        other.delegation.CopyFrom(apb.Delegation(**{"person_identity_id": person, **change}))
        code, reason, details = refused(world.root.admin, "CreateIdentity", other)
        assert (code, reason, details["identityId"]) == (grpc.StatusCode.ABORTED, "CONFLICT", agent)
    # Again with only the id, kind and tenants (no name): the identity, with the membership added.
    guest = f"t{uuid.uuid4().hex[:10]}"
    world.root.admin("CreateTenant", apb.CreateTenantRequest(id=guest))
    again = world.root.admin("CreateIdentity", apb.CreateIdentityRequest(id=person, kind="user", tenant_ids=[guest]))
    assert again.name == "Ada" and sorted(again.tenant_ids) == sorted([world.tenant, guest])
