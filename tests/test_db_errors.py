"""Database errors are mapped by constraint name in one table (controlplane.db_errors): each mapped
constraint, violated through the API, answers its spec error naming its field; the table names only
constraints the migrated schema has; any other violation stays INTERNAL."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import nodes_pb2_grpc
from controlplane import db_errors
from tests.support import World, rpc_error

PERMIT_ALL = "permit(principal, action, resource);"
NO_POOL = "pool_" + "0" * 26  # well formed, never created


def _second_node(world: World) -> None:
    world.root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=world.pool_id, name="twin"))
    world.root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=world.pool_id, name="twin"))


def _join_token_for_no_pool(world: World) -> None:
    nodes_pb2_grpc.NodeAdminStub(world.root.channel).CreateJoinToken(
        npb.CreateJoinTokenRequest(pool_id=NO_POOL, node_name="n"), metadata=world.root.metadata, timeout=30)


def _second_provider_account(world: World) -> None:
    from bettercompute.v1 import providers_pb2 as ppb
    from bettercompute.v1 import providers_pb2_grpc

    world.root.admin("PutPolicy", apb.PutPolicyRequest(tenant_id="root", cedar=PERMIT_ALL))
    accounts = providers_pb2_grpc.ProviderAccountsStub(world.root.channel)
    for external in ("a", "b"):  # two accounts at the provider under one name
        accounts.Create(ppb.CreateProviderAccountRequest(tenant_id="root", name="twin", provider="sim",
                                                         endpoint="127.0.0.1:1", external_account=external),
                        metadata=world.root.metadata, timeout=30)


# constraint -> (call that violates it, spec reason, detail field, its value)
CASES: dict[str, tuple[Callable[[World], object], str, str, str]] = {
    "identities_delegator_id_fkey": (lambda w: w.root.admin("CreateIdentity", apb.CreateIdentityRequest(
        id="agent-x", kind="agent", delegation=apb.Delegation(person_identity_id="nobody"))),
        "NOT_FOUND", "personIdentityId", "nobody"),
    "memberships_tenant_id_fkey": (lambda w: w.root.admin("CreateIdentity", apb.CreateIdentityRequest(
        id="user-x", tenant_ids=["no-such-tenant"])), "NOT_FOUND", "tenantIds", "no-such-tenant"),
    "api_tokens_identity_id_fkey": (lambda w: w.root.admin("CreateToken", apb.CreateTokenRequest(
        identity_id="nobody")), "NOT_FOUND", "identityId", "nobody"),
    "pools_owner_tenant_id_fkey": (lambda w: w.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id="no-such-tenant", name="p")), "NOT_FOUND", "tenantId", "no-such-tenant"),
    "pool_offers_pool_id_fkey": (lambda w: w.root.admin("OfferPool", apb.OfferPoolRequest(
        pool_id=NO_POOL, tenant_id=w.tenant)), "NOT_FOUND", "poolId", NO_POOL),
    "pool_offers_tenant_id_fkey": (lambda w: w.root.admin("OfferPool", apb.OfferPoolRequest(
        pool_id=w.pool_id, tenant_id="no-such-tenant")), "NOT_FOUND", "tenantId", "no-such-tenant"),
    "nodes_pool_id_fkey": (lambda w: w.root.admin("RegisterNode", apb.RegisterNodeRequest(
        pool_id=NO_POOL, name="n")), "NOT_FOUND", "poolId", NO_POOL),
    "nodes_pool_id_name_key": (_second_node, "CONFLICT", "name", "twin"),
    "quotas_tenant_id_fkey": (lambda w: w.root.admin("SetQuota", apb.SetQuotaRequest(
        tenant_id="no-such-tenant", resource="gpu", limit=1)), "NOT_FOUND", "tenantId", "no-such-tenant"),
    "policies_tenant_id_fkey": (lambda w: w.root.admin("PutPolicy", apb.PutPolicyRequest(
        tenant_id="no-such-tenant", cedar=PERMIT_ALL)), "NOT_FOUND", "tenantId", "no-such-tenant"),
    "join_tokens_pool_id_fkey": (_join_token_for_no_pool, "NOT_FOUND", "poolId", NO_POOL),
    "provider_accounts_name_key": (_second_provider_account, "CONFLICT", "name", "twin"),
}


def test_every_mapped_constraint_has_a_case() -> None:
    assert set(CASES) == set(db_errors.BY_CONSTRAINT)


@pytest.mark.parametrize("constraint", sorted(CASES))
def test_a_violated_constraint_answers_its_spec_error(world: World, constraint: str) -> None:
    call, reason, field, value = CASES[constraint]
    with pytest.raises(grpc.RpcError) as exc:
        call(world)
    _, got_reason, details = rpc_error(exc)
    assert (got_reason, details[field]) == (reason, value)
    assert str(exc.value.details()).startswith(db_errors.BY_CONSTRAINT[constraint].message)


def test_the_table_names_only_constraints_of_the_migrated_schema(database: str) -> None:
    with psycopg.connect(database) as conn:
        names = {name for (name,) in conn.execute(
            "SELECT conname FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace"
            " WHERE n.nspname = 'public'")}
    assert set(db_errors.BY_CONSTRAINT) | {db_errors.BOOKINGS_NO_OVERLAP} <= names


def test_an_unmapped_constraint_stays_internal(database: str) -> None:
    """A violation the table does not name passes through unchanged (answered INTERNAL)."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO tenants (id, name) VALUES ('dup', 'dup')")
        with pytest.raises(psycopg.errors.UniqueViolation) as exc:
            with db_errors.mapped(tenantId="dup"):
                conn.execute("INSERT INTO tenants (id, name) VALUES ('dup', 'dup')")
    assert db_errors.constraint_of(exc.value) == "tenants_pkey"
    assert db_errors.translate(exc.value, tenantId="dup") is None
