"""Attested bindings: the check the reservation worker runs on a stored AllocationBound report.

The gateway stores body, key id and signature exactly as the node sent them; this decides. A
report counts only when (spec "Attested bindings"):
- it is signed by a certificate of that node: current, or expired within the offline grace,
  never revoked;
- the certificate's role runs workloads (`node`, `node-tenant`; BC_ATTEST_ROLES changes it);
- the signed body reports exactly this allocation bound, on this node;
- the body's time is neither in the future nor before the certificate, beyond the clock skew.
The signature is Ed25519 over PURPOSE || body, by the certificate's report-signing key.
Rejection reasons are stable strings (they go into reservation.binding-rejected events).

`signing_key_in` only asks whether the node's own key made a signature: the gateway orders the
reports it stores by it (replays), and decides nothing else.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519
from google.protobuf.message import DecodeError
from psycopg import AsyncConnection

from bettercompute.node.v1 import node_pb2
from controlplane.pki import NODE_ROLES, store
from controlplane.pki.config import DEFAULT_CLOCK_SKEW_SECONDS

PURPOSE = b"attested-report\x00"

UNSIGNED = "unsigned report"
UNKNOWN_KEY = "unknown signing key"
OTHER_NODE = "certificate of another node"
REVOKED = "certificate revoked"
EXPIRED = "certificate expired"
ROLE = "role does not run workloads"
BAD_SIGNATURE = "bad signature"
NOT_THIS_BOUND = "not this allocation bound"
FROM_THE_FUTURE = "report time in the future"
BEFORE_CERTIFICATE = "report time before its certificate"
REPLAYED = "replayed report"
_SKEW = timedelta(seconds=DEFAULT_CLOCK_SKEW_SECONDS)


def signed_message(body: bytes) -> bytes:
    """What the node's key signs: the purpose prefix, then the serialized Report."""
    return PURPOSE + body


async def verify_bound_report(
    conn: AsyncConnection,
    allocation_id: str,
    node_id: str,
    body: bytes | None,
    key_id: str | None,
    signature: bytes | None,
    offline_grace: timedelta,
    *,
    roles: frozenset[str] = NODE_ROLES,
    clock_skew: timedelta = _SKEW,
) -> tuple[bool, str, node_pb2.Report | None]:
    """(True, "", the report) when the report attests this allocation bound; else (False, reason, None)."""
    return await verify_report(conn, allocation_id, node_id, body, key_id, signature, offline_grace,
                               kind="bound", roles=roles, clock_skew=clock_skew)


async def verify_report(
    conn: AsyncConnection,
    allocation_id: str,
    node_id: str,
    body: bytes | None,
    key_id: str | None,
    signature: bytes | None,
    offline_grace: timedelta,
    *,
    kind: str,
    roles: frozenset[str] = NODE_ROLES,
    clock_skew: timedelta = _SKEW,
) -> tuple[bool, str, node_pb2.Report | None]:
    """The same checks for any report kind ("bound", "failed", "released"): a forged failure or
    release must not be able to move a booking either."""
    not_this = NOT_THIS_BOUND if kind == "bound" else f"not this allocation {kind}"
    if not body or not key_id or not signature:
        return False, UNSIGNED, None
    cert = await store.certificate_by_key_id(conn, key_id)
    if cert is None:
        return False, UNKNOWN_KEY, None
    if cert["node_id"] != node_id:
        return False, OTHER_NODE, None
    if cert["revoked_at"] is not None:
        return False, REVOKED, None
    if cert["now"] > cert["not_after"] + offline_grace:
        return False, EXPIRED, None
    if cert["role"] not in roles:
        return False, ROLE, None
    if not _signed_by(cert, body, signature):
        return False, BAD_SIGNATURE, None
    report = node_pb2.Report()
    try:
        report.ParseFromString(bytes(body))
    except DecodeError:
        return False, not_this, None
    if (report.node_id != node_id or report.WhichOneof("event") != kind
            or getattr(report, kind).allocation_id != allocation_id):
        return False, not_this, None
    if report.time > _ms(cert["now"] + clock_skew):
        return False, FROM_THE_FUTURE, None
    if report.time < _ms(cert["not_before"] - clock_skew):
        return False, BEFORE_CERTIFICATE, None
    return True, "", report


def signing_key_in(cert: dict[str, Any] | None, node_id: str, body: bytes, signature: bytes) -> bytes | None:
    """The raw Ed25519 key of the node's signing certificate `cert` (the one the report's key id
    names: its `node_id` and `signing_key`, read by the caller; None: no such certificate) when it
    made `signature` over `body` (revoked or expired certificates too: this says who signed, not
    what counts)."""
    if cert is None or not body or not signature or cert["node_id"] != node_id or not _signed_by(cert, body, signature):
        return None
    return bytes(cert["signing_key"])


def _signed_by(cert: dict[str, Any], body: bytes, signature: bytes) -> bool:
    try:
        key = ed25519.Ed25519PublicKey.from_public_bytes(bytes(cert["signing_key"] or b""))
        key.verify(bytes(signature), signed_message(bytes(body)))
    except (InvalidSignature, ValueError):
        return False
    return True


def _ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)
