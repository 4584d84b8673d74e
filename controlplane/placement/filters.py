"""Why a request fits nowhere, filter by filter (capacity.preview): the pool's nodes pass each of
the placer's filters in turn, and each filter's count is the nodes it removed, in the words of an
Unschedulable condition (`needs label bc.dev/cap.devices.limits=*`). Pure, on a PoolIndex."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from controlplane.placement import planner
from controlplane.placement.index import Node, PoolIndex, Window


@dataclass(frozen=True)
class FilterCount:
    filter: str
    nodes: int
    reason: str


def _label(key: str, value: str, source: str = "") -> Callable[[Node], bool]:
    def has(node: Node) -> bool:
        label = node.labels.get(key)
        return isinstance(label, dict) and label.get("value") == value and (not source or label.get("source") == source)
    return has


def funnel(pool: PoolIndex, window: Window, gang_key: str = "") -> list[FilterCount]:
    """Each filter that removed a node, in the placer's order, with how many it removed (a gang
    with a topology key also needs that label on every member)."""
    shape = planner.shape_words(window.count, window.device_class, window.profile, window.model,
                                window.topology, "healthy")

    def devices(node: Node) -> bool:
        usable = node.usable(window.model, window.device_class, window.profile)
        free = tuple(planner.FreeAtom(a.id, a.numa_node, a.nvlink_domain) for a in sorted(usable, key=lambda a: a.id))
        return planner.plan_node(planner.Candidate(node.id, node.name, free), window.count, window.topology) is not None

    def free(node: Node) -> bool:
        return planner.plan_node(pool.candidate(node, window), window.count, window.topology) is not None

    steps: list[tuple[str, Callable[[Node], bool], str]] = [
        ("state", lambda n: n.state == "ready", "cordoned, draining or leased whole"),
        ("connectivity", lambda n: n.connectivity != "unreachable", "unreachable"),
    ]
    steps += [("labels", _label(k, v), f"needs label {k}={v}") for k, v in sorted(window.selector.items())]
    steps += [("labels", _label(k, v, s), f"needs label {k}=*") for k, v, s in window.required]
    if gang_key:
        steps.append(("labels", lambda n: isinstance(n.labels.get(gang_key), dict) and bool(n.labels[gang_key].get("value")),
                      f"needs label {gang_key}=*"))
    steps += [("capabilities", lambda n: window.capabilities <= n.capabilities,
               f"needs capabilities {', '.join(sorted(window.capabilities))}")] if window.capabilities else []
    steps.append(("devices", devices, f"has fewer than {shape}"))
    steps.append(("free", free, f"has fewer than {shape} free for the window"))
    if window.host:
        amounts = ", ".join(f"{v} {k}" for k, v in window.host)
        steps.append(("host", lambda n: n.host_fits(window), f"has less than {amounts} of host resources free for the window"))
    remaining = list(pool.nodes.values())
    out: list[FilterCount] = []
    for name, keep, reason in steps:
        kept = [n for n in remaining if keep(n)]
        if len(kept) < len(remaining):
            out.append(FilterCount(name, len(remaining) - len(kept), reason))
        remaining = kept
    return out
