"""What a webhook receives: the event as JSON and an HMAC-SHA256 signature over
f"{id}.{timestamp}.{body}" keyed with the webhook's secret.

A receiver verifies the signature (and that the timestamp is recent), then de-duplicates by
X-BC-Event-Id: delivery is at least once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SCHEME = "v1"


def body(event: dict[str, Any]) -> bytes:
    """The request body: {id, type, subject, tenantId, time, data}, compact JSON."""
    return json.dumps(
        {"id": event["id"], "type": event["type"], "subject": event["subject"],
         "tenantId": event["tenant_id"], "time": event["time_ms"], "data": event["data"]},
        separators=(",", ":"), ensure_ascii=False,
    ).encode()


def signature(secret: str, event_id: int, timestamp: int, payload: bytes) -> str:
    """The X-BC-Signature value: "v1=" and the hex HMAC-SHA256."""
    mac = hmac.new(secret.encode(), f"{event_id}.{timestamp}.".encode() + payload, hashlib.sha256)
    return f"{SCHEME}={mac.hexdigest()}"


def headers(secret: str, event_id: int, timestamp: int, payload: bytes) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "BetterCompute-Webhooks/1",
        "X-BC-Event-Id": str(event_id),
        "X-BC-Timestamp": str(timestamp),
        "X-BC-Signature": signature(secret, event_id, timestamp, payload),
    }


def verify(secret: str, event_id: str, timestamp: str, payload: bytes, header: str) -> bool:
    """True when `header` is the signature of this delivery (constant-time comparison)."""
    try:
        expected = signature(secret, int(event_id), int(timestamp), payload)
    except ValueError:
        return False
    return hmac.compare_digest(expected, header)
