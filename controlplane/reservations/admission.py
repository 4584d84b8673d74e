"""Admission of a create: the request-as-resource sequence (DESIGN.md section 8).

1. validate and normalise; draft id and request hash;
2. transaction 1 writes the draft (or finds the stored row) and resolves the IAM attributes;
3. IAM decides outside any transaction;
4. transaction 2 records a refusal, opens a confirmation, or charges quota and places;
5. the answer waits while the operation runs, if asked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import authorize, confirmations, db, errors, events, iam, quota
from controlplane.auth import Caller, Unverified, verify_now
from controlplane.common import devices as common_devices
from controlplane.common.locks import pool_lock_key
from controlplane.ids import draft_id, new_id, request_hash
from controlplane.metal import is_node_lease
from controlplane.metal import request as metal_request
from controlplane.reservations import (create_facts, devices, draft_ahead, draft_room, earliest, hostshare,
                                       kubernetes, placing, queries, queued, queued_queries, replay, schedule,
                                       states)
from controlplane.reservations.reads import fetch_view
from controlplane.reservations.transitions import condition, expire_confirmation, move
from controlplane.reservations.validate import CreateInput, TimeLimits, check_start, validate_create
from controlplane.reservations.wait import wait_for_operation
from controlplane.runtime import Runtime

CONFIRMATION_WINDOW_MS = 30 * 60 * 1000  # IAM's deadline is clamped to at most 30 minutes

@dataclass
class Draft:
    """What transaction 1 found or wrote."""

    row: dict[str, Any]
    caller: Caller  # verified by the facts read
    decide: bool = False
    policy: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    approved: bool = False
    rejected: bool = False
    lease: bool = False  # queued for the pool's lease holder rather than placed inline
    charges: devices.Charges | None = None  # the quota transaction 2 charges
    now_ms: int = 0  # the database clock as transaction 1 read it: transaction 2 plans from it

    @property
    def foreign(self) -> bool:
        """The key's reservation now belongs to another member (RemoveMembership's successor)."""
        return self.row["owner_identity_id"] != self.caller.identity_id


async def create(rt: Runtime, who: Caller | Unverified, raw: dict[str, Any]) -> dict[str, Any]:
    """`who`: the caller, or a token this process knew, verified by the facts read (the first
    statement) before anything read is used; nothing before it reads or writes the database."""
    limits = TimeLimits.of(rt.settings)
    inp = validate_create(raw, limits, max_gang_size=rt.settings.max_gang_size)
    if inp.request.get("startEarliest") and isinstance(who, Unverified):  # verified before it waits below
        who = await verify_now(rt.pool, who)
    if isinstance(who, Caller):
        who.require_member(inp.tenant_id)
    rid = draft_id(inp.tenant_id, who.identity_id, inp.idempotency_key)
    digest = request_hash(inp.request)
    if inp.request.get("startEarliest"):  # the earliest start is searched on an index holding every commit
        await earliest.caught_up(rt)

    draft = await db.run_autocommit(rt.pool, lambda c: _transaction_1(c, rt, who, inp, rid, digest))
    caller = draft.caller
    if draft.foreign:
        replay.require_foreign_readable(draft.policy, draft.caller, draft.row, inp, digest)
    if draft.decide:
        if draft.rejected:
            decision = iam.Decision(iam.DENY, ("the person rejected the confirmation",))
        else:
            decision = authorize.decide(
                draft.policy, caller, iam.CREATE, "Reservation", rid, draft.attributes,
                tenant_id=inp.tenant_id, approved=draft.approved,
            )
        if draft.approved and decision.allowed:
            outcome = await _place_approved(rt, caller, draft, decision)
        elif draft.lease and decision.allowed:
            outcome = await _admit_queued(rt, draft.row, decision, draft.charges)
        elif decision.allowed:
            outcome = await _place_inline(rt, caller, draft, decision)
        else:
            outcome = await db.run_in_transaction(
                rt.pool, lambda c: _transaction_2(c, rt, caller, draft.row, decision, draft.now_ms,
                                                  charges=draft.charges)
            )
        outcome.raise_if_refused()
        if outcome.view is not None:  # placed: the answer as placed, read before commit
            return outcome.view
        queued_now = outcome.queued
    else:
        queued_now = False
    if inp.wait_ms:
        return await wait_for_operation(rt, inp.tenant_id, rid, inp.wait_ms, just_queued=queued_now,
                                        caller=caller)
    return await fetch_view(rt, rid)


async def _transaction_1(
    conn: AsyncConnection, rt: Runtime, who: Caller | Unverified, inp: CreateInput, rid: str, digest: str
) -> Draft:
    """Runs in autocommit: its one write for a new request, the draft with its IAM attributes, is
    one statement, so a new request costs two round trips (the facts with the stored row, the
    insert) and no BEGIN or COMMIT; one when the request was checked against the pool as this
    tenant saw it before and the facts read finds it unchanged (draft_ahead). A stored row's
    confirmation expiry takes a transaction."""
    ahead = await draft_ahead.prepare(rt, who, inp, rid, digest, lambda seen, index: _checked(
        conn, rt, inp, who.identity_id, create_facts.with_single_model(seen, index)))
    try:
        facts = await create_facts.read(conn, rt, who, inp, rid, ahead)
    except psycopg.errors.IntegrityError:  # the draft room or the owner's rows refused the insert:
        if ahead is None:
            raise
        facts = await create_facts.read(conn, rt, who, inp, rid)  # the insert after the read says why
    caller = facts.caller
    row, pool, attributes = facts.row, facts.pool, None  # attributes: of the draft inserted here
    if facts.inserted:  # checked against the pool the statement found unchanged
        assert ahead is not None
        pool, attributes = ahead.pool, ahead.attributes
        rt.metrics.draft_written(ahead=True)
    elif row is None:
        check_start(inp, facts.now_ms, TimeLimits.of(rt.settings))
        pool, request, share, attributes = await _checked(conn, rt, inp, caller.identity_id, pool,
                                                          live=facts.drafts, now_ms=facts.now_ms)
        row = await draft_room.insert(conn, rt, facts.drafts, {
            "id": rid, "tenant_id": inp.tenant_id, "pool_id": inp.request["poolId"],
            "identity_id": caller.identity_id, "key": inp.idempotency_key, "request": Jsonb(request),
            "request_hash": digest, "host_share": Jsonb(share), "attributes": Jsonb(attributes),
        })
        if row is None:  # a concurrent twin's draft: its attributes are upserted below
            attributes = None
            row = await _fetch(conn, rid)
        else:
            rt.metrics.draft_written(ahead=False)
        assert row is not None
    draft = Draft(row, caller, policy=facts.policy, now_ms=facts.now_ms)
    if draft.foreign:  # not the caller's to replay without a decision: `create` decides a read
        return draft
    replay.require_replayable(row, digest)
    state = row["state"]
    if state == states.AWAITING_CONFIRMATION:
        confirmation = await _latest_confirmation(conn, rid)
        if confirmation is not None and confirmation["expired"]:
            async with conn.transaction():
                await expire_confirmation(conn, row)  # a late retry finds it expired
            return draft
        draft.approved = confirmation is not None and confirmation["state"] == "approved"
        draft.rejected = confirmation is not None and confirmation["state"] == "rejected"
    elif state != states.DRAFT:
        return draft  # past the draft stage: the stored reservation, no second decision

    if pool is None:
        raise errors.NotFound("no such pool", poolId=row["pool_id"])
    pool = await _with_models(conn, rt, row["request"], pool)
    draft.lease = queued.uses_lease(pool, row["request"])
    draft.charges = devices.charges(row["request"], pool, gang_size_of(row["request"]))
    if attributes is not None:  # the new draft's attributes went in with it
        draft.attributes = attributes
    else:
        draft.attributes = _attributes(row, pool)
        await conn.execute(queries.UPSERT_AUTHZ, {"id": rid, "attributes": Jsonb(draft.attributes)})
    draft.decide = True
    return draft


async def _checked(conn: AsyncConnection, rt: Runtime, inp: CreateInput, identity_id: str, pool: dict[str, Any] | None,
                   *, live: dict[str, Any] | None = None, now_ms: int = 0) -> tuple[dict, dict, dict, dict]:
    """A new request checked against the pool and resolved as its draft stores it: the pool with
    its models, the request, its host share and its IAM attributes. `live`: the identity's drafts
    when read (the draft's insert guards the cap in any case)."""
    resolved = await resolve_request(conn, rt, inp.request, inp.tenant_id, pool=pool)
    pool, request, share = resolved.pool, resolved.request, resolved.share
    if live is not None:
        draft_room.require(rt, live)
    if request.get("startEarliest"):  # the start chosen now is stored: a retry finds the same
        request = await earliest.choose_start(conn, rt, request, now_ms)
    pool = await _with_models(conn, rt, request, pool)
    request = devices.pinned(request, pool)
    attributes = _attributes({"tenant_id": inp.tenant_id, "owner_identity_id": identity_id,
                              "pool_id": inp.request["poolId"], "request": request, "host_share": share}, pool)
    return pool, request, share, attributes


async def _with_models(conn: AsyncConnection, rt: Runtime, request: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    """The pool with its GPU models listed when the request's model is not known from it (a pool
    of several models: a model quota may refuse it)."""
    if _model_known(request, pool) or "models" in pool:
        return pool
    return {**pool, "models": await _pool_models(conn, rt, pool["id"])}


@dataclass(frozen=True)
class Resolved:
    """A validated request resolved against its pool, as create stores it (capacity.preview too)."""

    pool: dict[str, Any]
    request: dict[str, Any]  # with the host resources it books
    share: dict[str, int]  # the pool's per-GPU share it was raised to


async def resolve_request(conn: AsyncConnection, rt: Runtime, request: dict[str, Any], tenant_id: str,
                          *, pool: dict[str, Any] | None = None) -> Resolved:
    """The pool the tenant sees (NOT_FOUND otherwise; `pool`: as the caller read it), the checks
    against it, and the host resources the request books: what create and capacity.preview both
    do before planning."""
    if pool is None:
        pool = await _visible_pool(conn, rt, request["poolId"], tenant_id)
    if pool is None:
        raise errors.NotFound("no such pool", poolId=request["poolId"])
    kubernetes.check_pool(request, pool, tenant_id)
    devices.check_pool(request, pool)
    await metal_request.check_create(conn, request, pool)
    booked, share = await _with_host_resources(conn, rt, request, pool)
    return Resolved(pool, booked, share)


async def _with_host_resources(
    conn: AsyncConnection, rt: Runtime, request: dict[str, Any], pool: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, int]]:
    """The request as stored, with the host resources it books resolved once (the pool's per-GPU
    share, the floor of what it asks), and the share itself (the hash stays the input's)."""
    if is_node_lease(request):  # a whole-machine lease books no host resources: its share is empty
        return request, {}
    device = request["devices"][0]  # the GPUs' worth: a MIG instance or a slot counts its fraction
    gpus = common_devices.gpu_equivalent(device["class"], device["count"], pool.get("policy"))
    booked, share = hostshare.resolve(request.get("resources"), await hostshare.per_gpu(conn, rt, pool), gpus)
    return {**request, "resources": booked}, share


async def _visible_pool(conn: AsyncConnection, rt: Runtime, pool_id: str, tenant_id: str) -> dict[str, Any] | None:
    """The pool if the tenant sees it, with its single GPU model (None when it has several or
    none): from the capacity index when built, so no create scans the pool's atoms."""
    params = {"pool_id": pool_id, "tenant_id": tenant_id}
    index = create_facts.pool_index(rt, pool_id)
    if index is None:
        return await (await conn.execute(queries.VISIBLE_POOL, params)).fetchone()
    pool = await (await conn.execute(queries.VISIBLE_POOL_FACTS, params)).fetchone()
    return None if pool is None else create_facts.with_single_model(pool, index)


def _model_known(request: dict[str, Any], pool: dict[str, Any]) -> bool:
    return bool(devices.model_of(request["devices"][0], pool))


async def _pool_models(conn: AsyncConnection, rt: Runtime, pool_id: str) -> list[str]:
    """The pool's GPU models: from the capacity index when built, else read."""
    index = create_facts.pool_index(rt, pool_id)
    if index is not None:
        return index.models()
    return [r["model"] for r in await (await conn.execute(queries.POOL_MODELS, {"pool_id": pool_id})).fetchall()]


def _attributes(row: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    """What IAM sees of the reservation: everything it asks for."""
    request = row["request"]
    device = request["devices"][0]
    gang_size = gang_size_of(request)
    return {
        "tenantId": row["tenant_id"],
        "ownerIdentityId": row["owner_identity_id"],
        "poolId": row["pool_id"],
        "region": pool["region"],
        **devices.attributes(request, pool, gang_size),
        "topology": device["topology"],
        "gangSize": gang_size,
        "durationHours": math.ceil(request["durationMs"] / 3_600_000),
        "durationMs": request["durationMs"],
        "binding": request["binding"],
        "spot": bool(request.get("spot")),
        "hasStart": request.get("start") is not None,
        "start": request.get("start") or 0,
        "leaseSeconds": request.get("leaseSeconds") or 0,
        **{k: v * gang_size for k, v in hostshare.attributes(row).items()},  # summed over a gang
    }


def gang_size_of(request: dict[str, Any]) -> int:
    """Nodes the request books: its gang's size, 1 for a request that is not a gang."""
    return request["gang"]["size"] if request.get("gang") else 1


@dataclass
class Outcome:
    error: errors.DomainError | None = None
    queued: bool = False  # queued for the pool's lease holder by this transaction
    # Placed: the reservation as placed, read inside the transaction (see _transaction_2).
    view: dict[str, Any] | None = None

    def raise_if_refused(self) -> None:
        if self.error is not None:
            raise self.error


UNDECIDED = [states.DRAFT, states.AWAITING_CONFIRMATION]


def _expired(rid: str) -> Outcome:
    """The draft is gone: the sweeper deleted it, expired, while IAM decided."""
    return Outcome(errors.Conflict("this request expired while it was decided; retry it", reservationId=rid))


def _charged(row: dict[str, Any], charges: devices.Charges) -> dict[str, Any]:
    """What the reservation charges: its devices, and the host resources above its share (summed
    over a gang)."""
    excess = {k: v * gang_size_of(row["request"]) for k, v in hostshare.excess(row).items()}
    return {**charges.amounts, **excess}


class _DeadlinePassed(Exception):
    """The approval's deadline passed before the transaction that would use it: it rolls back."""


async def _place_approved(rt: Runtime, caller: Caller, draft: Draft, decision: iam.Decision) -> Outcome:
    """An allowed retry on the person's approval, which is for a retry before the deadline: placed
    (or queued) only if the deadline has not passed by the transaction that commits it, judged
    under the reservation's lock; past it, expired as the reconciler would have expired it."""
    rid = draft.row["id"]

    async def queue(conn: AsyncConnection) -> Outcome:  # admit_queued takes no pool lock: the row first
        await _fetch(conn, rid, for_update=True)
        if await confirmations.lock_due(conn, rid) is not None:
            raise _DeadlinePassed
        return await _admit_queued(rt, draft.row, decision, draft.charges, conn=conn)

    async def expire(conn: AsyncConnection) -> Outcome:
        row = await _fetch(conn, rid)
        if row is not None and row["state"] == states.AWAITING_CONFIRMATION:
            await expire_confirmation(conn, row)
        return Outcome()

    try:
        if draft.lease:
            return await db.run_in_transaction(rt.pool, queue)
        return await db.run_in_transaction(rt.pool, lambda c: _transaction_2(
            c, rt, caller, draft.row, decision, draft.now_ms, charges=draft.charges, approved=True))
    except _DeadlinePassed:
        return await db.run_in_transaction(rt.pool, expire)


async def _admit_queued(rt: Runtime, draft_row: dict[str, Any], decision: iam.Decision,
                        charges: devices.Charges | None, conn: AsyncConnection | None = None) -> Outcome:
    """Transaction 2 of an allowed create in a lease-policy pool: one statement in autocommit
    (admit_queued, migration 0028) that records the decision, charges quota (QUOTA_EXCEEDED
    charges nothing) and queues the reservation for the pool's lease holder: no plan, no pool
    lock, one round trip."""
    assert charges is not None
    rid, amounts = draft_row["id"], _charged(draft_row, charges)
    params = quota.charge_params(draft_row["tenant_id"], rid, amounts, charges.unnamed_models)
    admit = {**params, "id": rid, "version": draft_row["version"], "decision": decision.outcome,
             "undecided": UNDECIDED, "from_states": states.sources_of(states.QUEUED)}
    try:
        found = (await db.fetch_one(rt.pool, queued_queries.ADMIT_QUEUED, admit) if conn is None
                 else await (await conn.execute(queued_queries.ADMIT_QUEUED, admit)).fetchone())
    except psycopg.Error as exc:
        raise quota.refusal(exc, amounts) from None
    assert found is not None
    if found["outcome"] == "missing":  # an expired draft, deleted by the sweeper while IAM decided
        return _expired(rid)
    if found["outcome"] == "decided":  # by a concurrent twin: answer with the stored row
        return Outcome()
    return Outcome(queued=True)


async def _place_inline(rt: Runtime, caller: Caller, draft: Draft, decision: iam.Decision) -> Outcome:
    """Transaction 2 of an allowed inline create. Planned first, in autocommit; the common case
    (one node, devices alone) is then one statement, place_inline, that holds the pool lock only
    for its own work and commit (placing.place_at_once). The others take _transaction_2 with
    that plan; a lost race takes it planning again."""
    row, charges = draft.row, draft.charges
    assert charges is not None
    amounts = _charged(row, charges)
    admitted = {**quota.charge_params(row["tenant_id"], row["id"], amounts, charges.unnamed_models),
                "decision": decision.outcome, "undecided": UNDECIDED, "lock_key": pool_lock_key(row["pool_id"])}

    async def at_once(conn: AsyncConnection) -> tuple[placing.Prepared, dict[str, Any] | None]:
        prepared = await placing.prepare(conn, rt, row, draft.now_ms, lock=False)
        if not placing.at_once(row, prepared):
            return prepared, None
        try:
            return prepared, await placing.place_at_once(conn, rt, row, prepared, draft.now_ms, admitted)
        except psycopg.Error as exc:
            raise quota.refusal(exc, amounts) from None

    prepared, found = await db.run_autocommit(rt.pool, at_once)
    if found is None:  # not the common case (planned: reuse it), or the race lost (plan again)
        again = placing.at_once(row, prepared)
        return await db.run_in_transaction(rt.pool, lambda c: _transaction_2(
            c, rt, caller, row, decision, draft.now_ms, charges=charges, prepared=None if again else prepared))
    outcome = found.pop("outcome")
    if outcome == "missing":  # an expired draft, deleted by the sweeper while IAM decided
        return _expired(row["id"])
    if outcome == "decided":  # by a concurrent twin: answer with the stored row
        return Outcome()
    return Outcome(view=found)


async def _transaction_2(
    conn: AsyncConnection, rt: Runtime, caller: Caller, draft_row: dict[str, Any], decision: iam.Decision,
    now_ms: int, *, charges: devices.Charges | None = None, prepared: placing.Prepared | None = None,
    approved: bool = False,
) -> Outcome:
    """Plans from the row and the clock transaction 1 read (its request never changes; the
    version is checked under the lock), so the row is read once here, locked. (An allowed create of a lease-policy
    pool takes _admit_queued instead; an allowed inline one comes here from _place_inline, with
    its plan unless its race was lost.)"""
    rid, version = draft_row["id"], draft_row["version"]
    undecided = UNDECIDED
    if decision.allowed:
        assert charges is not None
        if prepared is None:
            prepared = await placing.prepare(conn, rt, draft_row, now_ms, lock=False)  # plans before any lock
        # The pool lock, the row, and if still undecided the decision recorded and the quota
        # charged (host resources above the share beside the devices): one round trip.
        amounts = _charged(draft_row, charges)
        try:
            row = await (await conn.execute(queries.POOL_LOCK_THEN_CHARGE, {
                **quota.charge_params(draft_row["tenant_id"], rid, amounts, charges.unnamed_models),
                "id": rid, "lock_key": pool_lock_key(draft_row["pool_id"]),
                "decision": decision.outcome, "undecided": undecided, "version": version,
            })).fetchone()
        except psycopg.Error as exc:
            raise quota.refusal(exc, amounts) from None  # QUOTA_EXCEEDED: the transaction rolls back
    else:
        row = await _fetch(conn, rid, for_update=True)
    if row is None:  # an expired draft, deleted by the sweeper while IAM decided
        return _expired(rid)
    if row["state"] not in undecided or row["version"] != version:
        if row["state"] == states.DENIED:  # a twin recorded the refusal first: the key stays refused
            return Outcome(errors.AccessDenied("this request was refused", reservationId=rid))
        return Outcome()  # decided meanwhile by a concurrent twin: answer with the stored row
    if approved and await confirmations.lock_due(conn, rid) is not None:
        raise _DeadlinePassed  # the charge and the decision roll back with this transaction
    if decision.outcome == iam.CONFIRM:
        decision = await _decided_meanwhile(conn, rid, decision)
    if not decision.allowed:
        await conn.execute(queries.RECORD_DECISION, {"id": rid, "decision": decision.outcome})

    if decision.outcome == iam.DENY:
        await move(conn, row, states.DENIED, operation_state="failed")
        return Outcome(errors.AccessDenied("IAM refused this request", reservationId=rid))
    if decision.outcome == iam.CONFIRM:
        return Outcome(await _require_confirmation(conn, caller, row, now_ms))

    assert prepared is not None and row["charged"] == 1
    # Placed at the clock under the lock, not transaction 1's: time (or the dev clock) moved on
    # while IAM decided and the lock was waited for, and a start that passed meanwhile begins now.
    now_ms = max(now_ms, row["lock_now_ms"])
    placed = await placing.place_locked(conn, rt, row, placing.at_clock(prepared, row, now_ms), now_ms)
    # Placed: the answer as placed, read in the move's own statement (for one that starts now the
    # reconciler moves it on to binding the moment this commits; a read after would race it).
    return Outcome(view=placed)


async def _require_confirmation(
    conn: AsyncConnection, caller: Caller, row: dict[str, Any], now_ms: int
) -> errors.DomainError:
    confirmation = await _latest_confirmation(conn, row["id"])
    # An open one (pending, or approved since transaction 1 read it) is the one to wait for: the
    # agent's next retry finds the approval. At most one is open per request.
    if confirmation is None or confirmation["state"] not in ("pending", "approved"):
        confirmation_id = new_id("conf")
        expires_at = now_ms + CONFIRMATION_WINDOW_MS
        await confirmations.open_confirmation(conn, confirmation_id=confirmation_id, row=row, action=iam.CREATE,
                                              agent=caller.identity_id, person=caller.delegator_id,
                                              expires_ms=expires_at)
        await schedule.at(conn, row["id"], expires_at)  # the reconciler expires it at the deadline
    else:
        confirmation_id, expires_at = confirmation["id"], confirmation["expires_ms"]
    if row["state"] == states.DRAFT:
        await move(
            conn, row, states.AWAITING_CONFIRMATION, operation_state="running",
            conditions=[condition("ConfirmationRequired", "DelegatedConfirmation",
                                  f"waiting for {caller.delegator_id} to confirm", now_ms)],
        )
        await events.emit_reservation(
            conn, row, "reservation.awaiting-confirmation",
            reason="confirmation-required", confirmationId=confirmation_id,
        )
    return errors.ConfirmationRequired(
        "the person this agent acts for must confirm this request",
        confirmationId=confirmation_id, expiresAt=expires_at, reservationId=row["id"],
    )


async def _decided_meanwhile(conn: AsyncConnection, rid: str, decision: iam.Decision) -> iam.Decision:
    """IAM held the request again, but the person rejected it after transaction 1 read the
    confirmation pending: the rejection decides (the row is locked, so no decision follows)."""
    confirmation = await _latest_confirmation(conn, rid)
    if confirmation is not None and confirmation["state"] == "rejected":
        return iam.Decision(iam.DENY, ("the person rejected the confirmation",))
    return decision


async def _latest_confirmation(conn: AsyncConnection, rid: str) -> dict[str, Any] | None:
    return await confirmations.latest(conn, rid, iam.CREATE)


async def _fetch(conn: AsyncConnection, rid: str, *, for_update: bool = False) -> dict[str, Any] | None:
    sql = queries.BY_ID_FOR_UPDATE if for_update else queries.BY_ID
    return await (await conn.execute(sql, {"id": rid})).fetchone()
