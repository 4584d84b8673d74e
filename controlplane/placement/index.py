"""The capacity index: per pool, in memory, what placement needs to answer "which nodes fit this
request for this window" without reading PostgreSQL (DESIGN.md section 9).

Pure data and arithmetic; loading and keeping it current is controlplane.placement.index_sync.
PostgreSQL stays the source of truth: the index only proposes, the commit under the pool lock
decides.

Per pool:
- nodes with labels (value and source), capabilities, state and connectivity;
- per node its atoms (any kind) with health, bookable, NUMA node and NVLink domain, and each
  atom's booked intervals as a sorted list of [start, end) epoch ms;
- per node its counted host resources (what it can give: allocatable less the pool's host
  reserve) and their booked intervals; a node that cannot give a request's host resources for
  the window is not a fit;
- `_touching`: every atom booking of the pool, sorted by start (a SortedList: a delta is O(log n);
  bookings longer than LONG_MS in a small set of their own), so the nodes with a booking overlapping
  a window are found by bisection without visiting the others; when a window has more than
  BUSY_EXACT bookings around it (a well-booked pool), a random sample of them stands for them;
- `_classes`: nodes by their count of healthy bookable atoms (a pool books one kind: whole GPUs,
  MIG instances or slots), so a node with no booking in the window is planned from that count
  alone, and only the few best classes are visited.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from sortedcontainers import SortedList

from controlplane.placement import planner

GPU = "gpu"
LEASED = "leased"  # a node a tenant holds (controlplane.nodes.tenancy): its inventory is the tenant's word
LONG_MS = 24 * 3600 * 1000  # bookings longer than this are kept in the pool's short list of long ones
# Above this many bookings starting around a window, `candidates` does not visit every node with
# one (in a well-booked pool that is nearly every node) but BUSY_SAMPLE of them, then checks the
# other nodes one by one until enough fit: the cost of a plan stays bounded as bookings grow.
BUSY_EXACT = 256
BUSY_SAMPLE = 16


@dataclass(frozen=True)
class Window:
    """What the index is asked: `count` atoms of `model` ('' any) for [start_ms, end_ms)."""

    count: int
    topology: str
    model: str
    selector: dict[str, str]
    start_ms: int
    end_ms: int
    capabilities: frozenset[str] = frozenset()
    # Labels required whole, value and source (a binding's system capability label).
    required: tuple[tuple[str, str, str], ...] = ()
    device_class: str = GPU  # the atoms' kind: gpu, gpu.mig or gpu.slot
    profile: str = ""  # a MIG profile ('' any)
    # Host resources booked on the node with the atoms: (resource, amount), amounts above 0.
    host: tuple[tuple[str, int], ...] = ()

    @property
    def shape(self) -> tuple[str, str, str, str]:
        """What decides where the window could fit on an empty node: model, class, profile, topology."""
        return (self.model, self.device_class, self.profile, self.topology)


@dataclass
class Atom:
    id: str
    node_id: str
    kind: str
    device_uuid: str
    model: str
    numa_node: int
    nvlink_domain: str
    healthy: bool
    bookable: bool
    intervals: list[tuple[int, int]] = field(default_factory=list)  # sorted, never overlapping
    profile: str = ""  # a MIG instance's profile

    def usable(self, model: str, kind: str = GPU, profile: str = "") -> bool:
        return (self.kind == kind and self.healthy and self.bookable and (not model or self.model == model)
                and (not profile or self.profile == profile))

    def free_for(self, start: int, end: int) -> bool:
        """No booked interval overlaps [start, end): the one starting last before `end` ends by `start`."""
        i = bisect.bisect_left(self.intervals, (end,))
        return i == 0 or self.intervals[i - 1][1] <= start


@dataclass
class Node:
    id: str
    pool_id: str
    name: str
    labels: dict[str, Any]  # {key: {"value": ..., "source": ...}}
    capabilities: frozenset[str]
    state: str
    connectivity: str
    atoms: dict[str, Atom] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)  # resource -> allocatable
    host_booked: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)  # sorted per resource
    ticket: int = 0  # the refresh that wrote this node (a later read never loses to an earlier one)
    # usable() by (model, kind, profile), sorted by id, each atom with its planner view. A node's atoms
    # are fixed once built (a change replaces the node), so this is filled once per shape asked
    # whose model and profile the node has (a request names any it likes: those are not kept).
    _sorted: dict[tuple[str, str, str], tuple[tuple[Atom, planner.FreeAtom], ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    _room: dict[tuple[str, str, str, str], int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _whole: dict[tuple[str, str, str], planner.Candidate] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    _names: tuple[frozenset[str], frozenset[str]] | None = field(  # its atoms' models and profiles
        default=None, init=False, repr=False, compare=False)

    @property
    def schedulable(self) -> bool:
        return self.state == "ready" and self.connectivity != "unreachable"

    def matches(self, window: Window) -> bool:
        if not self.schedulable or not window.capabilities <= self.capabilities:
            return False
        for key, value in window.selector.items():
            label = self.labels.get(key)
            if not isinstance(label, dict) or label.get("value") != value:
                return False
        for key, value, source in window.required:
            label = self.labels.get(key)
            if not isinstance(label, dict) or (label.get("value"), label.get("source")) != (value, source):
                return False
        return True

    def usable(self, model: str, kind: str = GPU, profile: str = "") -> list[Atom]:
        return [a for a in self.atoms.values() if a.usable(model, kind, profile)]

    def lacks(self, model: str, profile: str) -> bool:
        """No atom of the node has this model or this MIG profile (either named; '' is any)."""
        if self._names is None:
            self._names = (frozenset(a.model for a in self.atoms.values()),
                           frozenset(a.profile for a in self.atoms.values()))
        models, profiles = self._names
        return bool(model and model not in models) or bool(profile and profile not in profiles)

    def usable_sorted(self, model: str, kind: str, profile: str) -> tuple[tuple[Atom, planner.FreeAtom], ...]:
        """usable(), sorted by id, each atom with its planner view (kept: see `_sorted`)."""
        key = (model, kind, profile)
        found = self._sorted.get(key)
        if found is None:
            if self.lacks(model, profile):  # not kept: a model or profile made up would fill the cache
                return ()
            found = self._sorted[key] = tuple(
                (a, planner.FreeAtom(a.id, a.numa_node, a.nvlink_domain))
                for a in sorted(self.usable(model, kind, profile), key=lambda a: a.id))
        return found

    def all_free(self, window: Window) -> planner.Candidate:
        """This node as a candidate for a window none of its atoms is booked in (kept: see `_sorted`)."""
        key = (window.model, window.device_class, window.profile)
        found = self._whole.get(key)
        if found is None:
            if self.lacks(window.model, window.profile):  # not kept, as usable_sorted
                return planner.Candidate(self.id, self.name, ())
            found = self._whole[key] = planner.Candidate(
                self.id, self.name, tuple(view for _, view in self.usable_sorted(*key)))
        return found

    def room(self, window: Window) -> int:
        """The most atoms one plan for the window's shape could take here with nothing booked (all
        its usable atoms; with a topology, the most in one NUMA node or NVLink domain): a node with
        less cannot take the window whatever its bookings (kept: see `_sorted`)."""
        key = window.shape
        found = self._room.get(key)
        if found is None:
            if self.lacks(window.model, window.profile):  # not kept, as usable_sorted
                return 0
            views = [view for _, view in self.usable_sorted(window.model, window.device_class, window.profile)]
            found = self._room[key] = planner.largest_group(views, window.topology)
        return found

    def bookable_count(self) -> int:
        """Healthy bookable atoms of any kind (its pool books one kind)."""
        return sum(1 for a in self.atoms.values() if a.healthy and a.bookable)

    def host_peak(self, resource: str, start: int, end: int) -> float:
        """The most of `resource` booked at any instant of [start, end): the load rises only where
        a booking starts, so the window's start and the starts inside it are enough."""
        booked = [b for b in self.host_booked.get(resource, ()) if b[0] < end and b[1] > start]
        points = {start, *(b[0] for b in booked if b[0] > start)}
        return max((sum(b[2] for b in booked if b[0] <= t < b[1]) for t in points), default=0.0)

    def host_fits(self, window: Window) -> bool:
        """The node can give the window's host resources beside what is booked there."""
        return all(self.host_peak(r, window.start_ms, window.end_ms) + amount <= self.host.get(r, 0.0)
                   for r, amount in window.host)

    def gpu_count(self) -> int:
        """Physical GPUs, bookable or not."""
        return sum(1 for a in self.atoms.values() if a.kind == GPU)

    def with_bookings(self, rows: Iterable[dict], ticket: int, host_rows: Iterable[dict] | None = None) -> Node:
        """This node with the booked intervals of `rows` (index_queries.BOOKINGS) instead of its own,
        and of `host_rows` (HOST_BOOKINGS) for its host resources when given."""
        atoms = {a.id: dataclasses.replace(a, intervals=[]) for a in self.atoms.values()}
        for r in rows:
            atom = atoms.get(r["atom_id"])
            if atom is not None:
                atom.intervals.append((r["start_ms"], r["end_ms"]))
        for atom in atoms.values():
            atom.intervals.sort()
        host_booked = self.host_booked if host_rows is None else _host_booked(host_rows)
        return dataclasses.replace(self, atoms=atoms, host_booked=host_booked, ticket=ticket)

    def bookings(self) -> Iterator[tuple[int, int, str, str]]:
        for atom in self.atoms.values():
            for start, end in atom.intervals:
                yield (start, end, self.id, atom.id)


class PoolIndex:
    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self.nodes: dict[str, Node] = {}
        self._touching: SortedList = SortedList()  # (start, end, node, atom), by start
        self._long: set[tuple[int, int, str, str]] = set()
        self._classes: dict[int, dict[str, None]] = defaultdict(dict)  # usable GPU count -> ordered node ids
        self._class_lists: dict[int, list[str]] = {}  # _classes[n] as a list, until the class changes
        self._class_of: dict[str, int] = {}
        self._models: dict[str, int] = defaultdict(int)  # GPU model -> whole-GPU atoms of it
        self._share_of: dict[str, tuple[int, float | None, float | None]] = {}  # node -> (GPUs, vcpu, memoryGiB)
        self._share: dict[str, Fraction] | None = None  # host_share_per_gpu, until a node's inputs change
        self._room: dict[tuple[str, str, str, str], int] = {}  # the most any node has room for, by shape

    # -- keeping it current ------------------------------------------------------------------

    def put(self, node: Node) -> None:
        """Replace what the index knows of `node` (all of it: facts, atoms, intervals)."""
        self._forget(node.id)
        self._hold(node)
        for entry in node.bookings():
            self._add_entry(entry)

    def load(self, nodes: Iterable[Node]) -> None:
        """Put many nodes at once: their bookings sorted in once, not inserted one by one."""
        short: list[tuple[int, int, str, str]] = []
        for node in nodes:
            self._forget(node.id)
            self._hold(node)
            for entry in node.bookings():
                if entry[1] - entry[0] > LONG_MS:
                    self._long.add(entry)
                else:
                    short.append(entry)
        self._touching.update(short)

    def book(self, node_id: str, atom_id: str, start: int, end: int) -> bool:
        """One booked interval more for an atom (a delta; one already there stays once). False when
        the index does not hold the atom."""
        atom = self._atom(node_id, atom_id)
        if atom is None:
            return False
        i = bisect.bisect_left(atom.intervals, (start, end))
        if i == len(atom.intervals) or atom.intervals[i] != (start, end):
            atom.intervals.insert(i, (start, end))
            self._add_entry((start, end, node_id, atom_id))
        return True

    def unbook(self, node_id: str, atom_id: str, start: int, end: int) -> bool:
        """One booked interval less (a delta; one not there: nothing). False when the index does
        not hold the atom."""
        atom = self._atom(node_id, atom_id)
        if atom is None:
            return False
        i = bisect.bisect_left(atom.intervals, (start, end))
        if i < len(atom.intervals) and atom.intervals[i] == (start, end):
            del atom.intervals[i]
            self._drop_entry((start, end, node_id, atom_id))
        return True

    def remove(self, node_id: str) -> None:
        self._forget(node_id)
        if self._share_of.pop(node_id, None) is not None:
            self._share = None

    def _forget(self, node_id: str) -> None:
        old = self.nodes.pop(node_id, None)
        if old is None:
            return
        self._room.clear()
        for entry in old.bookings():
            self._drop_entry(entry)
        for atom in old.atoms.values():
            if atom.kind == GPU and old.state != LEASED:
                self._models[atom.model] -= 1
                if not self._models[atom.model]:
                    del self._models[atom.model]
        usable = self._class_of.pop(node_id)
        self._classes[usable].pop(node_id, None)
        self._class_lists.pop(usable, None)

    def _hold(self, node: Node) -> None:
        self.nodes[node.id] = node
        self._room.clear()
        for atom in node.atoms.values():
            if atom.kind == GPU and node.state != LEASED:  # a leased machine's models are its tenant's word
                self._models[atom.model] += 1
        usable = node.bookable_count()
        self._classes[usable][node.id] = None
        self._class_lists.pop(usable, None)
        self._class_of[node.id] = usable
        # A leased machine's inventory is its tenant's word: left out of the share (migration 0036).
        inputs = ((node.gpu_count(), node.host.get("vcpu"), node.host.get("memoryGiB")) if node.state != LEASED
                  else (0, None, None))
        if self._share_of.get(node.id) != inputs:
            self._share = None
        self._share_of[node.id] = inputs

    def _atom(self, node_id: str, atom_id: str) -> Atom | None:
        node = self.nodes.get(node_id)
        return node.atoms.get(atom_id) if node is not None else None

    def _add_entry(self, entry: tuple[int, int, str, str]) -> None:
        if entry[1] - entry[0] > LONG_MS:
            self._long.add(entry)
        else:
            self._touching.add(entry)

    def _drop_entry(self, entry: tuple[int, int, str, str]) -> None:
        if entry in self._long:
            self._long.discard(entry)
            return
        self._touching.discard(entry)

    # -- answering ---------------------------------------------------------------------------

    def host_share_per_gpu(self) -> dict[str, Fraction]:
        """The smallest share of vcpu and memoryGiB per GPU any GPU host of the pool can give
        (what it can give ÷ its physical GPUs); hosts without a resource's row, and leased ones,
        are left out."""
        if self._share is None:
            share: dict[str, Fraction] = {}
            for gpus, *amounts in self._share_of.values():
                if gpus <= 0:
                    continue
                for resource, amount in zip(("vcpu", "memoryGiB"), amounts, strict=True):
                    if amount is not None:
                        per_gpu = Fraction(amount).limit_denominator(1 << 20) / gpus
                        share[resource] = min(share.get(resource, per_gpu), per_gpu)
            self._share = share
        return dict(self._share)

    def single_model(self) -> str | None:
        """The pool's GPU model when all its whole GPUs are of one (any health; leased machines'
        left out), else None."""
        return next(iter(self._models)) if len(self._models) == 1 else None

    def models(self) -> list[str]:
        """Every GPU model of the pool's whole GPUs (any health; leased machines' left out), sorted."""
        return sorted(self._models)

    def room(self, window: Window) -> int:
        """The most atoms any node of the pool has room for in one plan of the window's shape, with
        nothing booked (see Node.room); kept until a node changes."""
        key = window.shape
        found = self._room.get(key)
        if found is None:
            found = max((node.room(window) for node in self.nodes.values()), default=0)
            if found:  # kept only for a shape some node has (a request names any model or profile)
                self._room[key] = found
        return found

    def touched(self, start: int, end: int) -> set[str]:
        """Nodes with a booking overlapping [start, end)."""
        return set(self.booked_atoms(start, end))

    def booked_atoms(self, start: int, end: int) -> dict[str, set[str]]:
        """Per node with a booking overlapping [start, end), its atoms booked then: bisection over
        the short bookings (those starting after start - LONG_MS and before end), a scan of the few
        long ones."""
        lo, hi = self._around(start, end)
        booked: dict[str, set[str]] = defaultdict(set)
        for _, e_end, node_id, atom_id in self._touching[lo:hi]:
            if e_end > start:
                booked[node_id].add(atom_id)
        for e_start, e_end, node_id, atom_id in self._long:
            if e_start < end and e_end > start:
                booked[node_id].add(atom_id)
        return booked

    def _around(self, start: int, end: int) -> tuple[int, int]:
        """The positions in `_touching` of the short bookings that may overlap [start, end)."""
        return self._touching.bisect_left((start - LONG_MS,)), self._touching.bisect_left((end,))

    def _busy(self, window: Window, rng: random.Random) -> tuple[dict[str, set[str] | None], bool]:
        """The nodes with a booking in the window, each with its atoms booked then, and True; or,
        when more than BUSY_EXACT bookings start around it, the nodes of a random sample of those
        (their atoms not known: each is checked exactly; the sample only says which nodes to
        visit first), and False."""
        lo, hi = self._around(window.start_ms, window.end_ms)
        if hi - lo <= BUSY_EXACT:
            return dict(self.booked_atoms(window.start_ms, window.end_ms)), True
        return {self._touching[rng.randrange(lo, hi)][2]: None for _ in range(BUSY_SAMPLE)}, False

    def candidate(self, node: Node, window: Window, booked: set[str] | None = None) -> planner.Candidate:
        """The node with its usable atoms free in the window: those not in `booked` when the atoms
        booked in the window are known, else each checked against its intervals."""
        usable = node.usable_sorted(window.model, window.device_class, window.profile)
        if booked is not None:
            free = tuple(view for a, view in usable if a.id not in booked)
        else:
            start, end = window.start_ms, window.end_ms
            free = tuple(view for a, view in usable if a.free_for(start, end))
        return planner.Candidate(node.id, node.name, free)

    def candidates(
        self, window: Window, *, enough: int, exclude: frozenset[str] = frozenset(), rng: random.Random | None = None
    ) -> list[planner.Candidate]:
        """Every node with a booking in the window that fits (planned exactly), and from the nodes
        with none, the fitting ones of the smallest usable-GPU classes until `enough` of them are
        found (bin-pack prefers the fewest free atoms left, so larger classes cannot score better).
        Within a class the walk starts at a random node and takes random strides, so concurrent
        creates spread out and nodes registered one after another (often booked alike) are not
        visited one after another. In a
        well-booked pool (see `_busy`) a sample of the nodes with bookings around the window
        stands for them all, so a partly booked node is preferred when the sample finds it."""
        rng = rng or random.Random()
        out: list[planner.Candidate] = []
        if self.room(window) < window.count:
            return out  # no node could take this shape even empty: nothing to visit
        busy, exact = self._busy(window, rng)
        for node_id, booked in busy.items():
            node = self.nodes.get(node_id)
            if (node is None or node_id in exclude or node.room(window) < window.count or not node.matches(window)
                    or not node.host_fits(window)):
                continue
            cand = self.candidate(node, window, booked)
            if len(cand.free) >= window.count:
                out.append(cand)
        found = 0
        for usable in sorted(c for c in self._classes if c >= window.count):
            members = self._class_lists.get(usable)
            if members is None:
                members = self._class_lists[usable] = list(self._classes[usable])
            if not members:
                continue
            begin, stride = rng.randrange(len(members)), _stride(len(members), rng)
            for k in range(len(members)):
                node_id = members[(begin + k * stride) % len(members)]
                if node_id in busy or node_id in exclude:
                    continue
                node = self.nodes[node_id]
                if node.room(window) < window.count or not node.matches(window) or not node.host_fits(window):
                    continue
                if exact:  # not busy: every usable atom is free, and room says a plan fits
                    cand = node.all_free(window)
                else:
                    cand = self.candidate(node, window)
                    if not planner.fits_node(cand, window.count, window.topology):
                        continue
                out.append(cand)
                found += 1
                if found >= enough:
                    return out
        return out

    def fits(self, window: Window, exclude: frozenset[str] = frozenset()) -> set[str]:
        """Every node the request fits on for the window (each node checked: for tests and
        diagnostics, not the create path)."""
        return {
            node.id for node in self.nodes.values()
            if node.id not in exclude and node.matches(window) and node.host_fits(window)
            and planner.plan_node(self.candidate(node, window), window.count, window.topology) is not None
        }


def _stride(n: int, rng: random.Random) -> int:
    """A random step that visits all of n positions (coprime with n)."""
    while True:
        step = rng.randrange(1, n) if n > 2 else 1
        if math.gcd(step, n) == 1:
            return step


def build_nodes(
    node_rows: Iterable[dict], atom_rows: Iterable[dict], booking_rows: Iterable[dict],
    host_rows: Iterable[dict] = (), host_booking_rows: Iterable[dict] = (), ticket: int = 0,
) -> dict[str, Node]:
    """Nodes from the rows of controlplane.placement.index_queries."""
    nodes = {
        r["id"]: Node(r["id"], r["pool_id"], r["name"], dict(r["labels"] or {}), frozenset(r["capabilities"] or ()),
                      r["state"], r["connectivity"], ticket=ticket)
        for r in node_rows
    }
    atoms: dict[str, Atom] = {}
    for r in atom_rows:
        node = nodes.get(r["node_id"])
        if node is None:
            continue
        atom = Atom(r["id"], r["node_id"], r["kind"], r["device_uuid"], r["model"], r["numa_node"],
                    r["nvlink_domain"], r["health"] == "healthy", r["bookable"], profile=r.get("profile") or "")
        node.atoms[atom.id] = atoms[atom.id] = atom
    for r in booking_rows:
        atom = atoms.get(r["atom_id"])
        if atom is not None:
            atom.intervals.append((r["start_ms"], r["end_ms"]))
    for atom in atoms.values():
        atom.intervals.sort()
    for r in host_rows:
        if r["node_id"] in nodes:
            nodes[r["node_id"]].host[r["resource"]] = float(r["allocatable"])
    by_node: dict[str, list[dict]] = defaultdict(list)
    for r in host_booking_rows:
        by_node[r["node_id"]].append(r)
    for node_id, rows in by_node.items():
        if node_id in nodes:
            nodes[node_id].host_booked = _host_booked(rows)
    return nodes


def _host_booked(rows: Iterable[dict]) -> dict[str, list[tuple[int, int, float]]]:
    out: dict[str, list[tuple[int, int, float]]] = {}
    for r in rows:
        out.setdefault(r["resource"], []).append((r["start_ms"], r["end_ms"], float(r["amount"])))
    for booked in out.values():
        booked.sort()
    return out
