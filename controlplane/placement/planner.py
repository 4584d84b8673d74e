"""Per-node planning, in pure Python: atom pick by topology, a bin-pack score, a random top-N pick.

Nothing here touches the database, so the rules are easy to test with hypothesis.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ANY = "any"
NVLINK_ALL = "nvlink-all"
NUMA = "numa"
TOPOLOGIES = frozenset({ANY, NVLINK_ALL, NUMA})


@dataclass(frozen=True)
class FreeAtom:
    id: str
    numa_node: int
    nvlink_domain: str


@dataclass(frozen=True)
class Candidate:
    node_id: str
    node_name: str
    free: tuple[FreeAtom, ...]


@dataclass(frozen=True)
class Plan:
    node_id: str
    atom_ids: tuple[str, ...]
    score: float


def _groups(free: Sequence[FreeAtom], topology: str) -> list[list[FreeAtom]]:
    if topology == ANY:
        return [list(free)]
    grouped: dict[object, list[FreeAtom]] = defaultdict(list)
    for atom in free:
        if topology == NVLINK_ALL:
            if atom.nvlink_domain:  # a GPU outside any NVLink domain never satisfies nvlink-all
                grouped[atom.nvlink_domain].append(atom)
        else:
            grouped[atom.numa_node].append(atom)
    return list(grouped.values())


def largest_group(free: Sequence[FreeAtom], topology: str) -> int:
    """The most atoms one plan for `topology` could take from `free`."""
    return max((len(g) for g in _groups(free, topology)), default=0)


def _fits_one_numa(group: list[FreeAtom], count: int) -> bool:
    per_numa: dict[int, int] = defaultdict(int)
    for atom in group:
        per_numa[atom.numa_node] += 1
    return max(per_numa.values(), default=0) >= count


def _pick_in_group(group: list[FreeAtom], count: int) -> tuple[str, ...]:
    """Take `count` atoms, filling from the NUMA node that holds the most free atoms first, so a
    request lands on one NUMA node whenever one can hold it."""
    by_numa: dict[int, list[FreeAtom]] = defaultdict(list)
    for atom in group:
        by_numa[atom.numa_node].append(atom)
    fitting = [atoms for atoms in by_numa.values() if len(atoms) >= count]
    if fitting:
        # The tightest NUMA node that fits whole keeps larger NUMA nodes free for larger requests.
        best = min(fitting, key=lambda atoms: (len(atoms), atoms[0].numa_node))
        return tuple(a.id for a in sorted(best, key=lambda a: a.id)[:count])
    ordered = sorted(by_numa.values(), key=lambda atoms: (-len(atoms), atoms[0].numa_node))
    chosen = [a for atoms in ordered for a in sorted(atoms, key=lambda a: a.id)]
    return tuple(a.id for a in chosen[:count])


def _best_group(candidate: Candidate, count: int, topology: str) -> tuple[list[FreeAtom], float] | None:
    """The group of free atoms the node would give from, and the plan's score; None when it
    cannot satisfy the request.

    Bin-pack score: the fewer free atoms left on the node (and in the chosen group) afterwards,
    the better, so large requests keep finding whole nodes.
    """
    if len(candidate.free) < count:
        return None
    groups = [g for g in _groups(candidate.free, topology) if len(g) >= count]
    if not groups:
        return None
    # Prefer a group that can hold the request on one NUMA node, then the tightest group.
    group = groups[0] if len(groups) == 1 else min(
        groups, key=lambda g: (not _fits_one_numa(g, count), len(g), min(a.id for a in g)))
    left_on_node = len(candidate.free) - count
    left_in_group = len(group) - count
    return group, -(left_on_node * 1000 + left_in_group)


def fits_node(candidate: Candidate, count: int, topology: str) -> bool:
    """Whether plan_node would find a plan (without picking its atoms)."""
    return _best_group(candidate, count, topology) is not None


def plan_node(candidate: Candidate, count: int, topology: str) -> Plan | None:
    """The atoms this node would give (see `_best_group`), or None when it cannot satisfy the request."""
    best = _best_group(candidate, count, topology)
    if best is None:
        return None
    group, score = best
    return Plan(candidate.node_id, _pick_in_group(group, count), score=score)


def choose(
    candidates: Iterable[Candidate],
    count: int,
    topology: str,
    *,
    top_n: int,
    rng: random.Random,
    exclude: frozenset[str] = frozenset(),
) -> Plan | None:
    """The plan picked at random among the best `top_n` nodes, or None when no node fits."""
    scored = [
        (best[1], candidate.node_id, best[0])
        for candidate in candidates
        if candidate.node_id not in exclude
        for best in [_best_group(candidate, count, topology)]
        if best is not None
    ]
    if not scored:
        return None
    scored.sort(key=lambda s: (-s[0], s[1]))
    score, node_id, group = rng.choice(scored[: max(1, top_n)])  # atoms are picked for the chosen node only
    return Plan(node_id, _pick_in_group(group, count), score=score)


_NOUNS = {"gpu": "GPU", "gpu.mig": "MIG instance", "gpu.slot": "GPU slot"}


def noun(device_class: str) -> str:
    """A device class in words: GPU, MIG instance, GPU slot."""
    return _NOUNS.get(device_class, "GPU")


def shape_words(count: int, device_class: str, profile: str, model: str, topology: str, adjective: str) -> str:
    """What a request's devices are, in the words of an Unschedulable reason, e.g. `4 free healthy
    GPUs of model H100-SXM5-80GB in one NVLink domain` (`adjective`: "healthy", "free healthy")."""
    shape = f"{count} {adjective} {noun(device_class)}{'s' if count != 1 else ''}"
    if profile:
        shape += f" of profile {profile}"
    if model:
        shape += f" of model {model}"
    if topology == NVLINK_ALL:
        shape += " in one NVLink domain"
    elif topology == NUMA:
        shape += " on one NUMA node"
    return shape
