"""Durations on the wire: "8h", "90m", "3d", "7200s", "250ms", or a number of milliseconds."""

from __future__ import annotations

import re

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
# ASCII: \d and \s would also match digits and spaces of other scripts ("٨h"), which int() reads.
_PATTERN = re.compile(r"\s*(\d{1,12})\s*(ms|s|m|h|d|w)?\s*", re.ASCII)


def parse_duration_ms(text: str) -> int:
    """Milliseconds for `text`; a bare number is milliseconds. Raises ValueError."""
    match = _PATTERN.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration such as '8h', '90m', '3d' or milliseconds")
    number, unit = match.groups()
    return int(number) * _UNITS_MS[unit or "ms"]


def format_duration_ms(ms: int) -> str:
    return f"{ms}ms"
