"""Node reports in: the body is parsed only to route it, never trusted; the reservation worker
verifies the signature (controlplane.pki.attest) and decides. The gateway changes no state.

A report names an allocation. Unless that allocation is on the reporting session's own node, it
is ignored exactly like an unknown one (spec "Bindings"). Otherwise it is kept in node_reports as
received; an AllocationBound also goes into allocations.bound_report / bound_sig_kid / bound_sig
byte for byte; and the reservation wakes.
"""

from __future__ import annotations

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2
from controlplane import db

STORED = "stored"
IGNORED = "ignored"
MAX_BODY = 64 * 1024
MAX_KEY_ID = 128
MAX_SIGNATURE = 1024

_BOUND = """
UPDATE allocations SET bound_report = %(body)s, bound_sig_kid = %(key_id)s, bound_sig = %(signature)s
WHERE id = %(allocation_id)s AND node_id = %(node_id)s
RETURNING reservation_id
"""
_OTHER = "SELECT reservation_id FROM allocations WHERE id = %(allocation_id)s AND node_id = %(node_id)s"
_KEEP = """
INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)
VALUES (%(node_id)s, %(allocation_id)s, %(kind)s, %(body)s, %(key_id)s, %(signature)s)
"""


def route(attested: node_pb2.AttestedReport) -> tuple[str, str] | None:
    """(kind, allocation id) named by the report's body, or None when it names none."""
    if len(attested.body) > MAX_BODY or len(attested.key_id) > MAX_KEY_ID or len(attested.signature) > MAX_SIGNATURE:
        return None
    report = node_pb2.Report()
    try:
        report.ParseFromString(attested.body)
    except Exception:  # DecodeError, or a message nested too deep: unreadable either way
        return None
    kind = report.WhichOneof("event")
    if kind is None:
        return None
    allocation_id = getattr(report, kind).allocation_id
    return (kind, allocation_id) if allocation_id else None


async def intake(pool: AsyncConnectionPool, node_id: str, attested: node_pb2.AttestedReport) -> str:
    """STORED, or IGNORED (unreadable, unknown, or another node's allocation)."""
    routed = route(attested)
    if routed is None:
        return IGNORED
    kind, allocation_id = routed
    params = {"node_id": node_id, "allocation_id": allocation_id, "kind": kind, "body": attested.body,
              "key_id": attested.key_id, "signature": attested.signature}

    async def work(conn: AsyncConnection) -> str:
        row = await (await conn.execute(_BOUND if kind == "bound" else _OTHER, params)).fetchone()
        if row is None:
            return IGNORED
        await conn.execute(_KEEP, params)
        await conn.execute("SELECT wake_reservation(%s)", (row["reservation_id"],))
        return STORED

    return await db.run_in_transaction(pool, work)
