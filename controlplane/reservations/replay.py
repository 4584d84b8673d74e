"""A stored reservation answering a retry of its idempotency key (DESIGN.md section 8, step 2): the
same request gets the stored reservation, another request CONFLICT, a refused one ACCESS_DENIED."""

from __future__ import annotations

from typing import Any

from controlplane import authorize, errors, iam
from controlplane.auth import Caller
from controlplane.reservations import states
from controlplane.reservations.reads import resource_attributes
from controlplane.reservations.validate import CreateInput


def require_replayable(row: dict[str, Any], digest: str) -> None:
    """The stored row answers a retry of the same request (`digest`), unless it was refused."""
    if row["request_hash"] != digest:
        raise errors.Conflict("this idempotency key was used with another request", reservationId=row["id"])
    if row["state"] == states.DENIED:
        raise errors.AccessDenied("this request was refused", reservationId=row["id"])


def require_foreign_readable(policy: str | None, caller: Caller, row: dict[str, Any], inp: CreateInput,
                             digest: str) -> None:
    """The key's reservation was handed to a successor when its creator left the tenant (drafts
    and confirmations are not handed over, so it is past them). Its creator, added back, gets it
    (or CONFLICT naming it) only as Get would: IAM must let it read the reservation now; refused,
    the answer names neither the reservation nor its state."""
    authorize.check(policy, caller, inp.tenant_id, iam.READ, "Reservation", row["id"], resource_attributes(row),
                    message="this idempotency key's reservation belongs to another member, which IAM "
                            "refuses this caller to read", idempotencyKey=inp.idempotency_key)
    require_replayable(row, digest)
