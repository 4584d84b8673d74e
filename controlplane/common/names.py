"""Id and name patterns, each matched against the whole value (`match`), and how a map key is
shown in a field path. Every layer validates names with these; none defines its own copy."""

from __future__ import annotations

import re

from controlplane import errors

TENANT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
IDENTITY_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
POOL_ID = re.compile(r"^pool_[0-9a-hjkmnp-tv-z]{26,52}$")
NODE_ID = re.compile(r"^node_[0-9a-hjkmnp-tv-z]{26}$")
RESERVATION_ID = re.compile(r"^rsv_[0-9a-hjkmnp-tv-z]{26,52}$")
NODE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
LABEL = re.compile(r"^[A-Za-z0-9._/-]{1,128}$")
MODEL = re.compile(r"^[A-Za-z0-9._-]{0,64}$")
# A GPU's uuid as a node reports it ("GPU-8c1f…"). No ':': its MIG instances and slots are named
# "<uuid>:<n>", so a GPU named "<other uuid>:0" would carry another GPU's instance id.
GPU_UUID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
# A MIG profile as NVIDIA names it: "1g.10gb", "3g.40gb", "1g.10gb+me", "1c.3g.40gb".
MIG_PROFILE = re.compile(r"^[0-9a-z][0-9a-z.+]{0,31}$")

_KEY_SHOWN = 40  # characters of a map key shown in a field path


def match(field: str, value: str, pattern: re.Pattern[str]) -> str:
    """`value` when the whole of it matches `pattern` (a trailing newline does not)."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise errors.InvalidInput(field, f"must match {pattern.pattern}")
    return value


def shown_key(key: object) -> str:
    """A map key as it appears in a field path: bounded, so an error never echoes a huge key."""
    text = str(key)
    return repr(text if len(text) <= _KEY_SHOWN else text[:_KEY_SHOWN] + "…")
