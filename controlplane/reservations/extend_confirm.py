"""Delegated confirmation of an extend (docs/decisions.md "Delegated confirmation").

An extend is admitted like a create: a delegated agent refused an extend its person holds for
confirmation opens a confirmation of that very change (its hash covers the key, until or by, and
the end it asks for), and the call fails CONFIRMATION_REQUIRED. The agent's retry of the same
change finds the approval and is decided on the person's authority; the approval is used by the
extend it allowed and authorises nothing else. A rejection refuses the change for good; an
approval or a request left past its deadline refuses the first retry after it (reason
`confirmation-expired`), and the next one asks again.

Transaction 1 (extend._stage) reads the agent's confirmation of the change; the decision follows
outside any transaction; transaction 2 (extend._apply), its slot released, calls `held` on a
refusal or `take_approval` before it applies an approved change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from controlplane import confirmations, db, errors, iam
from controlplane.auth import Caller
from controlplane.ids import new_id, request_hash

CONFIRMATION_WINDOW_MS = 30 * 60 * 1000  # as a create's: at most 30 minutes of database time


@dataclass(frozen=True)
class Asked:
    """What transaction 1 found of the agent's confirmation of this change."""

    digest: str
    confirmation_id: str | None = None
    approved: bool = False
    rejected: bool = False
    lapsed: bool = False  # pending or approved, its deadline passed


def digest(key: str, until: int | None, by_ms: int | None, new_end: int) -> str:
    return request_hash({"action": iam.EXTEND, "idempotencyKey": key, "until": until, "byMs": by_ms,
                         "newEnd": new_end})


async def asked(conn: AsyncConnection, caller: Caller, rid: str, change_digest: str) -> Asked:
    found = await confirmations.of_request(conn, rid, iam.EXTEND, caller.identity_id, change_digest)
    if found is None:
        return Asked(change_digest)
    state, past = found["state"], found["past_deadline"]
    return Asked(change_digest, found["id"], approved=state == "approved" and not past,
                 rejected=state == "rejected", lapsed=state in ("pending", "approved") and past)


def decision_before_iam(found: Asked) -> iam.Decision | None:
    """A rejected or lapsed confirmation decides the retry without IAM."""
    if found.rejected:
        return iam.Decision(iam.DENY, ("the person rejected the confirmation",))
    if found.lapsed:
        return iam.Decision(iam.DENY, ("the confirmation expired",))
    return None


def _expired(rid: str, cid: str) -> errors.DomainError:
    return errors.AccessDenied("the person's confirmation of this extension expired before it was retried; "
                               "retry to ask again", reason="confirmation-expired", confirmationId=cid,
                               reservationId=rid)


async def take_approval(conn: AsyncConnection, rid: str, found: Asked) -> errors.DomainError | None:
    """Under transaction 2: the approval this change was decided on is still open and in time (its
    deadline may have passed while IAM decided), else the refusal, the lapsed one expired."""
    open_ = await confirmations.lock_open(conn, rid, iam.EXTEND)
    if open_ is None or open_["id"] != found.confirmation_id or open_["state"] != "approved":
        return errors.AccessDenied("the person's confirmation of this extension was withdrawn",
                                   reason="confirmation-withdrawn", confirmationId=found.confirmation_id,
                                   reservationId=rid)
    if open_["past_deadline"]:
        await confirmations.expire(conn, open_["id"])
        return _expired(rid, open_["id"])
    return None


async def used(conn: AsyncConnection, found: Asked) -> None:
    if found.approved and found.confirmation_id:
        await confirmations.use(conn, found.confirmation_id)


async def held(
    conn: AsyncConnection, caller: Caller, row: dict[str, Any], found: Asked, decision: iam.Decision, new_end: int
) -> errors.DomainError:
    """The refusal of a delegated agent's extend (its slot released, the reservation unchanged):
    CONFIRMATION_REQUIRED naming the open confirmation of this change, opened if none."""
    rid = row["id"]
    open_ = await confirmations.lock_open(conn, rid, iam.EXTEND)  # the slot of the action, locked
    mine = await confirmations.of_request(conn, rid, iam.EXTEND, caller.identity_id, found.digest)
    if mine is not None and mine["state"] == "rejected":  # also one rejected while IAM decided
        return errors.AccessDenied("the person rejected this extension", reason="confirmation-rejected",
                                   confirmationId=mine["id"], reservationId=rid)
    if open_ is not None and open_["past_deadline"]:
        await confirmations.expire(conn, open_["id"])
        if mine is not None and open_["id"] == mine["id"]:
            return _expired(rid, open_["id"])
        open_ = None
    if decision.outcome != iam.CONFIRM:
        return errors.AccessDenied("IAM refused this extension", reservationId=rid)
    if open_ is not None:
        if mine is not None and open_["id"] == mine["id"]:  # pending, or approved while IAM decided
            return _required(rid, open_["id"], open_["expires_ms"])
        return errors.Conflict("another extension of this reservation awaits its person's confirmation",
                               reason="confirmation-open", confirmationId=open_["id"],
                               expiresAt=open_["expires_ms"], reservationId=rid)
    cid, expires_at = new_id("conf"), await db.now_ms(conn) + CONFIRMATION_WINDOW_MS
    await confirmations.open_confirmation(conn, confirmation_id=cid, row=row, action=iam.EXTEND,
                                          agent=caller.identity_id, person=caller.delegator_id,
                                          expires_ms=expires_at, request_hash=found.digest, until_ms=new_end)
    return _required(rid, cid, expires_at)


def _required(rid: str, cid: str, expires_at: int) -> errors.DomainError:
    return errors.ConfirmationRequired("the person this agent acts for must confirm this extension",
                                       confirmationId=cid, expiresAt=expires_at, reservationId=rid)
