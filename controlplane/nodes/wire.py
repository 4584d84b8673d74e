"""What a node sends, decoded and checked before the gateway acts on it (DESIGN.md section 7a):
bytes that are not the message (truncated, invalid UTF-8) are INVALID_INPUT with ErrorInfo, not a
bare UNKNOWN or INTERNAL; so is a string with a NUL (PostgreSQL stores none) or beyond
BC_NODE_MAX_STRING_CHARS, and a repeated field beyond BC_NODE_MAX_ENTRIES (a hello of 100,000
NUMA nodes, each cpulist parsed, stalled the gateway's loop for minutes), naming the field.
Unknown fields stay allowed: a newer daemon may send them (N-2 skew)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from controlplane import errors
from controlplane.config import Settings

_BOUNDS = Settings()  # read once, from the environment (README "Limits")
MAX_STRING_CHARS = _BOUNDS.node_max_string_chars
MAX_ENTRIES = _BOUNDS.node_max_entries


def decode(deserializer: Callable[[bytes], Any] | None, raw: Any) -> Any:
    """The checked message from its bytes; INVALID_INPUT when they are not one or it breaks a bound."""
    if deserializer is None or not isinstance(raw, bytes | bytearray | memoryview):
        return raw
    try:
        message = deserializer(bytes(raw))
    except Exception:
        raise errors.InvalidInput("message", "cannot be decoded (malformed protobuf or invalid UTF-8)") from None
    check(message)
    return message


def check(message: Message, prefix: str = "") -> None:
    """Raise INVALID_INPUT naming the first field of `message` (nested ones too) beyond a bound:
    a repeated one with too many entries, a string with a NUL or too long."""
    for fd, value in message.ListFields():
        name = f"{prefix}.{fd.json_name}" if prefix else fd.json_name
        if fd.is_repeated and len(value) > MAX_ENTRIES:
            raise errors.InvalidInput(name, f"has at most {MAX_ENTRIES} entries")
        items = [(f"{name}[{i}]", v) for i, v in enumerate(value)] if fd.is_repeated else [(name, value)]
        for path, item in items:
            if fd.message_type is not None:
                check(item, path)
            elif fd.type == FieldDescriptor.TYPE_STRING:
                if "\x00" in item:
                    raise errors.InvalidInput(path, "must not contain NUL characters")
                if len(item) > MAX_STRING_CHARS:
                    raise errors.InvalidInput(path, f"is at most {MAX_STRING_CHARS} characters")
