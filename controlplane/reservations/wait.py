"""Async-with-wait: re-read in read-only transactions, backing off from 50 ms to 1 s, until the
operation stops running or the timeout passes. The timeout is capped by the server
(Settings.create_wait_cap_seconds, 30 s by default). A timeout is not an error: the answer is the
last read, or the view the lease holder's batch handed the wait (in the holder's process). A
client that goes away cancels the task, which ends the wait. Each wait logs one line with its
reads, the pauses between them, and whether it was handed its answer.

A wait ends with its caller's token, as a Watch stream does (docs/decisions.md): each read reads
the token's state in the same statement, and a token revoked or expired (on the product clock)
since the call authenticated ends the wait UNAUTHENTICATED instead of answering that read; a
caller removed from the tenant since (Admin.RemoveMembership) ends it ACCESS_DENIED. An answer
handed over by a batch is not read, so the token and membership are read alone before it is
given. The reservation stays as created; a retry of its key with a live token answers it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog

from controlplane import db, errors
from controlplane.auth import Caller
from controlplane.reservations import queries
from controlplane.reservations.reads import fetch_view
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0


def capped_ms(rt: Runtime, timeout_ms: int) -> int:
    return min(timeout_ms, int(rt.settings.create_wait_cap_seconds * 1000))


def _caller_params(caller: Caller, tenant_id: str) -> dict[str, Any]:
    return {"token_id": caller.token_id, "identity_id": caller.identity_id, "tenant_id": tenant_id}


def _require_acting(caller: Caller, tenant_id: str, rid: str, state: dict[str, Any]) -> None:
    """UNAUTHENTICATED once the caller's token is revoked or expired; ACCESS_DENIED once the
    caller can no longer act in the tenant (`state`: token_state and member, popped)."""
    token, member = state.pop("token_state"), state.pop("member")
    if token != "live":
        raise errors.Unauthenticated(f"the token was {token or 'revoked'} while the create waited",
                                     tokenId=caller.token_id, reservationId=rid)
    if not member:
        raise errors.AccessDenied("the caller is not a member of this tenant", tenantId=tenant_id)


async def read_for(rt: Runtime, caller: Caller | None, rid: str, tenant_id: str) -> dict[str, Any]:
    """The reservation as fetch_view reads it, read with the caller's token and membership (one
    statement, as fetch_view): see _require_acting."""
    if caller is None or not caller.token_id:  # no bearer token behind the call: nothing to end with
        return await fetch_view(rt, rid)
    view = await db.fetch_one(rt.pool, queries.VIEW_FOR_TOKEN, {"id": rid, **_caller_params(caller, tenant_id)})
    if view is None:
        raise errors.NotFound("no such reservation", reservationId=rid)
    _require_acting(caller, tenant_id, rid, view)
    return view


async def check_handed(rt: Runtime, caller: Caller | None, rid: str, tenant_id: str) -> None:
    """The caller's token and membership, read alone for an answer a batch handed over: the
    batch read neither, and the token may have been revoked since the wait's last read."""
    if caller is not None and caller.token_id:
        state = await db.fetch_one(rt.pool, queries.CALLER_STATE, _caller_params(caller, tenant_id))
        _require_acting(caller, tenant_id, rid, dict(state))


async def wait_for_operation(
    rt: Runtime, tenant_id: str, rid: str, timeout_ms: int, *, just_queued: bool = False,
    caller: Caller | None = None,
) -> dict[str, Any]:
    """A pause ends early when the lease placer decides the reservation (its batch notifies the
    ids it moved; every process's lease worker wakes its own waiters), so a queued create answers
    as soon as it is placed; the back-off stays as the safety net. When the batch ran in this
    process it hands the waiter the reservation as it committed it, and the wait answers with
    that instead of reading. `just_queued`: the caller has
    just queued it, so the wait starts with the first pause rather than a read that would find it
    queued. `caller`: whose token and membership each read checks (None: no check); a handed
    answer is not read, so they are read alone before it is given (check_handed)."""
    started = time.monotonic()
    deadline = started + capped_ms(rt, timeout_ms) / 1000
    delay = FIRST_DELAY_S
    pauses_ms: list[int] = []
    woken_early = 0  # pauses a batch's wake-up ended
    watching = rt.leases.waiters.watching(rid) if rt.leases is not None else contextlib.nullcontext(None)
    try:
        with watching as waiter:
            reads = 0
            while True:
                if waiter is not None:
                    waiter.event.clear()  # before the read: a wake-up after it ends the next pause
                remaining = deadline - time.monotonic()
                if pauses_ms or not just_queued or remaining <= 0:
                    handed = waiter is not None and waiter.view is not None
                    if handed:
                        view, waiter.view = waiter.view, None  # as this process's batch committed it: no read
                        await check_handed(rt, caller, rid, tenant_id)
                    else:
                        view = await read_for(rt, caller, rid, tenant_id)
                        reads += 1
                    remaining = deadline - time.monotonic()
                    if view["operation_state"] != "running" or remaining <= 0:
                        log.info("operation wait", reservation_id=rid, reads=reads, pauses_ms=pauses_ms,
                                 woken=woken_early, handed=handed, operation=view["operation_state"])
                        return view
                pause = min(delay, remaining)
                pauses_ms.append(round(pause * 1000))
                if waiter is None:
                    await asyncio.sleep(pause)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(waiter.event.wait(), pause)
                        woken_early += 1
                delay = min(delay * 2, MAX_DELAY_S)
    except asyncio.CancelledError:
        log.info("create wait cancelled", reservation_id=rid, tenant_id=tenant_id,
                 waited_ms=int((time.monotonic() - started) * 1000))
        raise
