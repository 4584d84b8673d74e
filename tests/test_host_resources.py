"""Host resources (spec "Host resources"), on the control plane: what is bookable, the per-GPU share
resolved at the draft and its floor, quota for the excess, IAM's attributes, the devices.limits
label, the guarded booking on the node (concurrent commits never overbook), bookings that follow
their devices, and the capacity.hosts reconciler. End to end through nodesim (limits, slices,
admission on the node): tests/test_host_resources_e2e.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from fractions import Fraction

from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.nodes import cpulist, hosts
from controlplane.nodes.inventory import inventory_json
from controlplane.placement import queries as placement_queries
from controlplane.reservations import hostshare
from tests.support import PERMISSIVE, ServerThread, World, get, make_world, rpc_error
from tests.test_cli import cli, tty  # noqa: F401 (fixtures)

LIMITS_LABEL = "bc.dev/cap.devices.limits"
GIB = 1 << 30
HOUR = 3_600_000


def host_node(world: World, server: ServerThread, *, vcpu: int = 66, memory: int = 512, pages: int = 16,
              label: bool = True, gpus: int = 8) -> apb.Node:
    """A node with host resource rows (as inventory would write them) and, unless told otherwise,
    the system label of a daemon that enforces limits; the capacity index has heard of both."""
    from tests.support import gpus as gpu_list

    name = f"h{len(world.nodes):03d}-{world.tenant[-6:]}"
    node = world.add_node(gpu_list(name, gpus), name=name,
                          system_labels={LIMITS_LABEL: "true"} if label else {})
    world.sql("INSERT INTO host_resources (node_id, resource, allocatable) VALUES"
              " (%(n)s, 'vcpu', %(v)s), (%(n)s, 'memoryGiB', %(m)s), (%(n)s, 'hugepages1Gi', %(p)s)",
              {"n": node.id, "v": vcpu, "m": memory, "p": pages})
    server.call(server.app.runtime.capacity.barrier())
    return node


def host_world(world: World, server: ServerThread, nodes: int = 1, **kw) -> list[apb.Node]:
    """The world's pool with only host-resource nodes (its two plain nodes cordoned away)."""
    for node in world.nodes:
        world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node.id, state="cordoned"))
    return [host_node(world, server, **kw) for _ in range(nodes)]


def resources(**kw) -> pb.HostResources:
    return pb.HostResources(**kw)


def host_bookings(world: World, rid: str) -> dict[str, int]:
    return {r: int(a) for r, a in world.sql(
        "SELECT h.resource, h.amount FROM host_bookings h JOIN allocations a ON a.id = h.allocation_id"
        " WHERE a.reservation_id = %s AND a.state IN ('placed', 'binding', 'bound')", (rid,))}


def charges(world: World, rid: str) -> dict[str, int]:
    """The live charges but the per-model ones (tests/test_quota_model.py has those)."""
    return dict(world.sql("SELECT resource, amount FROM quota_charges WHERE reservation_id = %s"
                          " AND refunded_at IS NULL AND resource NOT LIKE 'gpu:%%'", (rid,)))


# -- reading cpulists within bounds -------------------------------------------------------------


def test_cpulists_are_read_within_bounds() -> None:
    assert cpulist.parse("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert cpulist.parse("8191") == {8191}
    assert cpulist.parse("8192") == frozenset()  # a CPU id past 8191
    assert cpulist.parse("0-9000") == frozenset()
    assert cpulist.parse(",".join(str(i) for i in range(4096))) == frozenset(range(4096))
    assert cpulist.parse(",".join(str(i) for i in range(4097))) == frozenset()  # more than 4096 parts
    assert cpulist.parse("0," * 20000 + "0") == frozenset()  # more than 32 KiB
    assert cpulist.parse("3-1") == cpulist.parse("x") == frozenset()
    # Digits and spaces of other scripts are no cpulist, though Python's int() reads them.
    assert cpulist.parse("\u0660-\u0663") == cpulist.parse("\uff18") == cpulist.parse("0-3\u3000") == frozenset()
    # The widest list within the bounds: 4096 full ranges, each expanded over the same ids.
    assert cpulist.parse(",".join(["0-8191"] * 4096)) == frozenset(range(8192))
    assert cpulist.format_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_an_inventory_cpulist_out_of_bounds_is_stored_empty() -> None:
    from bettercompute.node.v1 import node_pb2

    inv = node_pb2.Inventory(vcpus=16, numa_nodes=[
        node_pb2.NumaNode(id=0, cpulist="0-7"), node_pb2.NumaNode(id=1, cpulist="8-9000")],
        isolated_cpus=",".join(["1"] * 5000))
    stored = inventory_json(inv, [])
    assert [n["cpulist"] for n in stored["numa_nodes"]] == ["0-7", ""]
    assert stored["isolated_cpus"] == ""


# -- the cpuset of a hold -----------------------------------------------------------------------


INVENTORY = {
    "gpus": [{"uuid": f"GPU-{i}", "numa_node": i // 4} for i in range(8)],
    "numa_nodes": [{"id": 0, "cpulist": "0-15,32-47", "memory_bytes": 256 * GIB},
                   {"id": 1, "cpulist": "16-31,48-63", "memory_bytes": 256 * GIB}],
    "isolated_cpus": "0",
}


def test_the_cpuset_is_the_devices_numa_nodes_without_the_host_reserve() -> None:
    # The reserve is the lowest two non-isolated CPUs (1 and 2: CPU 0 is isolated).
    facts = hosts.NumaFacts.of(INVENTORY, 2)
    assert hosts.cpuset(facts, ["GPU-0", "GPU-1"], 8, 64) == ("0,3-15,32-47", "0")
    assert hosts.cpuset(facts, ["GPU-5"], 8, 64) == ("16-31,48-63", "1")
    assert hosts.cpuset(facts, ["GPU-3", "GPU-4"], 8, 64) == ("0,3-63", "0,1")
    # Not enough CPUs or memory there: not pinned.
    assert hosts.cpuset(facts, ["GPU-0"], 31, 300) == ("", "")
    assert hosts.cpuset(facts, ["GPU-0"], 30, 256)[0] != "" and hosts.cpuset(facts, ["GPU-0"], 30, 256)[1] == "0"
    assert hosts.cpuset(facts, ["GPU-9"], 8, 64) == ("", "")  # unknown device


def test_numa_cpulists_together_are_read_within_one_lists_bounds() -> None:
    """Each within the bounds, together past them: the lists past the budget read as empty (a
    node cannot make the control plane parse megabytes of them), the earlier ones are kept."""
    part = ",".join(str(i) for i in range(0, 2000, 2))  # 1,000 parts, within every bound
    lists = cpulist.parse_all([part] * 6)
    assert [len(x) for x in lists] == [1000] * 4 + [0, 0]  # MAX_PARTS 4096: the fifth would pass it
    assert cpulist.parse_all(["0-3", "x", "4-7"]) == [frozenset(range(4)), frozenset(), frozenset(range(4, 8))]


# -- the share ----------------------------------------------------------------------------------


def test_the_share_rounds_down_and_is_the_floor() -> None:
    per_gpu = {"vcpu": Fraction(31, 4), "memoryGiB": Fraction(64)}
    assert hostshare.resolve(None, per_gpu, 3) == ({"vcpu": 23, "memoryGiB": 192, "hugepages1Gi": 0},
                                                   {"vcpu": 23, "memoryGiB": 192})
    raised, _ = hostshare.resolve({"vcpu": 4, "memoryGiB": None, "hugepages1Gi": 2}, per_gpu, 3)
    assert raised == {"vcpu": 23, "memoryGiB": 192, "hugepages1Gi": 2}
    more, share = hostshare.resolve({"vcpu": 40, "memoryGiB": 200, "hugepages1Gi": None}, per_gpu, 3)
    row = {"request": {"resources": more}, "host_share": share}
    assert hostshare.excess(row) == {"vcpu": 17, "memoryGiB": 8}
    assert hostshare.excess({**row, "host_share": None}) == {}  # made before host shares: devices only
    assert hostshare.resolve({"vcpu": 1}, {}, 3) == ({"vcpu": 1, "memoryGiB": 0, "hugepages1Gi": 0}, {})


def test_without_resources_a_hold_books_the_smallest_hosts_share(world: World, server: ServerThread) -> None:
    host_world(world, server, vcpu=66, memory=512)  # (66 - 2 reserved) / 8 = 8 vCPUs, 64 GiB per GPU
    host_node(world, server, vcpu=34, memory=1024)  # 4 vCPUs, 128 GiB per GPU
    r = world.create(count=3)
    assert r.state == "placed"
    assert r.host_share == resources(vcpu=12, memory_gib=192)
    assert r.request.resources == resources(vcpu=12, memory_gib=192, hugepages_1gi=0)
    assert r.allocations[0].resources == resources(vcpu=12, memory_gib=192, hugepages_1gi=0)
    assert host_bookings(world, r.id) == {"vcpu": 12, "memoryGiB": 192}
    assert charges(world, r.id) == {"gpu": 3}  # the share rides on the GPUs
    # Resolved once, stored: a later change to the hosts does not change it.
    assert get(world, r.id).host_share == r.host_share


def test_policy_per_gpu_sets_the_share(world: World, server: ServerThread) -> None:
    pool = world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="pergpu", region="eu-1",
        policy=apb.PoolPolicy(per_gpu=apb.PerGpuShare(vcpu=3, memory_gib=10), host_reserve=apb.HostReserve(vcpu=4))))
    assert pool.policy.per_gpu == apb.PerGpuShare(vcpu=3, memory_gib=10) and pool.policy.host_reserve.vcpu == 4
    world.pool_id = pool.id
    host_node(world, server)
    r = world.create(count=2)
    assert r.state == "placed" and r.host_share == resources(vcpu=6, memory_gib=20)


def test_resources_below_the_share_or_empty_are_raised_to_it(world: World, server: ServerThread) -> None:
    host_world(world, server)
    low = world.create(count=2, resources=resources(vcpu=1, memory_gib=1))
    empty = world.create(count=2, resources=resources())
    for r in (low, empty):
        assert r.request.resources == resources(vcpu=16, memory_gib=128, hugepages_1gi=0)
        assert charges(world, r.id) == {"gpu": 2}


def test_above_the_share_is_charged_to_vcpu_and_memory_quota_and_a_missing_row_grants_none(
    world: World, server: ServerThread
) -> None:
    host_world(world, server)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(count=1, resources=resources(vcpu=10))
    code, _, details = rpc_error(exc)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details["resource"] == "vcpu"
    world.quota(4, "vcpu")
    world.quota(100, "memoryGiB")
    r = world.create(count=1, resources=resources(vcpu=10, memory_gib=70, hugepages_1gi=3))
    assert r.state == "placed" and r.host_share == resources(vcpu=8, memory_gib=64)
    # 2 vCPUs above the share; 6 GiB of memory above it plus 3 GiB of huge pages.
    assert charges(world, r.id) == {"gpu": 1, "vcpu": 2, "memoryGiB": 9}
    with pytest.raises(grpc.RpcError) as exc:
        world.create(count=1, resources=resources(vcpu=11))
    assert rpc_error(exc)[2]["resource"] == "vcpu"
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    assert charges(world, r.id) == {}  # refunded with the GPUs


def test_a_pool_without_a_share_records_an_empty_one_and_charges_all_it_books(
    world: World, server: ServerThread
) -> None:
    """Nodes without host rows: no share; a plain hold books nothing and needs no label."""
    plain = world.create(count=1)
    assert plain.state == "placed" and plain.HasField("host_share") and plain.host_share == resources()
    assert plain.request.resources == resources(vcpu=0, memory_gib=0, hugepages_1gi=0)
    assert host_bookings(world, plain.id) == {} and not plain.allocations[0].HasField("resources")
    world.quota(8, "vcpu")
    asks = world.create(count=1, resources=resources(vcpu=2))
    # No node can give it (none has rows, nor the label): pending, charged all the same.
    assert asks.state == "pending" and charges(world, asks.id) == {"gpu": 1, "vcpu": 2}
    assert "2 vcpu of host resources" in asks.conditions[0].message


def test_iam_sees_vcpu_and_memory(world: World, server: ServerThread) -> None:
    host_world(world, server)
    world.quota(1000, "vcpu")
    world.quota(1000, "memoryGiB")
    world.policy("permit(principal, action, resource) when { resource.vcpu <= 20 && resource.memoryGiB <= 200 };")
    try:
        assert world.create(count=1, resources=resources(vcpu=20, memory_gib=100)).state == "placed"
        for too_much in (resources(vcpu=21), resources(memory_gib=190, hugepages_1gi=20)):
            with pytest.raises(grpc.RpcError) as exc:
                world.create(count=1, resources=too_much)
            assert rpc_error(exc)[0] == grpc.StatusCode.PERMISSION_DENIED
    finally:
        world.policy(PERMISSIVE)


def test_resources_are_validated(world: World) -> None:
    for bad, field in ((resources(vcpu=4097), "resources.vcpu"), (resources(memory_gib=65537), "resources.memoryGiB"),
                       (resources(vcpu=-1), "resources.vcpu"), (resources(hugepages_1gi=-2), "resources.hugepages1Gi")):
        with pytest.raises(grpc.RpcError) as exc:
            world.create(resources=bad)
        code, _, details = rpc_error(exc)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details["field"] == field


# -- where it places ----------------------------------------------------------------------------


def test_a_node_that_cannot_give_the_resources_is_not_a_fit(world: World, server: ServerThread) -> None:
    (small,), big = host_world(world, server, vcpu=10), host_node(world, server, vcpu=130)
    world.quota(1000, "vcpu")
    r = world.create(count=1, resources=resources(vcpu=100))
    assert r.state == "placed" and r.allocations[0].node_id == big.id
    # The big node has 28 vCPUs left for the window (130 - 2 reserved - 100), the small one 8.
    waiting = world.create(count=1, resources=resources(vcpu=30))
    assert waiting.state == "pending" and "30 vcpu" in waiting.conditions[0].message
    later = world.create(count=1, resources=resources(vcpu=30), start=world.later(48))
    assert later.state == "placed" and later.allocations[0].node_id == big.id  # another window
    assert world.sql("SELECT count(*) FROM host_bookings WHERE node_id = %s", (small.id,)) == [(0,)]


def test_only_nodes_with_the_system_limits_label_take_host_resources(world: World, server: ServerThread) -> None:
    unlabelled = host_world(world, server, label=False)[0]
    r = world.create(count=1)  # the share is booked, and there is no enforcing daemon
    assert r.state == "pending" and "without the selected labels" in r.conditions[0].message
    world.sql("UPDATE nodes SET labels = labels || jsonb_build_object(%s::text, "
              "jsonb_build_object('value', 'true', 'source', 'operator')) WHERE id = %s", (LIMITS_LABEL, unlabelled.id))
    server.call(server.app.runtime.capacity.barrier())
    assert world.create(count=1).state == "pending"  # an operator label does not count
    labelled = host_node(world, server)
    placed = world.create(count=1)
    assert placed.state == "placed" and placed.allocations[0].node_id == labelled.id


def test_the_commit_rereads_the_label_under_the_lock(world: World, server: ServerThread) -> None:
    """A daemon downgraded between plan and commit: the guarded insert books nothing."""
    node = host_world(world, server)[0]
    r = world.create(count=1, start=world.later(1))
    # Its own allocation goes, so the insert below is the reservation's only one on the node.
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    world.sql("UPDATE nodes SET labels = labels - %s WHERE id = %s", (LIMITS_LABEL, node.id))
    atoms = [a for (a,) in world.sql("SELECT id FROM atoms WHERE node_id = %s AND id NOT IN ("
                                     "SELECT atom_id FROM bookings) ORDER BY id LIMIT 1", (node.id,))]
    with psycopg.connect(world.conninfo) as conn:
        from controlplane.reservations.placing import ask_for

        row = {"pool_id": world.pool_id, "request": {
            "devices": [{"count": 1, "topology": "any", "model": ""}], "durationMs": HOUR, "nodeSelector": {},
            "binding": "hold", "resources": {"vcpu": 8, "memoryGiB": 64, "hugepages1Gi": 0}}}
        ask = ask_for(row, world.later(0))
        params = ask.params(allocation_id="alloc_relabel", reservation_id=r.id, node_id=node.id,
                            device_ids=["x"], atom_ids=atoms)
        booked = conn.execute(placement_queries.INSERT_PLACEMENT, params).fetchall()
        assert booked == []
        conn.rollback()


def test_an_index_that_missed_host_bookings_proposes_and_the_one_statement_commit_decides(
        world: World, server: ServerThread) -> None:
    """A create with host resources is one statement (place_inline books them with its devices).
    The index believes the node's vCPUs are free (as if a notification were still on its way):
    the statement's host booking is refused, nothing of it stays (no allocation, no device or host
    booking), the node is read again under the lock and, with nothing else fitting, the create goes
    pending: the node is never overbooked."""
    node = host_world(world, server, vcpu=66)[0]  # 64 can be given
    world.quota(1000, "vcpu")
    start = world.later(300)
    first = world.create(count=1, start=start, duration="2h", resources=resources(vcpu=40))
    assert first.state == "placed" and host_bookings(world, first.id)["vcpu"] == 40
    capacity = server.app.runtime.capacity
    server.call(capacity.barrier())
    pool = capacity.pool(world.pool_id)
    assert pool is not None
    stale = pool.nodes[node.id].with_bookings(
        [{"atom_id": a, "start_ms": s, "end_ms": e} for a, s, e in world.sql(
            "SELECT b.atom_id, epoch_ms(lower(b.during)), epoch_ms(upper(b.during)) FROM bookings b"
            " JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = %s", (first.id,))],
        pool.nodes[node.id].ticket, host_rows=[])

    async def forget() -> None:
        pool.put(stale)
    server.call(forget())
    before = capacity.planned

    with capture_logs() as logs:
        second = world.create(count=1, start=start + HOUR, duration="2h", resources=resources(vcpu=40))
    assert second.state == "pending" and "40 vcpu" in second.conditions[0].message
    lost = [e for e in logs if e["event"] == "placement race lost"]
    assert lost and '"host"' in (lost[0].get("detail") or ""), lost  # in place_inline, on the host booking
    assert capacity.planned > before  # the stale index proposed the node
    assert world.sql("SELECT count(*) FROM allocations WHERE reservation_id = %s", (second.id,)) == [(0,)]
    assert world.sql("SELECT coalesce(sum(amount), 0) FROM host_bookings WHERE node_id = %s AND resource = 'vcpu'",
                     (node.id,)) == [(40,)]
    refreshed = capacity.pool(world.pool_id).nodes[node.id]
    assert refreshed.host_peak("vcpu", start + HOUR, start + 3 * HOUR) == 40  # read again under the lock


# -- the guard ----------------------------------------------------------------------------------


def _book(conninfo: str, alloc: str, node_id: str, start: int, end: int, amounts: dict, hold: threading.Event | None = None,
          release: threading.Event | None = None) -> bool:
    with psycopg.connect(conninfo) as conn:
        ok = conn.execute("SELECT book_host_resources(%s, %s, tstzrange(from_epoch_ms(%s), from_epoch_ms(%s), '[)'),"
                          " %s, '{}'::jsonb)", (alloc, node_id, start, end, psycopg.types.json.Jsonb(amounts))
                          ).fetchone()[0]
        if hold is not None:
            hold.set()
            assert release is not None and release.wait(30)
        conn.commit()
        return ok


def _allocation(world: World, node_id: str) -> str:
    """An allocation row to hang host bookings on (of a reservation of the world's)."""
    rid = world.create(count=1, start=world.later(200)).id
    # Its own allocation goes, so this one is the reservation's only live one on the node.
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=rid))
    alloc = f"alloc_t{uuid.uuid4().hex[:12]}"
    world.sql("INSERT INTO allocations (id, reservation_id, node_id, device_ids) VALUES (%s, %s, %s, '{}')",
              (alloc, rid, node_id))
    return alloc


def test_concurrent_commits_cannot_overbook_a_node(world: World, server: ServerThread) -> None:
    node = host_world(world, server, vcpu=66)[0]  # 64 can be given
    start = world.later(300)
    first, second = _allocation(world, node.id), _allocation(world, node.id)
    holding, release = threading.Event(), threading.Event()
    results: dict[str, bool] = {}
    t = threading.Thread(target=lambda: results.update(a=_book(
        world.conninfo, first, node.id, start, start + 2 * HOUR, {"vcpu": 40}, holding, release)))
    t.start()
    assert holding.wait(30)  # the first has booked and holds the node's vcpu row, uncommitted
    t2 = threading.Thread(target=lambda: results.update(b=_book(
        world.conninfo, second, node.id, start + HOUR, start + 3 * HOUR, {"vcpu": 40})))
    t2.start()
    # The second waits for the first's lock on the node's vcpu row (it cannot see the first's
    # uncommitted booking, so without the lock it would book too).
    deadline = time.monotonic() + 30
    while not world.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%%book_host_resources%%'")[0][0]:
        assert time.monotonic() < deadline and t2.is_alive(), "the second booker never waited for the lock"
        time.sleep(0.02)
    release.set()
    t.join(30)
    t2.join(30)
    assert results == {"a": True, "b": False}
    assert world.sql("SELECT count(*) FROM host_bookings WHERE allocation_id = %s", (second,))[0][0] == 0
    # Outside the first's window the same amount fits.
    assert _book(world.conninfo, second, node.id, start + 2 * HOUR, start + 3 * HOUR, {"vcpu": 24})


def test_a_direct_insert_past_allocatable_is_refused(world: World, server: ServerThread) -> None:
    node = host_world(world, server, memory=100)[0]
    alloc = _allocation(world, node.id)
    start = world.later(300)
    with pytest.raises(psycopg.errors.ExclusionViolation, match="host_bookings_within_allocatable|is full"):
        world.sql("INSERT INTO host_bookings (allocation_id, node_id, resource, amount, during) VALUES"
                  " (%s, %s, 'memoryGiB', 101, tstzrange(from_epoch_ms(%s), from_epoch_ms(%s), '[)'))",
                  (alloc, node.id, start, start + HOUR))


# -- bookings follow their devices --------------------------------------------------------------


def test_host_bookings_follow_release_and_extend(world: World, server: ServerThread) -> None:
    node = host_world(world, server, vcpu=66)[0]
    world.quota(1000, "vcpu")
    r = world.create(count=1, resources=resources(vcpu=40), start=world.later(1), duration="2h")
    window = world.sql("SELECT DISTINCT epoch_ms(lower(during)), epoch_ms(upper(during)) FROM host_bookings h"
                       " JOIN allocations a ON a.id = h.allocation_id WHERE a.reservation_id = %s", (r.id,))
    assert window == [(r.during.start, r.during.end)]
    blocker = world.create(count=1, resources=resources(vcpu=30), start=r.during.end + HOUR, duration="1h")
    assert blocker.state == "placed" and blocker.allocations[0].node_id == node.id
    # The devices are free past the end, but 40 + 30 vCPUs do not fit beside each other.
    refused = world.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=r.id, by="2h", idempotency_key="ext-1"))
    assert not refused.extended and refused.available_until == r.during.end + HOUR
    assert world.sql("SELECT DISTINCT epoch_ms(upper(h.during)) FROM host_bookings h JOIN allocations a"
                     " ON a.id = h.allocation_id WHERE a.reservation_id = %s", (r.id,)) == [(r.during.end,)]
    moved = world.user.res("Extend", pb.ExtendReservationRequest(
        tenant_id=world.tenant, reservation_id=r.id, by="30m", idempotency_key="ext-2"))
    assert moved.extended
    assert world.sql("SELECT DISTINCT epoch_ms(upper(h.during)) FROM host_bookings h JOIN allocations a"
                     " ON a.id = h.allocation_id WHERE a.reservation_id = %s", (r.id,)) == [
        (moved.reservation.during.end,)]
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    assert host_bookings(world, r.id) == {}
    assert world.sql("SELECT count(*) FROM host_bookings h JOIN allocations a ON a.id = h.allocation_id"
                     " WHERE a.reservation_id = %s", (r.id,))[0][0] == 0  # not begun: deleted
    again = world.create(count=1, resources=resources(vcpu=40), start=r.during.start, duration="2h")
    assert again.state == "placed"  # what the release freed is bookable at once


# -- the capacity.hosts reconciler --------------------------------------------------------------


def test_the_reconciler_keeps_rows_in_step_with_the_applied_inventory(world: World, server: ServerThread) -> None:
    node = world.nodes[0]
    inventory = {"vcpus": 128, "memory_bytes": 1024 * GIB, "hugepages_1gi": 64, "hugepages_2mi": 1024,
                 "numa_nodes": [], "gpus": []}
    world.sql("UPDATE nodes SET inventory = %s WHERE id = %s", (psycopg.types.json.Jsonb(inventory), node.id))
    server.call(hosts.sync_pass(server.app.runtime.pool))
    rows = dict(world.sql("SELECT resource, allocatable::int FROM host_resources WHERE node_id = %s", (node.id,)))
    assert rows == {"vcpu": 128, "memoryGiB": 1024 - 64 - 2, "hugepages2Mi": 1024, "hugepages1Gi": 64}
    assert node.id not in [n for (n,) in world.sql("SELECT host_resources_out_of_step()")]
    # A resource that dropped to 0 keeps its row, at 0.
    world.sql("UPDATE nodes SET inventory = inventory || '{\"hugepages_2mi\": 0}' WHERE id = %s", (node.id,))
    server.call(hosts.sync_pass(server.app.runtime.pool))
    assert world.sql("SELECT allocatable::int FROM host_resources WHERE node_id = %s AND resource = 'hugepages2Mi'",
                     (node.id,)) == [(0,)]


# -- the property: booked host resources never exceed what a node can give --------------------


def peak_over_capacity(world: World) -> list[str]:
    """Every (node, resource) whose bookings, at some instant, add up past what it can give."""
    rows = world.sql(
        "SELECT h.node_id, h.resource, h.amount, epoch_ms(lower(h.during)), epoch_ms(upper(h.during)),"
        " host_capacity(h.node_id, h.resource) FROM host_bookings h JOIN nodes n ON n.id = h.node_id"
        " WHERE n.pool_id = %s", (world.pool_id,))
    by_key: dict[tuple[str, str], list[tuple]] = {}
    for node, resource, amount, start, end, capacity in rows:
        by_key.setdefault((node, resource), []).append((start, end, amount, capacity))
    over = []
    for key, booked in by_key.items():
        capacity = booked[0][3]
        for start, *_ in booked:  # the load peaks where a booking starts
            load = sum(a for s, e, a, _ in booked if s <= start < e)
            if load > capacity:
                over.append(f"{key}: {load} booked at {start}, {capacity} can be given")
    return over


create_step = st.fixed_dictionaries({
    "count": st.integers(1, 8), "vcpu": st.integers(0, 48), "memory": st.integers(0, 600),
    "pages": st.integers(0, 10), "start_h": st.integers(1, 8), "hours": st.integers(1, 6)})
step = st.one_of(
    st.tuples(st.just("create"), st.lists(create_step, min_size=1, max_size=4)),  # concurrently
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("extend"), st.tuples(st.integers(0, 30), st.integers(1, 6))),
)


@given(steps=st.lists(step, min_size=1, max_size=8))
@settings(max_examples=12)
def test_booked_host_resources_never_exceed_what_a_node_can_give(stack, steps) -> None:
    server, root = stack
    world = make_world(server.endpoint, root, server.conninfo, nodes=0)
    try:
        for i in range(2):
            host_node(world, server, vcpu=34 + 32 * i, memory=512 * (i + 1), pages=8 * (i + 1))
        world.quota(100_000, "vcpu")
        world.quota(100_000, "memoryGiB")
        made: list[str] = []
        for kind, arg in steps:
            if kind == "create":
                def one(c: dict) -> str | None:
                    try:
                        return world.create(count=c["count"], duration=f"{c['hours']}h", start=world.later(c["start_h"]),
                                            resources=resources(vcpu=c["vcpu"], memory_gib=c["memory"],
                                                                hugepages_1gi=c["pages"])).id
                    except grpc.RpcError:
                        return None
                with ThreadPoolExecutor(len(arg)) as pool:
                    made += [rid for rid in pool.map(one, arg) if rid]
            elif made and kind == "release":
                world.user.res("Release", pb.ReleaseReservationRequest(
                    tenant_id=world.tenant, reservation_id=made[arg % len(made)]))
            elif made and kind == "extend":
                rid = made[arg[0] % len(made)]
                try:
                    world.user.res("Extend", pb.ExtendReservationRequest(
                        tenant_id=world.tenant, reservation_id=rid, by=f"{arg[1]}h", idempotency_key=uuid.uuid4().hex))
                except grpc.RpcError as exc:  # not extendable in its state (pending, released)
                    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert peak_over_capacity(world) == []
        # Every placed reservation books exactly what its request says, on its devices' node.
        for rid in made:
            r = get(world, rid)
            if r.state in ("placed", "binding", "active"):
                want = {k: v for k, v in (("vcpu", r.request.resources.vcpu), ("memoryGiB", r.request.resources.memory_gib),
                                          ("hugepages1Gi", r.request.resources.hugepages_1gi)) if v}
                assert host_bookings(world, rid) == want
    finally:
        world.close()


# -- the CLI ------------------------------------------------------------------------------------


def test_reserve_cpus_and_memory_send_resources(cli, tty, world: World, server: ServerThread) -> None:
    host_world(world, server)
    world.quota(100, "vcpu")
    world.quota(1000, "memoryGiB")
    placed = cli("reserve", "--gpus", "2", "--cpus", "20", "--memory", "200").json
    assert placed["request"]["resources"] == {"vcpu": 20, "memoryGiB": 200, "hugepages1Gi": 0}
    assert placed["hostShare"] == {"vcpu": 16, "memoryGiB": 128}
    only_cpus = cli("reserve", "--gpus", "1", "--cpus", "2").json  # memory: the share
    assert only_cpus["request"]["resources"] == {"vcpu": 8, "memoryGiB": 64, "hugepages1Gi": 0}
    for flag, value in (("--cpus", "4097"), ("--memory", "65537"), ("--cpus", "-1"), ("--memory", "lots")):
        run = cli("reserve", "--gpus", "1", flag, value)
        assert run.code == 2 and flag in run.err
    screen = tty("get", placed["id"]).out
    assert "20 vCPUs, 200 GiB per node (share 16 vCPUs, 128 GiB)" in screen
