"""Hostile review, round 24e: the capacity engine under hostile timing and data (DESIGN.md
section 9: "the index only proposes; the commit decides"; "a race rolls back ..., refreshes the
index for that node, excludes it and plans again"). Real control plane on loopback, embedded
PostgreSQL. The index is made to lag as a replica's listener does (`index_lags`: the bc_capacity
notifications of changes committed meanwhile are held and applied, in order, when the block
ends); everything else (the tables, the lock, the commit, the refresh after a lost race) is the
product's own. The first five tests reproduced three broken promises, fixed since (every commit
checks the atoms' shape against the request, atoms_as_asked, migration 0063; a gang's lost race
excludes a node only on its second loss, placer.lost_on; the last attempt of a one-node placement,
of a gang and of a batch member is planned from the tables under the pool lock):

- **The commit does not re-read the atoms' shape the index planned on.** INSERT_PLACEMENT,
  place_inline (migration 0059), INSERT_BATCH and INSERT_GANG re-check node state, connectivity,
  labels, atom health and bookable, but not the atoms' NVLink domain (nor NUMA node, model, MIG
  profile), which an inventory changes in place (nodes/queries.py UPSERT_GPU, UPSERT_CHILDREN).
  A regrouping of a node's NVLink fabric not yet in the index: an `nvlink-all` create of 8 is
  placed on GPUs of two domains (tests/invariants.py's own "nvlink-all in one domain" rule is
  broken). A MIG repartition that turns GPU instance 1 from 3g.40gb into 4g.40gb: a 3g.40gb create
  is placed on the 4g.40gb instance. What the placement answers is not what was asked.
- **A gang that loses a race on a node that still fits goes pending.** gang._commit excludes
  every node it lost on at once (`excluded.update(exc.nodes)`), before and after the refresh; the
  one-node placer learned not to (placer.lost_on: "in a pool of one fitting node, excluding it
  would leave the request pending with room for it"). A booking of half of one node the index
  has not heard of: the gang of 2 x 4 GPUs in a fabric of two 8-GPU nodes, 4 free on one and 8 on
  the other, goes pending "no gang of 2 nodes fits in one fabric.domain (at most 1 node fits
  together)".
- **Attempts run out on stale nodes while another node has room.** placer._commit (inline: one
  place_inline try, then placement_max_attempts) and batch.place (the lease holder: members whose
  attempts are spent are dropped, never planned from the tables) give up after the attempts and
  move the reservation to pending without asking PostgreSQL, though placer.plan and the batch
  promise '"does not fit" is always PostgreSQL's word'. Bin-pack sends every plan to the nodes the
  index believes half full: with eight of them full in fact and one empty node, the create (and
  a queued create in a lease pool, behind inline gangs) goes pending "no node has 4 free healthy
  GPUs ...; at most 8 free GPUs on one eligible node".

The last test guards what held: a cordon, a GPU quarantine or an unreachable node the index has
not heard of is refused by the commit, which re-reads the node under the lock; nothing is booked.

Tried and held (not kept as tests, each covered by an existing file or by reading): a label or
a capability label removed behind the index (the commit's `labels @> selector`, the gang's own
label value included); a MIG instance gone or a slot beyond the replicas (bookable re-read); host
rows shrinking (the host_bookings guard under the row lock); whole GPUs, MIG instances and slots of
one GPU never bookable in one pool (shared_atoms: a pool books one kind, a GPU in MIG mode is not
bookable whole); refresh and delta ordering by tickets (a read that started before a delta never
overwrites it; READ COMMITTED statements); a lost LISTEN connection rebuilding every pool;
preview and earliest-fit waiting for the index to catch up (earliest.caught_up) before they plan,
so a lagging index does not make a preview lie; the earliest-fit argument ("now or a booking
end", host bookings' ends included, a gang's ready sets); a fenced or failed batch forgetting its
marks. Noted, not reproduced: preempt.commit refreshes a node inside its savepoint (the victims
truncated); were that savepoint rolled back the index would keep the truncation, since a
rollback notifies nothing; its plan is read from rows under the exclusive pool lock, so it did
not lose here.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import pytest

from bettercompute.node.v1 import node_pb2
from bettercompute.v1 import admin_pb2 as apb
from controlplane.nodes import inventory
from tests.invariants import check_invariants
from tests.support import ServerThread, World, gpus
from tests.test_gang import bare, fleet, gang_create  # noqa: F401 (bare: a fixture)
from tests.test_pki import arun
from tests.test_shared_gpus import shared_pool

MODEL = "H100-SXM5-80GB"


@contextlib.contextmanager
def index_lags(server: ServerThread) -> Iterator[None]:
    """The capacity index hears nothing while the block runs, as on a replica whose listener is
    behind: every change committed meanwhile is in the tables and its notification on its way
    (applied, in order, when the block ends). Placements still refresh a node they lost a race
    on, as they do."""
    capacity = server.app.runtime.capacity
    server.call(capacity.barrier())  # everything before the block is in the index

    async def make() -> asyncio.Event:
        return asyncio.Event()

    gate = server.call(make())
    heard = capacity._apply

    async def on_its_way(payloads: list[str]) -> None:
        await gate.wait()
        await heard(payloads)

    capacity._apply = on_its_way
    try:
        yield
    finally:
        del capacity._apply
        server.loop.call_soon_threadsafe(gate.set)
        server.call(capacity.barrier())


def _inventory(world: World, node_id: str, generation: int, gpu_list: list[node_pb2.Gpu]) -> None:
    inv = node_pb2.Inventory(generation=generation, gpus=gpu_list)
    arun(world.conninfo, lambda pool: inventory.apply_inventory(pool, node_id, inv))


def _went_pending(world: World, rid: str) -> list[str]:
    """The reasons of the reservation's `reservation.pending` events (a pending retry may place it
    a moment later: the answer alone would race it)."""
    return [reason for (reason,) in world.sql(
        "SELECT data->>'reason' FROM events WHERE subject = %s AND type = 'reservation.pending' ORDER BY id",
        (f"reservation/{rid}",))]


def _booked(world: World, rid: str, column: str) -> set:
    return {v for (v,) in world.sql(
        f"SELECT DISTINCT at.{column} FROM allocations al JOIN bookings b ON b.allocation_id = al.id"
        " JOIN atoms at ON at.id = b.atom_id WHERE al.reservation_id = %s"
        " AND al.state IN ('placed', 'binding', 'bound')", (rid,))}


# -- the commit does not re-read what the index planned the atoms' shape on ---------------------


def test_an_nvlink_all_create_planned_on_a_regrouping_not_yet_heard_of_books_two_domains(
        bare: World, server: ServerThread) -> None:  # noqa: F811
    """Planner: "nvlink-all needs atoms of one NVLink domain". The commit re-reads no domain."""
    name = f"nvl{uuid.uuid4().hex[:8]}"
    node = bare.add_node(gpus(name, 8))  # one NVLink domain
    with index_lags(server):
        # The fabric manager regroups the GPUs: 0-3 and 4-7 are two NVLink domains now.
        _inventory(bare, node.id, 2, [
            node_pb2.Gpu(uuid=g.uuid, model=MODEL, memory_mib=81559, numa_node=g.numa_node,
                         nvlink_cluster="cl", nvlink_clique=str(i // 4)) for i, g in enumerate(gpus(name, 8))])
        assert len({d for (d,) in bare.sql("SELECT nvlink_domain FROM atoms WHERE node_id = %s", (node.id,))}) == 2
        r = bare.create(count=8, topology="nvlink-all", start=bare.later(2))
    domains = _booked(bare, r.id, "nvlink_domain")
    assert r.state == "pending" and domains == set(), (r.state, domains)


def test_a_mig_create_planned_on_a_repartition_not_yet_heard_of_books_another_profile(
        world: World, server: ServerThread) -> None:
    """A MIG request books instances of its profile; the commit re-reads no profile."""
    shared_pool(world, "mig", nodes=0)
    name = f"mig{uuid.uuid4().hex[:8]}"
    node = world.add_node(gpus(name, 1))
    (gpu,) = gpus(name, 1)

    def layout(generation: int, index: int, profile: str) -> None:
        _inventory(world, node.id, generation, [node_pb2.Gpu(
            uuid=gpu.uuid, model=MODEL, memory_mib=81559, mig_mode=True,
            mig_instances=[node_pb2.MigInstance(index=index, profile=profile)])])

    layout(2, 1, "3g.40gb")
    with index_lags(server):
        layout(3, 1, "4g.40gb")  # repartitioned: GPU instance 1 is a 4g.40gb now
        r = world.create(device_class="gpu.mig", count=1, profile="3g.40gb", start=world.later(2))
    profiles = _booked(world, r.id, "profile")
    assert r.state == "pending" and profiles == set(), (r.state, profiles)


# -- a lost race excludes a gang's node that still fits ------------------------------------------


def test_a_gang_whose_index_missed_a_booking_goes_pending_though_it_fits(bare: World, server: ServerThread) -> None:  # noqa: F811
    """Spec 004: pending only "when no group is large enough"; here the fabric has room for it."""
    nodes = fleet(bare, {"fab-e": 2})["fab-e"]
    start = bare.later(3)
    with index_lags(server):
        single = bare.create(count=4, start=start)  # half of one node, as another replica books it
        assert single.state == "placed"
        free = bare.sql("SELECT a.node_id, count(*) FROM atoms a WHERE a.node_id = ANY(%s) AND NOT EXISTS ("
                        " SELECT 1 FROM bookings b WHERE b.atom_id = a.id) GROUP BY 1", (nodes,))
        assert sorted(n for _, n in free) == [4, 8]  # room for the gang: 4 free on one node, 8 on the other
        g = gang_create(bare, 2, count=4, start=start)
    assert _went_pending(bare, g.id) == []
    check_invariants(bare.conninfo, bare.tenant)


# -- attempts run out on nodes the index had stale, with room elsewhere -------------------------


def test_a_create_goes_pending_with_room_when_its_attempts_run_out_on_stale_nodes(
        bare: World, server: ServerThread) -> None:  # noqa: F811
    """Spec: "If nothing fits the window at admission, the reservation is pending". One node is empty."""
    slots = [f"s{i}" for i in range(9)]
    for slot in slots:
        bare.add_node(labels={"slot": slot})
    start = bare.later(3)
    for slot in slots[:8]:
        assert bare.create(count=4, start=start, node_selector={"slot": slot}).state == "placed"
    with index_lags(server):
        for slot in slots[:8]:  # the other halves, booked as another replica would
            assert bare.create(count=4, start=start, node_selector={"slot": slot}).state == "placed"
        r = bare.create(count=4, start=start)
    assert _went_pending(bare, r.id) == []
    check_invariants(bare.conninfo, bare.tenant)


def test_a_queued_create_goes_pending_with_room_when_its_batch_attempts_run_out(
        bare: World, server: ServerThread) -> None:  # noqa: F811
    """The same through the lease holder's batch (batch.place), its index behind the inline gangs."""
    bare.pool_id = bare.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=bare.tenant, name="lease", region="eu-1", policy=apb.PoolPolicy(placer="lease"))).id
    bare.wait_ms = 20_000
    for i in range(9):
        bare.add_node(labels={"slot": f"s{i}", "pair": f"p{i // 2}"})
    start = bare.later(3)
    for i in range(8):
        assert bare.create(count=4, start=start, node_selector={"slot": f"s{i}"}).state == "placed"
    with index_lags(server):
        for pair in ("p0", "p1", "p2", "p3"):  # gangs place inline: the holder's index hears of them late
            assert gang_create(bare, 2, key="", count=4, start=start, node_selector={"pair": pair}).state == "placed"
        r = bare.create(count=4, start=start)
    assert _went_pending(bare, r.id) == []
    check_invariants(bare.conninfo, bare.tenant)


# -- held: what the commit re-reads under the lock -----------------------------------------------


@pytest.mark.parametrize("change", ["cordoned", "quarantined", "unreachable"])
def test_a_node_change_the_index_has_not_heard_of_is_refused_by_the_commit(
        bare: World, server: ServerThread, change: str) -> None:  # noqa: F811
    """Held: the commit re-reads the node's state, connectivity and atoms' health under the lock."""
    node = bare.add_node()
    with index_lags(server):
        if change == "cordoned":
            bare.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node.id, state="cordoned"))
        elif change == "quarantined":
            bare.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(
                node_id=node.id, device_uuid=f"GPU-{node.name}-5", health="unhealthy"))
        else:
            bare.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(
                node_id=node.id, connectivity="unreachable"))
        r = bare.create(count=8, start=bare.later(2))
    assert r.state == "pending" and not [a for a in r.allocations if a.state == "placed"]
    check_invariants(bare.conninfo, bare.tenant)
