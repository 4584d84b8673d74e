"""What a node sends, decoded and checked before the gateway acts on it (DESIGN.md section 7a):
bytes that are not the message (truncated, invalid UTF-8) are INVALID_INPUT with ErrorInfo, not a
bare UNKNOWN or INTERNAL; so is a string with a NUL (PostgreSQL stores none) or beyond
BC_NODE_MAX_STRING_CHARS, and a repeated field beyond BC_NODE_MAX_ENTRIES (a hello of 100,000
NUMA nodes, each cpulist parsed, stalled the gateway's loop for minutes), naming the field.
The checks are the API's (controlplane.common.inputs) with the node's limits; bytes fields keep
the bounds of their own (a report's body, controlplane.nodes.reports). Unknown fields stay
allowed: a newer daemon may send them (N-2 skew)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from controlplane.common import inputs
from controlplane.config import Settings

_BOUNDS = Settings()  # read once, from the environment (README "Limits")
LIMITS = inputs.InputLimits(max_string_chars=_BOUNDS.node_max_string_chars,
                            max_policy_chars=_BOUNDS.node_max_string_chars,
                            max_entries=_BOUNDS.node_max_entries, bytes_capped=False)


def decode(deserializer: Callable[[bytes], Any] | None, raw: Any) -> Any:
    """The checked message from its bytes; INVALID_INPUT when they are not one or it breaks a bound."""
    message = inputs.decode(deserializer, raw, field="message")
    if message is not raw:
        check(message)
    return message


def check(message: Message) -> None:
    """Raise INVALID_INPUT naming the first field of `message` (nested ones too) beyond a bound:
    a repeated one with too many entries, a string with a NUL or too long."""
    inputs.check(message, LIMITS)
