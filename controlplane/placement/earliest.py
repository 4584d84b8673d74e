"""Earliest fit (DESIGN.md section 9): the earliest start within a horizon at which a request (a
gang too) fits for its whole length, searched on the capacity index without reading PostgreSQL.

Why only a few starts are tried: if a request fits on a node from t, and t is neither now nor the
end of one of that node's bookings, it also fits a little earlier (moving the window earlier frees
its tail and takes nothing booked at its head). So the earliest start is now or the end of a
booking, and a node becomes able to take the request only at the end of one of its own bookings.

- One node: each node's next start worth trying is kept in a heap, tried in order; the first node
  that fits answers. After a miss the node's next start is a lower bound from its atoms' gaps (the
  count-th earliest time an atom is free for the whole length, itself a booking's end), so a node
  booked back to back is skipped past in one step. Only nodes that could ever fit (labels,
  schedulable, enough usable atoms in the asked topology, enough host resources) are visited.
- A gang: every node walks its own starts worth trying in one heap; a node that fits joins its
  group's ready set, and a group with enough ready nodes is checked at that start.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import Counter, defaultdict
from collections.abc import Iterator

from controlplane.placement import planner
from controlplane.placement.gang import Gang, label_value
from controlplane.placement.index import Node, PoolIndex, Window


def _at(window: Window, start: int) -> Window:
    return dataclasses.replace(window, start_ms=start, end_ms=start + window.end_ms - window.start_ms)


# Whether a node could take a request's shape when idle depends only on the node object (the index
# replaces it whenever it re-reads the node) and the shape: remembered, as gang planning does.
_IDLE_FITS: dict[tuple[str, int, str, str, str, str], tuple[Node, bool]] = {}
_IDLE_FITS_MAX = 500_000


def could_fit(node: Node, window: Window) -> bool:
    """The node takes the request when nothing is booked on it: labels, state, usable atoms in the
    asked topology, host resources."""
    if not node.matches(window):
        return False
    if any(node.host.get(r, 0.0) < amount for r, amount in window.host):
        return False
    key = (node.id, window.count, window.topology, window.model, window.device_class, window.profile)
    cached = _IDLE_FITS.get(key)
    if cached is not None and cached[0] is node:
        return cached[1]
    if len(node.usable_sorted(window.model, window.device_class, window.profile)) < window.count:
        return False  # not remembered: a model or profile made up would fill the cache
    fits = planner.plan_node(node.all_free(window), window.count, window.topology) is not None
    if len(_IDLE_FITS) >= _IDLE_FITS_MAX:
        _IDLE_FITS.clear()
    _IDLE_FITS[key] = (node, fits)
    return fits


def _free_from(intervals: list[tuple[int, int]], after: int, length: int) -> int:
    """The earliest t >= after at which an atom with these (sorted, disjoint) intervals is free for
    [t, t + length)."""
    i = bisect.bisect_right(intervals, (after, float("inf")))
    if i > 0 and intervals[i - 1][1] > after:
        i -= 1
    t = after
    for k in range(i, len(intervals)):
        start, end = intervals[k]
        if start >= t + length:
            break
        t = end  # disjoint and sorted: each end is past the last, and the first past `after`
    return t


def _lower_bound(node: Node, window: Window, after: int) -> int:
    """No start before this can fit on the node: before it fewer than `count` of its usable atoms
    are each free for the window's length (topology and host resources only add to that)."""
    length = window.end_ms - window.start_ms
    free = sorted(_free_from(a.intervals, after, length)
                  for a in node.usable(window.model, window.device_class, window.profile))
    return free[window.count - 1] if len(free) >= window.count else 1 << 62


class BudgetSpent(Exception):
    """The search made as many node checks as it may (Settings.earliest_max_checks)."""


class Budget:
    """Node checks left (None: no cap); one request's searches may share one."""

    def __init__(self, checks: int | None) -> None:
        self.left = checks

    def spend(self) -> None:
        if self.left is not None:
            if self.left <= 0:
                raise BudgetSpent
            self.left -= 1


def fits_on(pool: PoolIndex, node: Node, window: Window, budget: Budget | None = None) -> bool:
    """The request fits on the node for exactly this window."""
    if budget is not None:
        budget.spend()
    return node.host_fits(window) and planner.plan_node(
        pool.candidate(node, window), window.count, window.topology) is not None


def _ends(node: Node, window: Window, after: int, until: int) -> Iterator[int]:
    """The ends of the node's bookings (its usable atoms' and its host resources') in (after, until],
    ascending, each once."""
    streams: list[Iterator[int]] = []
    for atom in node.usable(window.model, window.device_class, window.profile):
        i = bisect.bisect_right(atom.intervals, (after, float("inf")))
        while i > 0 and atom.intervals[i - 1][1] > after:  # begun by `after`, ending after it
            i -= 1
        streams.append(e for _, e in atom.intervals[i:] if after < e <= until)
    if window.host:
        ends = {b[1] for r, _ in window.host for b in node.host_booked.get(r, ()) if after < b[1] <= until}
        streams.append(iter(sorted(ends)))
    last = None
    for end in heapq.merge(*streams):
        if end != last:
            yield end
            last = end


def search(
    pool: PoolIndex, window: Window, *, now: int, until: int, gang: Gang | None = None,
    exclude: frozenset[str] = frozenset(), budget: Budget | None = None,
) -> int | None:
    """The earliest start in [now, until] at which the request fits for the window's length, or
    None when none does. Past what `budget` has left (None: no cap; one request's searches share
    one) it gives up: BudgetSpent."""
    budget = budget if budget is not None else Budget(None)
    eligible = [n for n in pool.nodes.values() if n.id not in exclude and could_fit(n, window)]
    if gang is not None:
        return _search_gang(pool, window, eligible, now, until, gang, budget)
    if not eligible:
        return None
    first = _at(window, now)
    busy = pool.touched(first.start_ms, first.end_ms)
    if any(n.id not in busy and n.host_fits(first) for n in eligible):  # no device booked in the window
        return now
    # Each node's next start worth trying: a lower bound from its atoms' free gaps (itself the end
    # of a booking), or, when that bound does not move (topology or host resources failed), the
    # next end of any of its bookings.
    heap: list[tuple[int, str]] = []
    for node in eligible:
        bound = _lower_bound(node, window, now)
        if bound <= now:  # enough atoms free now: planned exactly
            if fits_on(pool, node, first, budget):
                return now
            bound = next(_ends(node, window, now, until), 1 << 62)
        if bound <= until:
            heap.append((bound, node.id))
    heapq.heapify(heap)
    while heap:
        start, node_id = heap[0]
        node = pool.nodes[node_id]
        if fits_on(pool, node, _at(window, start), budget):
            return start
        nxt = _next_start(node, window, start, until)
        if nxt is None:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (nxt, node_id))
    return None


def _next_start(node: Node, window: Window, failed: int, until: int) -> int | None:
    """The next start after `failed` (where the request did not fit) worth trying on the node."""
    bound = _lower_bound(node, window, failed)
    if bound <= failed:
        bound = next(_ends(node, window, failed, until), 1 << 62)
    return bound if bound <= until else None


def _search_gang(
    pool: PoolIndex, window: Window, eligible: list[Node], now: int, until: int, gang: Gang, budget: Budget
) -> int | None:
    """The earliest start at which `size` nodes of one group fit together. The gang's earliest start
    is a start at which one member begins to fit, so each node walks its own starts worth trying
    (as for one node) in one heap; a node that fits joins its group's `ready` set, and when that set
    is large enough its members are checked at that start (those that no longer fit leave it)."""
    group_of: dict[str, str] = {}
    for node in eligible:
        group = label_value(node.labels, gang.key) if gang.key else ""
        if group is not None:
            group_of[node.id] = group
    sizes = Counter(group_of.values())
    group_of = {n: g for n, g in group_of.items() if sizes[g] >= gang.size}
    ready: dict[str, set[str]] = defaultdict(set)
    heap: list[tuple[int, str]] = []

    def advance(node: Node, start: int, fitted: bool) -> None:
        # After a fit the node may still fit later: its next booking end; after a miss, its bound.
        nxt = next(_ends(node, window, start, until), None) if fitted else _next_start(node, window, start, until)
        if nxt is not None and nxt <= until:
            heapq.heappush(heap, (nxt, node.id))

    def together(group: str, start: int) -> bool:
        w = _at(window, start)
        for member in list(ready[group]):
            if not fits_on(pool, pool.nodes[member], w, budget):
                ready[group].discard(member)  # its heap entry stays: a later start may fit again
        return len(ready[group]) >= gang.size

    first = _at(window, now)
    for node_id, group in group_of.items():
        node = pool.nodes[node_id]
        fitted = fits_on(pool, node, first, budget)
        if fitted:
            ready[group].add(node_id)
        advance(node, now, fitted)
    if any(len(members) >= gang.size for members in ready.values()):
        return now
    while heap:
        start, node_id = heapq.heappop(heap)
        node, group = pool.nodes[node_id], group_of[node_id]
        if fits_on(pool, node, _at(window, start), budget):
            ready[group].add(node_id)
            advance(node, start, True)
            if len(ready[group]) >= gang.size and together(group, start):
                return start
        else:
            ready[group].discard(node_id)
            advance(node, start, False)
    return None
