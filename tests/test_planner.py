"""Properties of the pure planner (DESIGN.md section 9): the atom pick honours the topology and
never invents, drops or repeats an atom; it finds a plan whenever one exists; `choose` stays among
the best `top_n` by the bin-pack score and never picks an excluded node."""

from __future__ import annotations

import random
from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.placement import planner
from controlplane.placement.planner import ANY, NUMA, NVLINK_ALL, Candidate, FreeAtom

TOPOLOGY = st.sampled_from([ANY, NVLINK_ALL, NUMA])


@st.composite
def candidates(draw: st.DrawFn, node_id: str | None = None) -> Candidate:
    """A node with up to 10 free atoms over up to 3 NUMA nodes and up to 3 NVLink domains (""
    means the GPU is in none), listed in any order."""
    node = node_id or draw(st.sampled_from(["node-a", "node-b", "node-c"]))
    n = draw(st.integers(0, 10))
    atoms = [
        FreeAtom(
            id=f"{node}/atom-{i:02d}",
            numa_node=draw(st.integers(0, 2)),
            nvlink_domain=draw(st.sampled_from(["", f"{node}-nvl0", f"{node}-nvl1", f"{node}-nvl2"])),
        )
        for i in range(n)
    ]
    return Candidate(node, node, tuple(draw(st.permutations(atoms))))


@st.composite
def fleets(draw: st.DrawFn) -> list[Candidate]:
    n = draw(st.integers(0, 5))
    return [draw(candidates(node_id=f"node-{i}")) for i in range(n)]


def satisfies(atoms: tuple[FreeAtom, ...] | list[FreeAtom], topology: str) -> bool:
    if topology == NVLINK_ALL:
        return len({a.nvlink_domain for a in atoms}) == 1 and atoms[0].nvlink_domain != ""
    if topology == NUMA:
        return len({a.numa_node for a in atoms}) == 1
    return True


def brute_force(free: tuple[FreeAtom, ...], count: int, topology: str, *, one_numa: bool = False) -> bool:
    """Is there any set of `count` free atoms that satisfies the topology (and, if asked, sits on
    one NUMA node)? Tries every combination."""
    return any(
        satisfies(combo, topology) and (not one_numa or len({a.numa_node for a in combo}) == 1)
        for combo in combinations(free, count)
    )


def atoms_of(candidate: Candidate, plan: planner.Plan) -> list[FreeAtom]:
    by_id = {a.id: a for a in candidate.free}
    return [by_id[i] for i in plan.atom_ids]


@given(candidates(), st.integers(1, 10), TOPOLOGY)
def test_a_plan_takes_exactly_count_distinct_free_atoms_of_its_node(
    candidate: Candidate, count: int, topology: str
) -> None:
    plan = planner.plan_node(candidate, count, topology)
    if plan is None:
        return
    free_ids = {a.id for a in candidate.free}
    assert plan.node_id == candidate.node_id
    assert set(plan.atom_ids) <= free_ids, "a planned atom is not free on this node"
    assert len(plan.atom_ids) == count
    assert len(set(plan.atom_ids)) == count, "an atom planned twice"


@given(candidates(), st.integers(1, 10))
def test_nvlink_all_atoms_share_one_nonempty_nvlink_domain(candidate: Candidate, count: int) -> None:
    plan = planner.plan_node(candidate, count, NVLINK_ALL)
    if plan is None:
        return
    domains = {a.nvlink_domain for a in atoms_of(candidate, plan)}
    assert len(domains) == 1 and "" not in domains, domains


@given(candidates(), st.integers(1, 10))
def test_numa_atoms_share_one_numa_node(candidate: Candidate, count: int) -> None:
    plan = planner.plan_node(candidate, count, NUMA)
    if plan is None:
        return
    assert len({a.numa_node for a in atoms_of(candidate, plan)}) == 1


@given(candidates(), st.integers(1, 10), TOPOLOGY)
def test_a_node_that_can_satisfy_the_request_gets_a_plan(candidate: Candidate, count: int, topology: str) -> None:
    feasible = brute_force(candidate.free, count, topology)
    plan = planner.plan_node(candidate, count, topology)
    assert (plan is not None) == feasible, (feasible, plan)
    assert planner.fits_node(candidate, count, topology) == feasible  # the check without the pick


@pytest.mark.parametrize("topology", [ANY, NVLINK_ALL, NUMA])
@given(candidate=candidates(), count=st.integers(1, 10))
def test_a_request_one_numa_node_can_hold_lands_on_one_numa_node(
    topology: str, candidate: Candidate, count: int
) -> None:
    if not brute_force(candidate.free, count, topology, one_numa=True):
        return
    plan = planner.plan_node(candidate, count, topology)
    assert plan is not None
    numa_nodes = {a.numa_node for a in atoms_of(candidate, plan)}
    assert len(numa_nodes) == 1, (
        f"{count} atoms with topology {topology!r} fit on one NUMA node of {candidate.free}, "
        f"but the plan {plan.atom_ids} spans NUMA nodes {sorted(numa_nodes)}"
    )


@given(candidates(), st.integers(1, 10), TOPOLOGY)
def test_plan_node_does_not_depend_on_the_order_atoms_are_listed(
    candidate: Candidate, count: int, topology: str
) -> None:
    ordered = tuple(sorted(candidate.free, key=lambda a: a.id))
    reordered = Candidate(candidate.node_id, candidate.node_name, ordered)
    assert planner.plan_node(candidate, count, topology) == planner.plan_node(reordered, count, topology)


@given(
    fleet=fleets(),
    count=st.integers(1, 8),
    topology=TOPOLOGY,
    top_n=st.integers(0, 4),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_choose_picks_among_the_best_top_n_and_never_an_excluded_node(
    fleet: list[Candidate], count: int, topology: str, top_n: int, seed: int, data: st.DataObject
) -> None:
    ids = [c.node_id for c in fleet]
    exclude = frozenset(data.draw(st.sets(st.sampled_from(ids)) if ids else st.just(set())))
    plans = {
        c.node_id: plan
        for c in fleet
        if c.node_id not in exclude
        for plan in [planner.plan_node(c, count, topology)]
        if plan is not None
    }
    chosen = planner.choose(fleet, count, topology, top_n=top_n, rng=random.Random(seed), exclude=exclude)
    if not plans:
        assert chosen is None
        return
    assert chosen is not None, "no plan although a node that is not excluded can satisfy the request"
    assert chosen.node_id not in exclude
    assert chosen == plans[chosen.node_id]
    scores = sorted((p.score for p in plans.values()), reverse=True)
    cutoff = scores[min(max(1, top_n), len(scores)) - 1]
    assert chosen.score >= cutoff, (chosen, scores, top_n)


def _node(node_id: str, free: int, *, numa_split: int | None = None, domain: str = "nvl") -> Candidate:
    split = free // 2 if numa_split is None else numa_split
    return Candidate(node_id, node_id, tuple(
        FreeAtom(f"{node_id}/gpu{i}", 0 if i < split else 1, f"{node_id}-{domain}") for i in range(free)
    ))


@pytest.mark.parametrize("seed", range(5))
def test_bin_pack_the_fuller_node_is_chosen_with_top_n_1(seed: int) -> None:
    # "node-a" sorts first but has more free GPUs: the fuller "node-z" must win.
    fleet = [_node("node-a", 8), _node("node-z", 3), _node("node-m", 6)]
    chosen = planner.choose(fleet, 2, ANY, top_n=1, rng=random.Random(seed))
    assert chosen is not None and chosen.node_id == "node-z"


@pytest.mark.parametrize("seed", range(5))
def test_bin_pack_an_exact_fit_beats_a_node_with_room_to_spare(seed: int) -> None:
    fleet = [_node("node-a", 8), _node("node-b", 4)]
    chosen = planner.choose(fleet, 4, NVLINK_ALL, top_n=1, rng=random.Random(seed))
    assert chosen is not None and chosen.node_id == "node-b"
    assert len(chosen.atom_ids) == 4


def test_bin_pack_a_node_too_small_for_the_request_is_skipped() -> None:
    fleet = [_node("node-a", 8), _node("node-b", 3)]
    chosen = planner.choose(fleet, 4, ANY, top_n=1, rng=random.Random(0))
    assert chosen is not None and chosen.node_id == "node-a"


def test_bin_pack_keeps_a_whole_node_free_for_a_large_request() -> None:
    """Eight single-GPU requests, placed one after another with top_n=1 on two empty 8-GPU nodes,
    fill one node before touching the other, so an 8-GPU request still fits afterwards."""
    free = {n: list(_node(n, 8).free) for n in ("node-a", "node-b")}
    rng = random.Random(0)
    for _ in range(8):
        fleet = [Candidate(n, n, tuple(atoms)) for n, atoms in free.items()]
        plan = planner.choose(fleet, 1, ANY, top_n=1, rng=rng)
        assert plan is not None
        free[plan.node_id] = [a for a in free[plan.node_id] if a.id not in plan.atom_ids]
    fleet = [Candidate(n, n, tuple(atoms)) for n, atoms in free.items()]
    big = planner.choose(fleet, 8, NVLINK_ALL, top_n=1, rng=rng)
    assert big is not None, {n: len(a) for n, a in free.items()}


def test_numa_pick_prefers_the_tightest_numa_node_that_fits() -> None:
    # NUMA 0 has 2 free GPUs, NUMA 1 has 6: a 2-GPU numa request takes NUMA 0 whole.
    candidate = _node("node-a", 8, numa_split=2)
    plan = planner.plan_node(candidate, 2, NUMA)
    assert plan is not None
    assert {a.numa_node for a in atoms_of(candidate, plan)} == {0}


def test_nvlink_all_ignores_gpus_outside_any_domain() -> None:
    candidate = Candidate("node-a", "node-a", tuple(FreeAtom(f"g{i}", 0, "") for i in range(8)))
    assert planner.plan_node(candidate, 1, NVLINK_ALL) is None
    assert planner.plan_node(candidate, 8, ANY) is not None
