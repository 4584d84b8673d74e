"""The spec's error codes. Once set, a code is never renamed: clients match on it.

Domain code raises `DomainError` subclasses; `controlplane.common.status` maps them to gRPC status
with a `google.rpc.ErrorInfo` whose reason is the code and whose metadata holds the details.
"""

from __future__ import annotations

from typing import Any

INVALID_INPUT = "INVALID_INPUT"
UNSUPPORTED = "UNSUPPORTED"
UNAUTHENTICATED = "UNAUTHENTICATED"
ACCESS_DENIED = "ACCESS_DENIED"
CONFIRMATION_REQUIRED = "CONFIRMATION_REQUIRED"
NOT_FOUND = "NOT_FOUND"
CONFLICT = "CONFLICT"
INVALID_STATE = "INVALID_STATE"
QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
CAPACITY_UNAVAILABLE = "CAPACITY_UNAVAILABLE"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"


class DomainError(Exception):
    """A failure the client can act on: a spec code, a message and the spec's details."""

    code = INTERNAL

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = {k: v for k, v in details.items() if v is not None}


class InvalidInput(DomainError):
    code = INVALID_INPUT

    def __init__(self, field: str, message: str, **details: Any) -> None:
        super().__init__(f"{field}: {message}", field=field, **details)


class Unsupported(DomainError):
    code = UNSUPPORTED


class Unauthenticated(DomainError):
    code = UNAUTHENTICATED


class AccessDenied(DomainError):
    code = ACCESS_DENIED


class ConfirmationRequired(DomainError):
    code = CONFIRMATION_REQUIRED


class NotFound(DomainError):
    code = NOT_FOUND


class Conflict(DomainError):
    code = CONFLICT


class InvalidState(DomainError):
    code = INVALID_STATE


class QuotaExceeded(DomainError):
    code = QUOTA_EXCEEDED


class CapacityUnavailable(DomainError):
    code = CAPACITY_UNAVAILABLE


class Unavailable(DomainError):
    """A fault a retry may cure (the database connection was lost mid-call): nothing was
    committed that a retry of the same call would not converge with."""

    code = UNAVAILABLE
