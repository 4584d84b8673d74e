"""A listing page that leaves out the rows its caller may not read, reading on past them.

Reservations.List and Webhooks.ListDeliveries each read rows in key order and leave out the ones
IAM refuses (a listing tells no more than reading its items would). A page of refused rows must
not end the listing, nor may a tenant of refused rows make one call read without end: the reader
goes on past them, up to a number of rows examined, and a page cut short there ends with the
cursor to go on from.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

Cursor = TypeVar("Cursor")
Row = dict[str, Any]


async def filtered(rows: list[Row], more: Callable[[Cursor], Awaitable[list[Row]]],
                   allowed: Callable[[list[Row]], list[bool]], key: Callable[[Row], Cursor], *,
                   limit: int, cap: int, end: Cursor) -> tuple[list[Row], Cursor]:
    """Up to `limit` rows that `allowed` passes (one decision per read), and the cursor after the
    last row examined, or `end` when none are left. `rows` is the first read; `more(cursor)` reads
    the `limit` rows after `cursor` (the key of the last row read). At most about `cap` rows are
    examined."""
    page: list[Row] = []
    examined = 0
    while True:
        for row, ok in zip(rows, allowed(rows)):
            if ok:
                page.append(row)
                if len(page) == limit:
                    return page, key(row)
        if len(rows) < limit:
            return page, end
        examined += len(rows)
        cursor = key(rows[-1])
        if examined >= cap:
            return page, cursor
        rows = await more(cursor)
