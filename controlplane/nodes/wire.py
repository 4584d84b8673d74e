"""What a node sends, decoded and checked before the gateway acts on it (DESIGN.md section 7a):
bytes that are not the message (truncated, invalid UTF-8) are INVALID_INPUT with ErrorInfo, not a
bare UNKNOWN or INTERNAL. Unknown fields stay allowed: a newer daemon may send them (N-2 skew)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controlplane import errors


def decode(deserializer: Callable[[bytes], Any] | None, raw: Any) -> Any:
    """The message from its bytes; INVALID_INPUT when they are not one."""
    if deserializer is None or not isinstance(raw, bytes | bytearray | memoryview):
        return raw
    try:
        return deserializer(bytes(raw))
    except Exception:
        raise errors.InvalidInput("message", "cannot be decoded (malformed protobuf or invalid UTF-8)") from None
