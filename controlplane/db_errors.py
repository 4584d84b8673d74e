"""Database errors to the spec's errors, by constraint name: the one place that maps them.

A constraint the schema enforces (a foreign key, a unique key, an exclusion) names what the caller
got wrong. Domain code wraps a write in `mapped(...)`, passing the values the details may name;
a violation of a constraint in `BY_CONSTRAINT` becomes its spec error, naming its field. Any other
database error passes through unchanged and answers INTERNAL.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import psycopg

from controlplane import errors

BOOKINGS_NO_OVERLAP = "bookings_no_overlap"
# A draft for an identity offboarded since its call authenticated: the name migration 0013's
# insert trigger raises its check violation under (a trigger's, not a pg_constraint row).
OWNER_OFFBOARDED = "reservations_owner_not_offboarded"
# A draft for an identity removed from the tenant since its call authenticated (migration 0052).
OWNER_NOT_MEMBER = "reservations_owner_still_member"
# The live-drafts cap per identity, held by draft_room in a draft's insert (migration 0046): full,
# or near enough that the insert runs again under the identity's exclusive lock.
DRAFT_ROOM = "reservations_draft_room"
DRAFT_ROOM_NEAR = "reservations_draft_room_near"
# A host booking past what its node can give (the guard of migration 0018).
HOST_BOOKINGS_WITHIN_ALLOCATABLE = "host_bookings_within_allocatable"


class Mapping(NamedTuple):
    error: type[errors.DomainError]
    message: str
    field: str  # the detail the error names; its value comes from `mapped(**values)`


BY_CONSTRAINT: dict[str, Mapping] = {
    "identities_delegator_id_fkey": Mapping(errors.NotFound, "no such person identity", "personIdentityId"),
    "memberships_tenant_id_fkey": Mapping(errors.NotFound, "no such tenant", "tenantIds"),
    "api_tokens_identity_id_fkey": Mapping(errors.NotFound, "no such identity", "identityId"),
    "pools_owner_tenant_id_fkey": Mapping(errors.NotFound, "no such tenant", "tenantId"),
    "pool_offers_pool_id_fkey": Mapping(errors.NotFound, "no such pool", "poolId"),
    "pool_offers_tenant_id_fkey": Mapping(errors.NotFound, "no such tenant", "tenantId"),
    "nodes_pool_id_fkey": Mapping(errors.NotFound, "no such pool", "poolId"),
    "nodes_pool_id_name_key": Mapping(errors.Conflict, "a node with this name exists in the pool", "name"),
    "quotas_tenant_id_fkey": Mapping(errors.NotFound, "no such tenant", "tenantId"),
    "policies_tenant_id_fkey": Mapping(errors.NotFound, "no such tenant", "tenantId"),
    "join_tokens_pool_id_fkey": Mapping(errors.NotFound, "no such pool", "poolId"),
    "provider_accounts_name_key": Mapping(errors.Conflict, "a provider account with this name exists", "name"),
}


def constraint_of(exc: BaseException) -> str | None:
    """The name of the constraint a database error reports, if any."""
    if isinstance(exc, psycopg.Error) and exc.diag is not None:
        return exc.diag.constraint_name
    return None


def violates(exc: BaseException, constraint: str) -> bool:
    """Whether `exc` is a violation of exactly `constraint` (e.g. a lost booking race)."""
    return isinstance(exc, psycopg.errors.IntegrityError) and constraint_of(exc) == constraint


def translate(exc: psycopg.Error, **values: Any) -> errors.DomainError | None:
    """The spec error for a violated constraint in the table, else None (it stays INTERNAL)."""
    if not isinstance(exc, psycopg.errors.IntegrityError):
        return None
    mapping = BY_CONSTRAINT.get(constraint_of(exc) or "")
    if mapping is None:
        return None
    return mapping.error(mapping.message, **{mapping.field: values.get(mapping.field)})


@contextmanager
def mapped(**values: Any) -> Iterator[None]:
    """Raise the spec error of a mapped constraint violated inside; anything else unchanged."""
    try:
        yield
    except psycopg.errors.IntegrityError as exc:
        domain = translate(exc, **values)
        if domain is None:
            raise
        raise domain from None
