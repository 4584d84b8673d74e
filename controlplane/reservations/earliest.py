"""Start "earliest" (create) and `startEarliest` (capacity.preview): the earliest start within the
request's horizon at which the whole request fits, found on the capacity index
(controlplane.placement.earliest). When the shared index finds none (its pool not built yet, or a
change it has not heard of), the pool is read from rows in this transaction and searched again, so
"nothing fits" is PostgreSQL's word. A regular request counts live spot work as free from the end
of the pool's notice, as its create would preempt it (`past_spot`)."""

from __future__ import annotations

from typing import Any

import structlog
from psycopg import AsyncConnection

from controlplane.placement import earliest as search_on
from controlplane.placement import gang, preempt
from controlplane.placement.index import PoolIndex, Window
from controlplane.placement.index_sync import read_pool
from controlplane.reservations import placing, preemption
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)


async def caught_up(rt: Runtime) -> None:
    """Wait until the capacity index holds every change committed before now, so the search (and a
    preview's plan) is the one a create would make next: the index may lag a booking committed a
    moment ago. Past preview_index_wait_seconds it plans on the index as it is."""
    if rt.capacity is None or not rt.capacity.ready:
        return
    try:
        await rt.capacity.barrier(timeout=rt.settings.preview_index_wait_seconds)
    except TimeoutError:
        log.warning("capacity index did not catch up in time; searching it as it is")


async def find(conn: AsyncConnection, rt: Runtime, pool_id: str, request: dict[str, Any], now_ms: int) -> int | None:
    """The earliest start of the request (its `horizonMs` from now), or None when none fits, or
    when its searches (the index, the rows, the pool without spot work) spent their one budget of
    node checks (Settings.earliest_max_checks). A regular request may take spot bookings from the
    end of the pool's notice, as its create would (`past_spot`)."""
    window = placing.ask_for({"pool_id": pool_id, "request": {**request, "start": None}}, now_ms).window()
    members = gang.Gang.of(request)
    until = now_ms + request["horizonMs"]
    budget = search_on.Budget(rt.settings.earliest_max_checks)
    try:
        pool = rt.capacity.pool(pool_id) if rt.capacity is not None else None
        found = None
        if pool is not None:
            found = search_on.search(pool, window, now=now_ms, until=until, gang=members, budget=budget)
        if found is None:
            pool = await read_pool(conn, pool_id)
            found = search_on.search(pool, window, now=now_ms, until=until, gang=members, budget=budget)
        if preemption.is_spot(request) or (found is not None and found <= now_ms):
            return found
        return await past_spot(conn, pool, window, members, now_ms, min(found or until, until), found, budget)
    except search_on.BudgetSpent:
        log.warning("earliest-fit search stopped at its budget of node checks", pool_id=pool_id,
                    checks=rt.settings.earliest_max_checks)
        return None


async def past_spot(
    conn: AsyncConnection, pool: PoolIndex, window: Window, members: gang.Gang | None, now_ms: int,
    until: int, found: int | None, budget: search_on.Budget,
) -> int | None:
    """A regular request that fits only at `found` (or nowhere) may start earlier by taking spot
    bookings: never before the end of the pool's notice (the cut: a create that preempts is placed
    from there), and from there as if the live spot work were gone, since its create would preempt
    it (a start at the cut, or later and overlapping it, as a calendar reservation takes the part it
    overlaps). `found` when that is no earlier."""
    cut = now_ms + await preemption.pool_notice_ms(conn, pool.pool_id)
    if found is not None and found <= cut:
        return found
    held = await preempt.read_held(conn, pool.pool_id, cut, until + window.end_ms - window.start_ms)
    if not held:
        return found
    try:
        earlier = search_on.search(preempt.without_spot(pool, held), window, now=cut, until=until, gang=members,
                                   budget=budget)
    except search_on.BudgetSpent:
        return found
    return earlier if earlier is not None else found


async def choose_start(conn: AsyncConnection, rt: Runtime, request: dict[str, Any], now_ms: int) -> dict[str, Any]:
    """The request as stored: with the chosen start, or none when nothing fits within the horizon
    (it then goes pending like any other)."""
    start = await find(conn, rt, request["poolId"], request, now_ms)
    return request if start is None else {**request, "start": start}
