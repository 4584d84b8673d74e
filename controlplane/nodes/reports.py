"""Node reports in: the body is parsed only to route it, never trusted; the reservation worker
verifies the signature (controlplane.pki.attest), decides, and alone writes the evidence
(allocations.bound_report). Intake changes no allocation.

A report names an allocation. Unless that allocation is on the reporting session's own node, it
is ignored exactly like an unknown one (spec "Bindings"). A report the node's own key signed whose
sequence is not newer than the last one stored from that key is a replay (or a re-send after a
lost ack) and is dropped. So is one about an allocation already holding `max_unjudged` reports not
judged yet (those of an allocation that ended are never judged: without the cap one node could
write a row per message about it for ever). Anything else is kept in node_reports as received, and
the reservation wakes. Every report is acknowledged with its outcome once that is committed.

Storage stays bounded after judging too: the worker keeps per allocation the newest JUDGED_KEPT
judged reports and the newest accepted one per certificate and kind (prune_judged), and the
retention sweep (expire_ended) deletes the reports of ended allocations after the window.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2
from controlplane import db, errors
from controlplane.nodes import queries, wire
from controlplane.pki import attest

STORED = node_pb2.REPORT_STORED
IGNORED = node_pb2.REPORT_IGNORED
REPLAYED = node_pb2.REPORT_REPLAYED
MAX_BODY = 64 * 1024
MAX_KEY_ID = 128
MAX_SIGNATURE = 1024
MAX_UNJUDGED = 32  # GatewaySettings.node_unjudged_reports
JUDGED_KEPT = 16  # judged reports kept per allocation (besides the newest accepted per certificate)
DROP_LOG_SECONDS = 60.0  # a node's dropped reports are logged at most once a minute
EXPIRE_BATCH = 500

log = structlog.get_logger(__name__)
_drops: dict[str, tuple[float, int]] = {}  # node id: (when its drops were last logged, dropped since)


def parse(attested: node_pb2.AttestedReport) -> node_pb2.Report | None:
    """The report's body when it is readable (within the bounds of controlplane.nodes.wire) and
    names an allocation; else None."""
    if len(attested.body) > MAX_BODY or len(attested.key_id) > MAX_KEY_ID or len(attested.signature) > MAX_SIGNATURE:
        return None
    report = node_pb2.Report()
    try:
        report.ParseFromString(attested.body)
    except Exception:  # DecodeError, or a message nested too deep: unreadable either way
        return None
    try:  # a NUL the worker cannot store in the binding, thousands of CDI devices: as unreadable
        wire.check(report)
    except errors.InvalidInput:
        return None
    kind = report.WhichOneof("event")
    if kind is None or not getattr(report, kind).allocation_id:
        return None
    return report


async def intake(pool: AsyncConnectionPool, node_id: str, attested: node_pb2.AttestedReport,
                 max_unjudged: int = MAX_UNJUDGED) -> node_pb2.ReportAck:
    """Store or drop one report; the ack to send the node (outcome STORED, IGNORED or REPLAYED).
    A report past the allocation's cap of unjudged reports is IGNORED (dropped), and logged."""
    report = parse(attested)
    ack = node_pb2.ReportAck(sequence=report.sequence if report else 0, key_id=attested.key_id[:MAX_KEY_ID])
    if report is None:
        ack.outcome = IGNORED
        return ack
    kind = report.WhichOneof("event")
    params = {"node_id": node_id, "allocation_id": getattr(report, kind).allocation_id, "kind": kind,
              "body": attested.body, "key_id": attested.key_id, "signature": attested.signature,
              "sequence": report.sequence, "cap": max_unjudged}
    full = False

    async def work(conn: AsyncConnection) -> int:
        nonlocal full
        facts = await (await conn.execute(queries.INTAKE_FACTS, params)).fetchone()
        if facts is None:
            return IGNORED
        full = facts["held"] >= max_unjudged
        if full:
            return IGNORED
        cert = {"node_id": facts["cert_node_id"], "signing_key": facts["signing_key"]} if facts["signing_key"] else None
        signing_key = attest.signing_key_in(cert, node_id, attested.body, attested.signature)
        kept = await (await conn.execute(queries.INTAKE_KEEP, {
            **params, "signing_key": signing_key, "reservation_id": facts["reservation_id"]})).fetchone()
        return STORED if kept["kept"] else REPLAYED

    # Two statements, each its own transaction: the read decides, the write is atomic in SQL (the
    # cap and the allocation's node are as racy under READ COMMITTED in one transaction).
    ack.outcome = await db.run_autocommit(pool, work)
    if full:
        _log_drop(node_id, params["allocation_id"], max_unjudged)
    return ack


def _log_drop(node_id: str, allocation_id: str, cap: int) -> None:
    """Log a node's dropped report at most once per DROP_LOG_SECONDS, with how many were dropped."""
    now = time.monotonic()
    last, dropped = _drops.get(node_id, (float("-inf"), 0))
    if now - last < DROP_LOG_SECONDS:
        _drops[node_id] = (last, dropped + 1)
        return
    if len(_drops) >= 10_000:  # one entry per node that dropped lately; never without end
        _drops.clear()
    _drops[node_id] = (now, 0)
    log.warning("node reports dropped: the allocation holds too many unjudged reports",
                node_id=node_id, allocation_id=allocation_id, cap=cap, dropped=dropped + 1)


# The reservation worker's side (controlplane.reservations.reports decides; these read and record).

async def unjudged(conn: AsyncConnection, reservation_id: str) -> list[dict[str, Any]]:
    """The reservation's live allocations' reports not judged yet, oldest first, locked."""
    return await (await conn.execute(queries.UNJUDGED_REPORTS, {"id": reservation_id})).fetchall()


async def record_verdict(conn: AsyncConnection, report_id: int, verdict: str, sequence: int | None) -> None:
    await conn.execute(queries.JUDGED, {"id": report_id, "verdict": verdict, "sequence": sequence})


async def prune_judged(conn: AsyncConnection, reservation_id: str, keep: int = JUDGED_KEPT) -> None:
    """Delete the reservation's judged reports but the newest `keep` per allocation and the newest
    accepted one per certificate and kind (queries.PRUNE_JUDGED)."""
    await conn.execute(queries.PRUNE_JUDGED, {"id": reservation_id, "keep": keep})


async def expire_ended(pool: AsyncConnectionPool, retention_s: float) -> int:
    """Delete the reports of ended allocations received longer than `retention_s` ago, in batches;
    the number deleted."""
    params = {"retention_s": retention_s, "batch": EXPIRE_BATCH}
    total = 0
    while True:
        deleted = await db.run_in_transaction(pool, lambda c: c.execute(queries.DELETE_ENDED_REPORTS, params))
        total += deleted.rowcount
        if deleted.rowcount < EXPIRE_BATCH:
            return total


async def last_accepted_sequence(conn: AsyncConnection, allocation_id: str, key_id: str) -> int | None:
    """The newest sequence accepted about the allocation from the node whose key is `key_id`: from
    that key, or another of the node's certificates not revoked. A report signed before a renewal
    and stored after newer ones (withheld by a compromised gateway) is a replay too."""
    row = await (await conn.execute(queries.LAST_ACCEPTED, {"allocation_id": allocation_id,
                                                            "key_id": key_id})).fetchone()
    return row["sequence"]
