"""Node reports in: the body is parsed only to route it, never trusted; the reservation worker
verifies the signature (controlplane.pki.attest), decides, and alone writes the evidence
(allocations.bound_report). The gateway changes no allocation.

A report names an allocation. Unless that allocation is on the reporting session's own node, it
is ignored exactly like an unknown one (spec "Bindings"). A report the node's own key signed whose
sequence is not newer than the last one stored from that key is a replay (or a re-send after a
lost ack) and is dropped. Anything else is kept in node_reports as received, and the reservation
wakes. Every report is acknowledged with its outcome once that is committed.
"""

from __future__ import annotations

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2
from controlplane import db
from controlplane.pki import attest

STORED = node_pb2.REPORT_STORED
IGNORED = node_pb2.REPORT_IGNORED
REPLAYED = node_pb2.REPORT_REPLAYED
MAX_BODY = 64 * 1024
MAX_KEY_ID = 128
MAX_SIGNATURE = 1024

_ALLOCATION = "SELECT reservation_id FROM allocations WHERE id = %(allocation_id)s AND node_id = %(node_id)s"
# Moves the key's high-water mark only forwards; no row back means not newer (a replay).
_ADVANCE = """
INSERT INTO report_sequences AS s (signing_key, sequence) VALUES (%(signing_key)s, %(sequence)s)
ON CONFLICT (signing_key) DO UPDATE SET sequence = excluded.sequence, updated_at = now()
WHERE s.sequence < excluded.sequence
RETURNING s.sequence
"""
_KEEP = """
INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)
VALUES (%(node_id)s, %(allocation_id)s, %(kind)s, %(body)s, %(key_id)s, %(signature)s)
"""


def parse(attested: node_pb2.AttestedReport) -> node_pb2.Report | None:
    """The report's body when it is readable and names an allocation; else None."""
    if len(attested.body) > MAX_BODY or len(attested.key_id) > MAX_KEY_ID or len(attested.signature) > MAX_SIGNATURE:
        return None
    report = node_pb2.Report()
    try:
        report.ParseFromString(attested.body)
    except Exception:  # DecodeError, or a message nested too deep: unreadable either way
        return None
    kind = report.WhichOneof("event")
    if kind is None or not getattr(report, kind).allocation_id:
        return None
    return report


async def intake(pool: AsyncConnectionPool, node_id: str, attested: node_pb2.AttestedReport) -> node_pb2.ReportAck:
    """Store or drop one report; the ack to send the node (outcome STORED, IGNORED or REPLAYED)."""
    report = parse(attested)
    ack = node_pb2.ReportAck(sequence=report.sequence if report else 0, key_id=attested.key_id[:MAX_KEY_ID])
    if report is None:
        ack.outcome = IGNORED
        return ack
    kind = report.WhichOneof("event")
    params = {"node_id": node_id, "allocation_id": getattr(report, kind).allocation_id, "kind": kind,
              "body": attested.body, "key_id": attested.key_id, "signature": attested.signature,
              "sequence": report.sequence}

    async def work(conn: AsyncConnection) -> int:
        row = await (await conn.execute(_ALLOCATION, params)).fetchone()
        if row is None:
            return IGNORED
        signing_key = await attest.signing_key_of(conn, node_id, attested.body, attested.key_id, attested.signature)
        if signing_key is not None:
            advanced = await (await conn.execute(_ADVANCE, {**params, "signing_key": signing_key})).fetchone()
            if advanced is None:
                return REPLAYED
        await conn.execute(_KEEP, params)
        await conn.execute("SELECT wake_reservation(%s)", (row["reservation_id"],))
        return STORED

    ack.outcome = await db.run_in_transaction(pool, work)
    return ack
