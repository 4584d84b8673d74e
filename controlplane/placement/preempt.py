"""The victim search of preemption (spec "Spot and preemption", DESIGN.md section 9).

A regular (non-spot) reservation that fits nowhere may take spot bookings. Its window then
begins at the end of the pool's notice (`cut`: now plus spot.noticeSeconds, or its own start when
that is later, so a calendar reservation only takes the part of a spot booking that overlaps its
window), and it is placed on the atoms the fewest spot reservations free:

1. The spot bookings overlapping [cut, end) are read under the pool lock, with the reservation
   each belongs to (those begun before the cut are truncated there; one that begins at or after
   the cut loses all its bookings and is released at once). None: nothing to preempt, and the
   pool is not read.
2. The pool is read from rows in this transaction (as gang.plan does when the index finds no room)
   and each node is planned with the normal filters and atom pick as if some of its spot
   reservations were gone: sets of no victim first, then one, then two (at most
   preempt_max_sets_per_node sets per node), so each node's first fitting set is its smallest.
   Past that cap (many small spot reservations) the node's set is found greedily: the fewest of
   the smallest holdings that suffice, then any of them not needed given back.
3. One allocation: the node whose set is smallest, then whose victims hold the fewest bookings
   on every node (a spot gang ends on all its members' nodes), then the best score. A gang: per
   label value, members are picked one by one, each time the node that adds the fewest victims
   not already taken (a spot gang spread over two nodes frees both for the price of one), then
   the best score; the group with the fewest victims (then bookings) wins.
4. `commit` truncates every victim's bookings at the cut (host bookings follow them: migration
   0018's trigger) and commits the plan with the normal commit (the EXCLUDE constraint is still the
   last word), all inside one savepoint: a plan that loses leaves the victims untouched.

Spot never preempts spot, and only spot bookings are ever candidates (the caller checks the
first; the query the second). What happens to the victims (their notice, their end) is the
reservations package's (controlplane.reservations.preemption).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
from psycopg import AsyncConnection

from controlplane.config import Settings
from controlplane.metrics import Metrics
from controlplane.placement import gang as gangs
from controlplane.placement import placer, planner
from controlplane.placement.index import Node, PoolIndex, Window
from controlplane.placement.index_sync import CapacityIndex, read_pool

log = structlog.get_logger(__name__)

DEFAULT_NOTICE_S = 30

# Spot bookings overlapping the preemptor's window, of live spot reservations (begun before the cut
# or not: a spot booking that begins later is preempted whole, or spot could hold off regular work).
SPOT_BOOKINGS = """
SELECT r.id AS reservation_id, a.node_id, b.atom_id,
       epoch_ms(lower(b.during)) AS start_ms, coalesce(epoch_ms(upper(b.during)), 9223372036854775807) AS end_ms
FROM reservations r
JOIN allocations a ON a.reservation_id = r.id AND a.state IN ('placed', 'binding', 'bound')
JOIN bookings b ON b.allocation_id = a.id
WHERE r.pool_id = %(pool_id)s AND r.state IN ('placed', 'binding', 'active') AND r.request @> '{"spot": true}'
  AND b.during && tstzrange(from_epoch_ms(%(cut)s), from_epoch_ms(%(end)s), '[)')
"""

SPOT_HOST_BOOKINGS = """
SELECT a.reservation_id, h.node_id, h.resource, h.amount,
       epoch_ms(lower(h.during)) AS start_ms, coalesce(epoch_ms(upper(h.during)), 9223372036854775807) AS end_ms
FROM host_bookings h JOIN allocations a ON a.id = h.allocation_id
WHERE a.reservation_id = ANY(%(ids)s) AND a.state IN ('placed', 'binding', 'bound')
  AND h.during && tstzrange(from_epoch_ms(%(cut)s), from_epoch_ms(%(end)s), '[)')
"""

# The victims' bookings end at the cut; those that would begin at or after it go.
TRUNCATE_AT_CUT = """
UPDATE bookings b SET during = tstzrange(lower(b.during), from_epoch_ms(%(cut)s), '[)')
FROM allocations a
WHERE a.id = b.allocation_id AND a.reservation_id = ANY(%(ids)s) AND a.state IN ('placed', 'binding', 'bound')
  AND lower(b.during) < from_epoch_ms(%(cut)s)
  AND (upper(b.during) IS NULL OR upper(b.during) > from_epoch_ms(%(cut)s))
"""
DROP_FROM_CUT = """
DELETE FROM bookings b USING allocations a
WHERE a.id = b.allocation_id AND a.reservation_id = ANY(%(ids)s) AND lower(b.during) >= from_epoch_ms(%(cut)s)
"""


def notice_ms(policy: dict | None) -> int:
    """The pool's notice: policy spot.noticeSeconds, default 30 s."""
    seconds = ((policy or {}).get("spot") or {}).get("noticeSeconds") or DEFAULT_NOTICE_S
    return int(seconds) * 1000


@dataclass
class Held:
    """What one spot reservation holds on one node within the window."""

    atoms: dict[str, set[tuple[int, int]]] = field(default_factory=lambda: defaultdict(set))
    host: dict[str, list[tuple[int, int, float]]] = field(default_factory=lambda: defaultdict(list))


@dataclass
class Choice:
    """A preemption to commit: the shifted ask, the victims (reservation ids) and the plan."""

    ask: placer.Ask
    victims: list[str]
    planned: placer.Planned | gangs.GangPlanned

    @property
    def cut_ms(self) -> int:
        return self.ask.start_ms


def shifted(ask: placer.Ask, now_ms: int, notice: int) -> placer.Ask:
    """The preemptor's window: from the later of its start and the end of the notice, full length."""
    cut = max(ask.start_ms, now_ms + notice)
    return dataclasses.replace(ask, start_ms=cut, end_ms=cut + (ask.end_ms - ask.start_ms))


async def plan(
    conn: AsyncConnection, ask: placer.Ask, members: gangs.Gang | None, settings: Settings, *,
    now_ms: int, notice: int,
) -> Choice | None:
    """The cheapest preemption for `ask` (the pool lock must be held), or None."""
    moved = shifted(ask, now_ms, notice)
    held = await read_held(conn, ask.pool_id, moved.start_ms, moved.end_ms)
    if not held:
        return None
    pool = await read_pool(conn, ask.pool_id)
    window = moved.window()
    limit = settings.preempt_max_sets_per_node
    if members is None:
        found = choose_one(pool, window, held, limit)
        if found is None:
            return None
        victims, chosen = found
        node = pool.nodes[chosen.node_id]
        return Choice(moved, victims, placer.Planned(chosen, {a: node.atoms[a].device_uuid for a in chosen.atom_ids}))
    found_gang = choose_gang(pool, window, members, held, limit)
    if found_gang is None:
        return None
    victims, gang_plan = found_gang
    return Choice(moved, victims, gangs.GangPlanned(gang_plan))


async def read_held(conn: AsyncConnection, pool_id: str, cut: int, end: int) -> dict[str, dict[str, Held]]:
    """What each live spot reservation holds on each node within [cut, end): node -> reservation
    -> its bookings (whole intervals, as booked) there."""
    window_params = {"pool_id": pool_id, "cut": cut, "end": end}
    rows = await (await conn.execute(SPOT_BOOKINGS, window_params)).fetchall()
    held: dict[str, dict[str, Held]] = defaultdict(lambda: defaultdict(Held))  # node -> reservation -> held
    if not rows:
        return held
    for r in rows:
        held[r["node_id"]][r["reservation_id"]].atoms[r["atom_id"]].add((r["start_ms"], r["end_ms"]))
    ids = sorted({r["reservation_id"] for r in rows})
    for r in await (await conn.execute(SPOT_HOST_BOOKINGS, {**window_params, "ids": ids})).fetchall():
        held[r["node_id"]][r["reservation_id"]].host[r["resource"]].append(
            (r["start_ms"], r["end_ms"], float(r["amount"])))
    return held


def without_spot(pool: PoolIndex, held: dict[str, dict[str, Held]]) -> PoolIndex:
    """The pool as a regular request sees it from the cut on, when every spot holding in `held` may
    be preempted (earliest fit): those nodes without them. A shallow view: only `nodes` differs,
    so `touched` still names the nodes that held spot work, which only has them checked exactly."""
    view = copy.copy(pool)
    view.nodes = {**pool.nodes}
    for node_id, by_victim in held.items():
        node = pool.nodes.get(node_id)
        if node is not None:
            view.nodes[node_id] = without(node, list(by_victim.values()))
    return view


def without(node: Node, gone: list[Held]) -> Node:
    """`node` as if the holdings `gone` were not booked."""
    if not gone:
        return node
    atoms = dict(node.atoms)
    host_booked = {r: list(v) for r, v in node.host_booked.items()}
    for held in gone:
        for atom_id, intervals in held.atoms.items():
            atom = atoms.get(atom_id)
            if atom is not None:
                atoms[atom_id] = dataclasses.replace(atom, intervals=[i for i in atom.intervals if i not in intervals])
        for resource, entries in held.host.items():
            booked = host_booked.get(resource, [])
            for entry in entries:
                if entry in booked:
                    booked.remove(entry)
    return dataclasses.replace(node, atoms=atoms, host_booked=host_booked)


def weights(held: dict[str, dict[str, Held]]) -> dict[str, int]:
    """Each spot reservation's bookings in the window on every node: what preempting it ends (a
    spot gang's on all its members' nodes)."""
    total: dict[str, int] = defaultdict(int)
    for by_victim in held.values():
        for victim, h in by_victim.items():
            total[victim] += sum(len(i) for i in h.atoms.values())
    return total


def cheapest(
    pool: PoolIndex, node: Node, window: Window, held: dict[str, Held], limit: int,
    weight: dict[str, int] | None = None,
) -> tuple[tuple[str, ...], planner.Plan] | None:
    """The smallest set of the node's spot reservations whose removal lets the window fit there
    (the empty set when it fits as it is), with the plan; None past `limit` sets tried. Among sets
    of one size, those holding fewer bookings (`weight`: on every node; else on this one) are
    tried first."""
    tried = 0
    # The smallest holdings first: among sets of one size, the first that fits takes the least.
    names = sorted(held, key=lambda v: ((weight or {}).get(v, 0), sum(len(i) for i in held[v].atoms.values()), v))
    for k in range(len(names) + 1):
        for combo in itertools.combinations(names, k):
            tried += 1
            if tried > limit:
                return few_enough(pool, node, window, held, names)
            chosen = plan_without(pool, node, window, held, combo)
            if chosen is not None:
                return combo, chosen
    return None


def plan_without(
    pool: PoolIndex, node: Node, window: Window, held: dict[str, Held], gone: Sequence[str]
) -> planner.Plan | None:
    stripped = without(node, [held[v] for v in gone])
    if not stripped.host_fits(window):
        return None
    return planner.plan_node(pool.candidate(stripped, window), window.count, window.topology)


def few_enough(
    pool: PoolIndex, node: Node, window: Window, held: dict[str, Held], names: list[str]
) -> tuple[tuple[str, ...], planner.Plan] | None:
    """Past the cap on sets (many small spot reservations, such as one per slot): the shortest
    run of `names` (smallest holdings first) whose removal lets the window fit, found by halving
    (taking more never fits less), then each of it given back, the largest first, when the rest
    still suffices. A set with nothing to spare, if not always the smallest, in O(log n + k) plans."""
    if not names or plan_without(pool, node, window, held, names) is None:
        return None
    lo, hi = 1, len(names)
    while lo < hi:
        mid = (lo + hi) // 2
        if plan_without(pool, node, window, held, names[:mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    taken = names[:lo]
    for victim in reversed(names[:lo]):
        rest = [v for v in taken if v != victim]
        if rest and plan_without(pool, node, window, held, rest) is not None:
            taken = rest
    chosen = plan_without(pool, node, window, held, taken)
    return (tuple(taken), chosen) if chosen is not None else None


def choose_one(
    pool: PoolIndex, window: Window, held: dict[str, dict[str, Held]], limit: int
) -> tuple[list[str], planner.Plan] | None:
    """One allocation: the node with the fewest victims, then the fewest of their bookings (on
    every node: a spot gang ends on all its members'), then the best score."""
    weight = weights(held)
    best: tuple[tuple[int, int, float], list[str], planner.Plan] | None = None
    for node_id in sorted(held):
        node = pool.nodes.get(node_id)
        if node is None or not node.matches(window):
            continue
        found = cheapest(pool, node, window, held[node_id], limit, weight)
        if found is None:
            continue
        key = (len(found[0]), sum(weight[v] for v in found[0]), -found[1].score)
        if best is None or key < best[0]:
            best = (key, list(found[0]), found[1])
    if best is None or not best[1]:
        return None  # fits as it is: not refused for lack of room, so nothing to take
    return best[1], best[2]


def choose_gang(
    pool: PoolIndex, window: Window, members: gangs.Gang, held: dict[str, dict[str, Held]], limit: int
) -> tuple[list[str], gangs.GangPlan] | None:
    """A gang: per label value, members picked greedily by the victims they add; fewest wins
    (then the fewest of their bookings)."""
    weight = weights(held)
    by_group: dict[str, list[tuple[frozenset[str], planner.Plan]]] = defaultdict(list)
    for node in pool.nodes.values():
        if not node.matches(window):
            continue
        group = gangs.label_value(node.labels, members.key) if members.key else ""
        if group is None:
            continue
        found = cheapest(pool, node, window, held.get(node.id, {}), limit, weight)
        if found is not None:
            by_group[group].append((frozenset(found[0]), found[1]))
    best: tuple[tuple[int, int, float, str], set[str], list[planner.Plan]] | None = None
    for group, options in sorted(by_group.items()):
        if len(options) < members.size:
            continue
        taken: set[str] = set()
        picked: list[planner.Plan] = []
        left = list(options)
        while len(picked) < members.size:
            i = min(range(len(left)), key=lambda j: (len(left[j][0] - taken), -left[j][1].score, left[j][1].node_id))
            victims, chosen = left.pop(i)
            taken |= victims
            picked.append(chosen)
        key = (len(taken), sum(weight[v] for v in taken), -sum(p.score for p in picked), group)
        if best is None or key < best[0]:
            best = (key, taken, picked)
    if best is None or not best[1]:
        return None  # nothing to preempt (a gang that fits as it is was not refused for lack of room)
    group = best[0][3]
    uuids = {a: pool.nodes[p.node_id].atoms[a].device_uuid for p in best[2] for a in p.atom_ids}
    return sorted(best[1]), gangs.GangPlan(group, tuple(best[2]), uuids)


class _Lost(Exception):
    """The preemptor's plan did not commit: the savepoint rolls the victims' truncation back."""


async def commit(
    conn: AsyncConnection, choice: Choice, reservation_id: str, members: gangs.Gang | None, settings: Settings, *,
    index: CapacityIndex | None, metrics: Metrics | None,
) -> list[str]:
    """Truncate the victims at the cut and commit the plan, in one savepoint (the pool lock and the
    victims' rows must be held). The nodes placed on, or [] when the plan lost (nothing changed)."""
    params = {"ids": choice.victims, "cut": choice.cut_ms}
    try:
        async with conn.transaction():
            await conn.execute(TRUNCATE_AT_CUT, params)
            await conn.execute(DROP_FROM_CUT, params)
            if isinstance(choice.planned, gangs.GangPlanned):
                assert members is not None
                committed = await gangs.commit(conn, choice.ask, members, reservation_id, choice.planned, settings,
                                               index=index, metrics=metrics)
                node_ids = committed.node_ids
            else:
                placement = await placer.commit(conn, choice.ask, reservation_id, choice.planned, settings,
                                                metrics=metrics, index=index)
                node_ids = [placement.node_id] if placement else []
            if not node_ids:
                raise _Lost
    except _Lost:
        log.info("preemption plan lost", reservation_id=reservation_id, victims=choice.victims)
        return []
    return node_ids
