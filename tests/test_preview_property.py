"""A preview that fits is a create that fits (issue 11): on random fleets with random bookings,
capacity.preview's verdict equals the outcome of the create that follows it when nothing happened
in between, and an earliest-fit preview's start is the start that create books."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bettercompute.v1 import reservations_pb2 as pb
from tests.support import Client, ServerThread, gpus, make_world
from tests.test_capacity_preview import preview

HOUR = 3_600_000


@dataclass(frozen=True)
class NodeSpec:
    count: int
    domains: int
    fabric: str | None
    zone: str | None


@dataclass(frozen=True)
class Req:
    count: int
    topology: str
    zone: str | None
    gang: int
    key: str
    start_in: int | None
    hours: int
    vcpu: bool
    earliest: bool


NODES = st.lists(st.builds(NodeSpec, count=st.sampled_from([2, 4, 8]), domains=st.sampled_from([1, 2]),
                           fabric=st.sampled_from(["f1", "f2", None]), zone=st.sampled_from(["a", "b", None])),
                 min_size=1, max_size=4)
BOOKED = st.lists(st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([None, 1, 3]), st.sampled_from([1, 2, 5])),
                  max_size=5)
REQS = st.builds(Req, count=st.sampled_from([1, 2, 4, 8]), topology=st.sampled_from(["", "nvlink-all", "numa"]),
                 zone=st.sampled_from([None, None, "a"]), gang=st.sampled_from([0, 0, 2, 3]),
                 key=st.sampled_from(["", "fabric.domain"]), start_in=st.sampled_from([None, None, 2]),
                 hours=st.sampled_from([1, 2, 4]), vcpu=st.sampled_from([False, False, False, True]),
                 earliest=st.booleans())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(nodes=NODES, booked=BOOKED, req=REQS)
def test_preview_verdict_is_the_next_creates_outcome(stack: tuple[ServerThread, Client], nodes: list[NodeSpec],
                                                      booked: list[tuple[int, int | None, int]], req: Req) -> None:
    server, root = stack
    world = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=10_000)
    try:
        world.quota(10_000, "vcpu")  # a request above the (empty) host share is charged for it
        for i, spec in enumerate(nodes):
            world.add_node(gpus(f"{world.tenant}-{i}", spec.count, domains=spec.domains),
                           labels={"zone": spec.zone} if spec.zone else {},
                           system_labels={"fabric.domain": spec.fabric} if spec.fabric else {})
        for count, start_in, hours in booked:
            world.create(count=count, duration=f"{hours}h",
                         **({"start": world.later(start_in)} if start_in is not None else {}))
        kw: dict = {"count": req.count, "topology": req.topology, "duration": f"{req.hours}h"}
        if req.zone:
            kw["node_selector"] = {"zone": req.zone}
        if req.gang:
            kw["gang"] = pb.Gang(size=req.gang, topology_key=req.key)
        if req.vcpu:
            kw["resources"] = pb.HostResources(vcpu=2)
        if req.earliest:
            kw["start_earliest"] = True
        elif req.start_in is not None:
            kw["start"] = world.later(req.start_in)
        before = world.later(0)
        seen = preview(world, **kw)
        made = world.create(**kw)
        after = world.later(0)
        assert (made.state == "placed") == seen.fits, (seen, made)
        if seen.fits and req.earliest:
            # The same start, or both "now": each at its own moment, the preview's first.
            assert made.request.start == seen.start or before <= seen.start <= made.request.start <= after
        if not seen.fits:
            assert seen.reason and made.state == "pending"
    finally:
        world.close()
