"""What a delivery carries, per the Standard Webhooks specification (standardwebhooks.com), so a
receiver verifies it with any of that project's libraries:

- `webhook-id`: the event id, the same on every attempt (the receiver de-duplicates by it:
  delivery is at least once);
- `webhook-timestamp`: the attempt's time, seconds since the epoch;
- `webhook-signature`: "v1," and the base64 HMAC-SHA256 of "{id}.{timestamp}.{body}", keyed with
  the secret's bytes: a secret is "whsec_" and the base64 of 24 to 64 random bytes.

The body is the event as compact JSON.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from typing import Any

PREFIX = "whsec_"
SCHEME = "v1"
KEY_BYTES = (24, 64)  # a given secret's key length; a generated one has 32
GENERATED_BYTES = 32


def generate_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(GENERATED_BYTES)).decode()


def key(secret: str) -> bytes:
    """The HMAC key of a "whsec_" secret; ValueError when it is not one."""
    if not secret.startswith(PREFIX):
        raise ValueError(f"must start with {PREFIX}")
    try:
        return base64.b64decode(secret[len(PREFIX):], validate=True)
    except binascii.Error:
        raise ValueError(f"must be {PREFIX} and standard base64") from None


def check_secret(secret: str) -> str:
    """`secret` when it is "whsec_" and the base64 of 24 to 64 bytes; ValueError otherwise."""
    message = f"must be {PREFIX} and the base64 of {KEY_BYTES[0]} to {KEY_BYTES[1]} random bytes"
    try:
        length = len(key(secret))
    except ValueError:
        raise ValueError(message) from None
    if not KEY_BYTES[0] <= length <= KEY_BYTES[1]:
        raise ValueError(message)
    return secret


def body(event: dict[str, Any]) -> bytes:
    """The request body: {id, type, subject, tenantId, time, data}, compact JSON."""
    return json.dumps(
        {"id": event["id"], "type": event["type"], "subject": event["subject"],
         "tenantId": event["tenant_id"], "time": event["time_ms"], "data": event["data"]},
        separators=(",", ":"), ensure_ascii=False,
    ).encode()


def signature(secret: str, message_id: str, timestamp: int, payload: bytes) -> str:
    """The webhook-signature value: "v1," and the base64 HMAC-SHA256."""
    mac = hmac.new(key(secret), f"{message_id}.{timestamp}.".encode() + payload, hashlib.sha256)
    return f"{SCHEME},{base64.b64encode(mac.digest()).decode()}"


def headers(secret: str, event_id: int, timestamp: int, payload: bytes) -> dict[str, str]:
    message_id = str(event_id)
    return {
        "Content-Type": "application/json",
        "User-Agent": "BetterCompute-Webhooks/1",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret, message_id, timestamp, payload),
    }
