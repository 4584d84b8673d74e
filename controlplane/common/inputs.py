"""Generic checks of every request, before any servicer sees it (DESIGN.md section 7a), and of
every message a node sends (controlplane.nodes.wire, with its own limits).

A request is decoded here, not by grpc, so bytes that are not the message (truncated, invalid
UTF-8) are INVALID_INPUT with ErrorInfo rather than a bare UNKNOWN. Then every string of the
message and its nested messages is refused with a NUL or beyond a length, and every repeated and
map field beyond a number of entries. Per-field patterns stay with the domain validation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from controlplane import errors
from controlplane.common.names import shown_key
from controlplane.config import Settings

# Fields with a cap of their own (longer than the generic one), by full protobuf name.
_POLICY_TEXT = frozenset({"bettercompute.v1.PutPolicyRequest.cedar"})


@dataclass(frozen=True)
class InputLimits:
    max_string_chars: int = 4096
    max_policy_chars: int = 65536
    max_entries: int = 64
    bytes_capped: bool = True  # bytes fields at most max_string_chars too (a node's have bounds of their own)

    @classmethod
    def of(cls, settings: Settings) -> InputLimits:
        return cls(settings.max_string_chars, settings.max_policy_chars, settings.max_list_entries)


def decode(deserializer: Callable[[bytes], Any] | None, raw: Any, field: str = "request") -> Any:
    """The message from its bytes; INVALID_INPUT naming `field` when they are not one."""
    if deserializer is None or not isinstance(raw, bytes | bytearray | memoryview):
        return raw
    try:
        return deserializer(bytes(raw))
    except Exception:
        raise errors.InvalidInput(field, "cannot be decoded (malformed protobuf or invalid UTF-8)") from None


def check(message: Message, limits: InputLimits, prefix: str = "") -> None:
    """Raise INVALID_INPUT naming the first field that breaks a generic limit."""
    for fd, value in message.ListFields():
        name = f"{prefix}.{fd.json_name}" if prefix else fd.json_name
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            _count(name, value, limits)
            key_fd = fd.message_type.fields_by_name["key"]
            value_fd = fd.message_type.fields_by_name["value"]
            for key in value:
                path = f"{name}[{shown_key(key)}]"
                _scalar(path, key_fd, key, limits)
                _item(path, value_fd, value[key], limits)
        elif fd.is_repeated:
            _count(name, value, limits)
            for i, item in enumerate(value):
                _item(f"{name}[{i}]", fd, item, limits)
        else:
            _item(name, fd, value, limits)


def _count(name: str, value: Any, limits: InputLimits) -> None:
    if len(value) > limits.max_entries:
        raise errors.InvalidInput(name, f"has at most {limits.max_entries} entries")


def _item(path: str, fd: FieldDescriptor, value: Any, limits: InputLimits) -> None:
    if fd.message_type is not None:
        check(value, limits, path)
    else:
        _scalar(path, fd, value, limits)


def _scalar(path: str, fd: FieldDescriptor, value: Any, limits: InputLimits) -> None:
    if fd.type == FieldDescriptor.TYPE_STRING:
        if "\x00" in value:
            raise errors.InvalidInput(path, "must not contain NUL characters")
        cap = limits.max_policy_chars if fd.full_name in _POLICY_TEXT else limits.max_string_chars
        if len(value) > cap:
            raise errors.InvalidInput(path, f"is at most {cap} characters")
    elif fd.type == FieldDescriptor.TYPE_BYTES and limits.bytes_capped and len(value) > limits.max_string_chars:
        raise errors.InvalidInput(path, f"is at most {limits.max_string_chars} bytes")
