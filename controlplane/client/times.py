"""Times and durations as people type and read them: `+12h`, ISO 8601, local time, `8h`."""

from __future__ import annotations

import datetime
import re
import time

from controlplane.client.errors import UsageError

INT64_MAX = 2**63 - 1
# The most the API's duration text holds: twelve digits of milliseconds (about 31 years).
WIRE_MAX_MS = 999_999_999_999
_UNIT_MS = {"w": 604_800_000, "d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}
_UNIT_ORDER = list(_UNIT_MS)  # largest first
# ASCII: \d and \s would also match digits and spaces of other scripts ("٨h"), which int() reads.
_DURATION = re.compile(r"\s*(?:\d{1,12}\s*(?:ms|[wdhms])\s*)+", re.ASCII)
_PART = re.compile(r"(\d+)\s*(ms|[wdhms])", re.ASCII)


def now_ms() -> int:
    return int(time.time() * 1000)


def parse_moment(flag: str, text: str, *, now: int | None = None) -> int:
    """Epoch milliseconds for `+2h` (from now), ISO 8601 (naive means local time) or epoch ms,
    within the request's 64-bit field (the server checks the range it allows)."""
    text = text.strip()
    try:
        if text.startswith("+"):
            ms = (now_ms() if now is None else now) + parse_duration(flag, text[1:], shown=text)
        elif text.isascii() and text.isdigit():  # not "١٢٣": int() reads other scripts' digits too
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


def parse_duration(flag: str, text: str, *, bare_ms: int = 1, shown: str | None = None) -> int:
    """Milliseconds of a duration as people type it and `list` prints it: `8h`, `90m`, `1h30m`,
    `2d12h`, `1h30m15s`, `250ms` (units largest first, each once; w d h m s ms). A bare number
    counts `bare_ms` each (milliseconds, as the API reads it, unless the option says otherwise).
    Anything else, or more than the API's field holds, is a usage error naming `flag` and quoting
    `shown` (what was typed: `+1h1h` for a relative time), else `text`."""
    shown = text if shown is None else shown
    stripped = text.strip()
    if stripped.isascii() and stripped.isdigit() and len(stripped) <= 12:
        ms = int(stripped) * bare_ms
    elif _DURATION.fullmatch(text) and _in_order(_PART.findall(text)):
        ms = sum(int(number) * _UNIT_MS[unit] for number, unit in _PART.findall(text))
    else:
        raise UsageError(f"{flag} {shown!r}: use a duration such as 8h, 90m, 1h30m or 2d12h")
    if ms > WIRE_MAX_MS:
        raise UsageError(f"{flag} {shown!r}: out of range (at most {fmt_duration(WIRE_MAX_MS)})")
    return ms


def _in_order(parts: list[tuple[str, str]]) -> bool:
    """Each unit once, the largest first (`1h30m`, never `30m1h` nor `1h1h`)."""
    ranks = [_UNIT_ORDER.index(unit) for _, unit in parts]
    return all(a < b for a, b in zip(ranks, ranks[1:], strict=False))


def parse_minutes(flag: str, text: str) -> int:
    """Whole minutes of a duration such as `30m`, `1h` or `1h30m` (a bare number is minutes)."""
    ms = parse_duration(flag, text, bare_ms=60_000)
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
