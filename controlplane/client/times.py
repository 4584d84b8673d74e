"""Times and durations as people type and read them: `+12h`, ISO 8601, local time, `8h`."""

from __future__ import annotations

import datetime
import time

from controlplane.client.errors import UsageError
from controlplane.durations import parse_duration_ms

INT64_MAX = 2**63 - 1


def now_ms() -> int:
    return int(time.time() * 1000)


def parse_moment(flag: str, text: str, *, now: int | None = None) -> int:
    """Epoch milliseconds for `+2h` (from now), ISO 8601 (naive means local time) or epoch ms,
    within the request's 64-bit field (the server checks the range it allows)."""
    text = text.strip()
    try:
        if text.startswith("+"):
            ms = (now_ms() if now is None else now) + parse_duration_ms(text[1:])
        elif text.isdigit():
            ms = int(text)
        else:
            moment = datetime.datetime.fromisoformat(text)
            if moment.tzinfo is None:
                moment = moment.astimezone()
            ms = int(moment.timestamp() * 1000)
    except (ValueError, OverflowError):  # OverflowError: the year 1 in local time
        raise UsageError(f"{flag} {text!r}: use +2h, ISO 8601 or epoch milliseconds") from None
    if not -INT64_MAX - 1 <= ms <= INT64_MAX:
        raise UsageError(f"{flag} {text!r}: out of range")
    return ms


def parse_minutes(flag: str, text: str) -> int:
    """Whole minutes of a duration such as `30m` or `1h` (a bare number is minutes)."""
    try:
        ms = int(text) * 60_000 if text.strip().isdigit() else parse_duration_ms(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: use a duration such as 30m or 1h") from None
    if ms // 60_000 > 2**31 - 1:  # the request's 32-bit field (the server allows 5 to 1440)
        raise UsageError(f"{flag} {text!r}: out of range")
    return ms // 60_000


_UNITS = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000))


def fmt_duration(ms: int) -> str:
    """`8h`, `1h30m`, `3d`, `45s`: the two largest non-zero units."""
    if ms <= 0:
        return "0s"
    parts = []
    for unit, size in _UNITS:
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
        if len(parts) == 2:
            break
    return "".join(parts) or f"{ms}ms"


def fmt_time(ms: int, *, with_date: bool = True, seconds: bool = False) -> str:
    """Local time, e.g. `2026-12-01 10:00 CET` (`10:00` without the date)."""
    moment = datetime.datetime.fromtimestamp(ms / 1000).astimezone()
    clock = "%H:%M:%S" if seconds else "%H:%M"
    return moment.strftime(f"%Y-%m-%d {clock} %Z" if with_date else clock)
