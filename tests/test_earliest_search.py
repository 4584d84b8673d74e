"""The earliest-fit search on the capacity index (controlplane.placement.earliest) against brute
force: on random small pools with random bookings, the start it answers is the first instant, tried
one by one, at which the request (or a gang of it) fits, or None when no instant in the horizon does."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.placement import earliest
from controlplane.placement.gang import Gang, label_value
from controlplane.placement.index import Atom, Node, PoolIndex, Window


def _node(i: int, atoms: int, domains: int, group: str, booked: list[list[tuple[int, int]]],
          host: int | None, host_booked: list[tuple[int, int, float]]) -> Node:
    node = Node(f"n{i}", "p", f"n{i}", {"g": {"value": group, "source": "system"}}, frozenset(), "ready", "connected")
    for a in range(atoms):
        intervals = sorted(booked[a]) if a < len(booked) else []
        node.atoms[f"a{i}-{a}"] = Atom(f"a{i}-{a}", node.id, "gpu", f"u{i}-{a}", "H100", a % 2,
                                       f"d{i}-{a % domains}", True, True, intervals)
    if host is not None:
        node.host = {"vcpu": float(host)}
        node.host_booked = {"vcpu": sorted(host_booked)}
    return node


def _disjoint(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, last = [], -1
    for s, length in sorted(pairs):
        if s >= last:
            out.append((s, s + length))
            last = s + length
    return out


INTERVALS = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=4).map(_disjoint)
NODES = st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from(["x", "y"]),
                           st.lists(INTERVALS, max_size=4), st.sampled_from([None, 4, 8]),
                           st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.sampled_from([2.0, 4.0])),
                                    max_size=3).map(lambda bs: [(s, s + n, a) for s, n, a in bs])),
                 min_size=1, max_size=5)


def _fits_gang(pool: PoolIndex, window: Window, gang: Gang | None) -> bool:
    fitting = [n for n in pool.nodes.values() if earliest.could_fit(n, window) and earliest.fits_on(pool, n, window)]
    if gang is None:
        return bool(fitting)
    groups = Counter(label_value(n.labels, gang.key) if gang.key else "" for n in fitting)
    return any(count >= gang.size for group, count in groups.items() if group is not None)


@settings(max_examples=300, deadline=None)
@given(nodes=NODES, count=st.sampled_from([1, 2, 4]), topology=st.sampled_from(["any", "nvlink-all", "numa"]),
       length=st.integers(1, 20), vcpu=st.sampled_from([0, 0, 3]), gang=st.sampled_from([None, 2, 3]),
       key=st.sampled_from(["", "g"]), now=st.integers(0, 10), horizon=st.integers(0, 50))
def test_search_answers_the_first_instant_that_fits(nodes, count, topology, length, vcpu, gang, key, now,
                                                     horizon) -> None:
    pool = PoolIndex("p")
    for i, spec in enumerate(nodes):
        pool.put(_node(i, *spec))
    host = (("vcpu", vcpu),) if vcpu else ()
    window = Window(count, topology, "", {}, now, now + length, host=host)
    members = Gang(gang, key) if gang else None
    found = earliest.search(pool, window, now=now, until=now + horizon, gang=members)
    brute = next((t for t in range(now, now + horizon + 1)
                  if _fits_gang(pool, Window(count, topology, "", {}, t, t + length, host=host), members)), None)
    assert found == brute
