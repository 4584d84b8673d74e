"""`python -m bench.plan`: the cost of one placement plan from the capacity index, alone.

A pool of `--nodes` nodes of 8 GPUs (two NUMA nodes of 4, one NVLink domain) with `--bookings`
random reservations of 1/2/4/8 GPUs for 1-8 h over 60 days (one that would overlap a booking
of its atoms is left out, as the bookings' EXCLUDE constraint would), then `--windows` random requests of
the same shapes, each planned as a create plans it (`PoolIndex.candidates`, then
`planner.choose`). Prints the time per plan and a digest of every choice made, so that two
versions of the planner can be compared both for speed and for making the same choices (the
random draws are seeded).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

from controlplane.placement import index, planner

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def pool_of(nodes: int, bookings: int, rng: random.Random) -> index.PoolIndex:
    pool = index.PoolIndex("bench")
    members = []
    for n in range(nodes):
        node = index.Node(f"n{n:05d}", "bench", f"node-{n}", {}, frozenset(), "ready", "connected")
        for g in range(8):
            atom = index.Atom(f"n{n:05d}-g{g}", node.id, "gpu", f"uuid-{n}-{g}", "H100", g // 4, "nvl0", True, True)
            node.atoms[atom.id] = atom
        members.append(node)
    pool.load(members)
    for _ in range(bookings):
        n = rng.randrange(nodes)
        start = rng.randrange(60 * DAY_MS)
        end = start + rng.choice((1, 2, 4, 8)) * HOUR_MS
        atoms = [pool.nodes[f"n{n:05d}"].atoms[f"n{n:05d}-g{g}"] for g in rng.sample(range(8), rng.choice((1, 2, 4, 8)))]
        if all(atom.free_for(start, end) for atom in atoms):  # as in a real pool: never two bookings at once
            for atom in atoms:
                pool.book(atom.node_id, atom.id, start, end)
    return pool


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--bookings", type=int, default=3000)
    p.add_argument("--windows", type=int, default=3000)
    p.add_argument("--topology", default=planner.ANY, choices=sorted(planner.TOPOLOGIES))
    p.add_argument("--top-n", type=int, default=8, help="placement_top_n: candidates enough, and the pick among the best")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    pool = pool_of(args.nodes, args.bookings, rng)
    windows = []
    for _ in range(args.windows):
        start = rng.randrange(60 * DAY_MS)
        windows.append(index.Window(rng.choice((1, 2, 4, 8)), args.topology, "", {}, start,
                                    start + rng.choice((1, 2, 4, 8)) * HOUR_MS))
    chosen = []
    started = time.perf_counter()
    for i, window in enumerate(windows):
        draws = random.Random(args.seed * 1_000_003 + i)  # per plan: a version that draws less for one plan
        candidates = pool.candidates(window, enough=args.top_n, rng=draws)  # does not shift the next
        plan = planner.choose(candidates, window.count, window.topology, top_n=args.top_n, rng=draws)
        chosen.append(None if plan is None else (plan.node_id, plan.atom_ids, plan.score))
    seconds = time.perf_counter() - started
    digest = hashlib.sha256(repr(chosen).encode()).hexdigest()[:16]
    print(f"{args.windows} plans on {args.nodes} nodes with {args.bookings} bookings ({args.topology}): "
          f"{seconds / args.windows * 1e6:.0f} us per plan; {sum(c is not None for c in chosen)} placed; "
          f"choices {digest}")


if __name__ == "__main__":
    main()
