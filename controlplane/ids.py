"""Identifiers: a prefix, "_", and lowercase Crockford base32 (0-9a-hjkmnp-tv-z).

Generated ids carry 26 characters of a ULID (time-ordered); the draft id carries 52 characters of
a SHA-256 of the tenant, the caller's identity and the idempotency key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
# RFC 4648's base32 writes the same bits in the same order (most significant first, the last
# group padded with zero bits, then "="): only the alphabet differs.
_FROM_RFC4648 = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", _ALPHABET.encode())


def b32(data: bytes) -> str:
    """Crockford base32 of `data`, most significant bits first, padded with zero bits."""
    return base64.b32encode(data).rstrip(b"=").translate(_FROM_RFC4648).decode()


def new_id(prefix: str) -> str:
    """A ULID-style id: 48 bits of milliseconds then 80 random bits (26 characters)."""
    ms = int(time.time() * 1000)
    return f"{prefix}_{b32(ms.to_bytes(6, 'big') + os.urandom(10))}"


def _length_prefixed(*parts: str) -> bytes:
    out = bytearray()
    for part in parts:
        raw = part.encode()
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)


def draft_id(tenant_id: str, identity_id: str, idempotency_key: str) -> str:
    """rsv_ + base32(SHA-256) of the three, length-prefixed so no two triples collide (all 52 characters)."""
    return keyed_id("rsv", 52, tenant_id, identity_id, idempotency_key)


def keyed_id(prefix: str, length: int, *parts: str) -> str:
    """An id derived from `parts` (e.g. the kind of call, the caller and its idempotency key):
    `prefix`_ + the first `length` base32 characters of their length-prefixed SHA-256, so a retry
    with the same key names the same row (operator creates, controlplane.admin and tokens)."""
    return f"{prefix}_" + b32(hashlib.sha256(_length_prefixed(*parts)).digest())[:length]


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def request_hash(normalised_request: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(normalised_request).encode()).hexdigest()


def token_hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
