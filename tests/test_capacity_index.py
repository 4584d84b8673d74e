"""The capacity index (controlplane.placement.index): its answer equals PostgreSQL's, and a change
made by any path reaches it through the bc_capacity channel."""

from __future__ import annotations

import asyncio
import json
import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.placement import planner
from controlplane.placement.index import Node, PoolIndex, Window
from controlplane.placement.index_sync import CapacityIndex, _read
from tests.support import World, make_world

HOUR = 3_600_000

# Brute force, independent of the index: per node, the free healthy bookable GPUs of the model for
# the window grouped by topology; a node fits when one group holds the count.
FITS_SQL = """
WITH free AS (
    SELECT a.node_id, a.numa_node, a.nvlink_domain
    FROM atoms a JOIN nodes n ON n.id = a.node_id
    WHERE n.pool_id = %(pool)s AND n.state = 'ready' AND n.connectivity <> 'unreachable'
      AND n.labels @> %(selector)s
      AND a.kind = 'gpu' AND a.health = 'healthy' AND a.bookable
      AND (%(model)s = '' OR a.model = %(model)s)
      AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.atom_id = a.id
                        AND b.during && tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)'))
)
SELECT DISTINCT node_id FROM (
    SELECT node_id, CASE %(topology)s WHEN 'nvlink-all' THEN nvlink_domain
                                      WHEN 'numa' THEN numa_node::text ELSE '' END AS grp, count(*) AS n
    FROM free GROUP BY 1, 2) g
WHERE n >= %(count)s AND NOT (%(topology)s = 'nvlink-all' AND grp = '')
"""

atom_st = st.fixed_dictionaries({
    "model": st.sampled_from(["A", "B"]),
    "numa": st.integers(0, 1),
    "nvlink": st.sampled_from(["", "d0", "d1"]),
    "healthy": st.booleans(),
    "bookable": st.booleans(),
    "bookings": st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), max_size=3),
})
node_st = st.fixed_dictionaries({
    "state": st.sampled_from(["ready", "ready", "cordoned"]),
    "connectivity": st.sampled_from(["connected", "unknown", "unreachable"]),
    "zone": st.sampled_from(["a", "b"]),
    "atoms": st.lists(atom_st, min_size=0, max_size=8),
})
ask_st = st.fixed_dictionaries({
    "count": st.integers(1, 8),
    "topology": st.sampled_from(sorted(planner.TOPOLOGIES)),
    "model": st.sampled_from(["", "A", "B"]),
    "zone": st.sampled_from(["", "a", "b"]),
    "start": st.integers(0, 14),
    "hours": st.integers(1, 6),
})


def _sql(conn: psycopg.Connection, query: str, params: object = None) -> list[dict]:
    cur = conn.cursor(row_factory=dict_row)
    cur.execute(query, params)
    return cur.fetchall() if cur.description else []


def _seed(conn: psycopg.Connection, world: World, fleet: list[dict], base: int) -> str:
    """A fresh pool holding `fleet` (nodes, atoms, bookings written as rows); its id."""
    tenant = world.tenant
    pool = "pool_" + uuid.uuid4().hex[:12]
    _sql(conn, "INSERT INTO pools (id, owner_tenant_id, name, region) VALUES (%s, %s, %s, 'eu-1')",
         (pool, tenant, pool))
    rid = "rsv_" + uuid.uuid4().hex[:16]
    _sql(conn, "INSERT INTO identities (id, kind, name) VALUES ('u', 'user', 'u') ON CONFLICT DO NOTHING")
    _sql(conn, "INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,"
               " request_hash, state, during) VALUES (%s, %s, %s, 'u', %s, %s, 'h', 'placed',"
               " tstzrange(compute_now(), compute_now() + interval '1 day'))",
         (rid, tenant, pool, rid, Jsonb({})))
    for i, node in enumerate(fleet):
        node_id = f"{pool}-n{i}"
        _sql(conn, "INSERT INTO nodes (id, pool_id, name, labels, state, connectivity) VALUES (%s, %s, %s, %s, %s, %s)",
             (node_id, pool, node_id, Jsonb({"zone": {"value": node["zone"], "source": "operator"}}),
              node["state"], node["connectivity"]))
        alloc = f"alloc_{pool}_{i}"
        _sql(conn, "INSERT INTO allocations (id, reservation_id, node_id, state, device_ids) VALUES (%s, %s, %s, 'placed', '{}')",
             (alloc, rid, node_id))
        for j, atom in enumerate(node["atoms"]):
            atom_id = f"{node_id}-g{j}"
            _sql(conn, "INSERT INTO atoms (id, node_id, kind, device_uuid, model, numa_node, nvlink_domain, health, bookable)"
                       " VALUES (%s, %s, 'gpu', %s, %s, %s, %s, %s, %s)",
                 (atom_id, node_id, atom_id, atom["model"], atom["numa"], atom["nvlink"],
                  "healthy" if atom["healthy"] else "unhealthy", atom["bookable"]))
            for start, hours in atom["bookings"]:
                _sql(conn, "INSERT INTO bookings (atom_id, allocation_id, during) VALUES (%s, %s,"
                           " tstzrange(from_epoch_ms(%s), from_epoch_ms(%s), '[)')) ON CONFLICT DO NOTHING",
                     (atom_id, alloc, base + start * HOUR, base + (start + hours) * HOUR))
    return pool


def _window(ask: dict, base: int) -> Window:
    start = base + ask["start"] * HOUR
    return Window(ask["count"], ask["topology"], ask["model"], {"zone": ask["zone"]} if ask["zone"] else {},
                  start, start + ask["hours"] * HOUR)


def _brute_force(conn: psycopg.Connection, pool: str, w: Window) -> set[str]:
    selector = Jsonb({k: {"value": v} for k, v in w.selector.items()})
    return {r["node_id"] for r in _sql(conn, FITS_SQL, {
        "pool": pool, "selector": selector, "model": w.model, "start": w.start_ms, "end": w.end_ms,
        "topology": w.topology, "count": w.count})}


def _free_atoms(conn: psycopg.Connection, node_id: str, w: Window) -> set[str]:
    """The node's healthy bookable GPUs of the window's model with no booking overlapping it."""
    return {r["id"] for r in _sql(conn, """
        SELECT a.id FROM atoms a
        WHERE a.node_id = %(node)s AND a.kind = 'gpu' AND a.health = 'healthy' AND a.bookable
          AND (%(model)s = '' OR a.model = %(model)s)
          AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.atom_id = a.id
                          AND b.during && tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)'))""",
        {"node": node_id, "model": w.model, "start": w.start_ms, "end": w.end_ms})}


async def _built(conninfo: str, pool: str) -> PoolIndex:
    async with await psycopg.AsyncConnection.connect(conninfo) as conn:
        index = PoolIndex(pool)
        for node in (await _read(conn, pool=pool, nodes=[], ticket=1)).values():
            index.put(node)
        return index


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(fleet=st.lists(node_st, min_size=1, max_size=5), asks=st.lists(ask_st, min_size=1, max_size=6))
def test_the_index_answers_what_sql_answers(world: World, fleet: list[dict], asks: list[dict]) -> None:
    """On random fleets and bookings, the nodes the index says a request fits on are exactly the
    nodes a brute-force query over the tables finds; `candidates` (the create path's walk) offers
    a node whenever one fits, and only nodes that fit."""
    with psycopg.connect(world.conninfo, autocommit=True) as conn:
        base = _sql(conn, "SELECT epoch_ms(compute_now()) AS now")[0]["now"] + 2 * HOUR
        pool = _seed(conn, world, fleet, base)
        index = asyncio.run(_built(world.conninfo, pool))
        single = _sql(conn, "SELECT min(a.model) AS m FROM atoms a JOIN nodes n ON n.id = a.node_id"
                            " WHERE n.pool_id = %s AND a.kind = 'gpu' HAVING count(DISTINCT a.model) = 1", (pool,))
        assert index.single_model() == (single[0]["m"] if single else None)
        for ask in asks:
            w = _window(ask, base)
            expected = _brute_force(conn, pool, w)
            assert index.fits(w) == expected, (ask, json.dumps(fleet))
            offered = {c.node_id for c in index.candidates(w, enough=1)
                       if planner.plan_node(c, w.count, w.topology) is not None}
            assert offered <= expected
            assert bool(offered) == bool(expected)
            for c in index.candidates(w, enough=len(fleet)):  # each offered with its atoms free then
                assert {a.id for a in c.free} == _free_atoms(conn, c.node_id, w), (ask, json.dumps(fleet))


# Changes after the build, each in its own statement; `same_tx` joins it to the previous one's
# transaction (a change the constraints refuse rolls back to its savepoint and notifies nothing).
change_st = st.fixed_dictionaries({
    "kind": st.sampled_from(["book", "book", "unbook", "move", "release", "health", "state", "new_atom", "bulk"]),
    "node": st.integers(0, 4),
    "atom": st.integers(0, 8),
    "pick": st.integers(0, 1000),
    "start": st.integers(0, 12),
    "hours": st.integers(1, 6),
    "flag": st.booleans(),
    "same_tx": st.booleans(),
})


def _change(conn: psycopg.Connection, pool: str, change: dict, base: int, k: int) -> None:
    nodes = [r["id"] for r in _sql(conn, "SELECT id FROM nodes WHERE pool_id = %s ORDER BY id", (pool,))]
    node = nodes[change["node"] % len(nodes)]
    atoms = [r["id"] for r in _sql(conn, "SELECT id FROM atoms WHERE node_id = %s ORDER BY id", (node,))]
    booked = _sql(conn, "SELECT b.atom_id, b.allocation_id, b.during FROM bookings b JOIN atoms a ON a.id = b.atom_id"
                        " JOIN nodes n ON n.id = a.node_id WHERE n.pool_id = %s ORDER BY 1, 3", (pool,))
    start, end = base + change["start"] * HOUR, base + (change["start"] + change["hours"]) * HOUR
    during = "tstzrange(from_epoch_ms(%s), from_epoch_ms(%s), '[)')"
    kind = change["kind"]
    if kind == "book" and atoms:
        _sql(conn, f"INSERT INTO bookings (atom_id, allocation_id, during) VALUES (%s, %s, {during})"
                   " ON CONFLICT DO NOTHING",
             (atoms[change["atom"] % len(atoms)], f"alloc_{pool}_{nodes.index(node)}", start, end))
    elif kind == "unbook" and booked:
        b = booked[change["pick"] % len(booked)]
        _sql(conn, "DELETE FROM bookings WHERE atom_id = %s AND during = %s", (b["atom_id"], b["during"]))
    elif kind == "move" and booked:  # an extend or a truncation: the interval changes in place
        b = booked[change["pick"] % len(booked)]
        _sql(conn, f"UPDATE bookings SET during = {during} WHERE atom_id = %s AND during = %s",
             (start, end, b["atom_id"], b["during"]))
    elif kind == "release":  # every booking of the node's allocation at once (a cascade)
        _sql(conn, "DELETE FROM allocations WHERE id = %s", (f"alloc_{pool}_{nodes.index(node)}",))
        _sql(conn, "INSERT INTO allocations (id, reservation_id, node_id, state, device_ids)"
                   " SELECT %s, id, %s, 'placed', '{}' FROM reservations WHERE pool_id = %s",
             (f"alloc_{pool}_{nodes.index(node)}", node, pool))
    elif kind == "health" and atoms:
        _sql(conn, "UPDATE atoms SET health = %s WHERE id = %s",
             ("healthy" if change["flag"] else "unhealthy", atoms[change["atom"] % len(atoms)]))
    elif kind == "state":
        _sql(conn, "UPDATE nodes SET state = %s WHERE id = %s", ("ready" if change["flag"] else "cordoned", node))
    elif kind == "bulk" and atoms:  # too many for one notification: the node's bookings are re-read
        _sql(conn, "INSERT INTO bookings (atom_id, allocation_id, during)"
                   " SELECT %s, %s, tstzrange(from_epoch_ms(%s + i * 120000), from_epoch_ms(%s + i * 120000 + 60000))"
                   " FROM generate_series(0, 199) AS i ON CONFLICT DO NOTHING",
             (atoms[change["atom"] % len(atoms)], f"alloc_{pool}_{nodes.index(node)}", start, start))
    elif kind == "new_atom":  # an atom and its booking in one transaction: the node's facts and a delta
        atom_id = f"{node}-x{k}"
        _sql(conn, "INSERT INTO atoms (id, node_id, kind, device_uuid, model, numa_node, nvlink_domain, health, bookable)"
                   " VALUES (%s, %s, 'gpu', %s, 'A', 0, 'd0', 'healthy', true)", (atom_id, node, atom_id))
        _sql(conn, f"INSERT INTO bookings (atom_id, allocation_id, during) SELECT %s, id, {during}"
                   " FROM allocations WHERE node_id = %s LIMIT 1", (atom_id, start, end, node))


def _changes(conn: psycopg.Connection, pool: str, changes: list[dict], base: int, first: int) -> None:
    i = 0
    while i < len(changes):
        group = [changes[i]]
        while i + len(group) < len(changes) and changes[i + len(group)]["same_tx"]:
            group.append(changes[i + len(group)])
        with conn.transaction():
            for k, change in enumerate(group):
                try:
                    with conn.transaction():
                        _change(conn, pool, change, base, first + i + k)
                except psycopg.errors.IntegrityError:
                    pass  # refused (an overlap): rolled back to the savepoint, nothing notified
        i += len(group)


def _index_bookings(index: PoolIndex) -> set[tuple]:
    return {(a.id, s, e) for n in index.nodes.values() for a in n.atoms.values() for s, e in a.intervals}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(fleet=st.lists(node_st, min_size=1, max_size=5), changes=st.lists(change_st, max_size=12),
       built_after=st.integers(0, 12), asks=st.lists(ask_st, min_size=1, max_size=4))
def test_changes_after_the_build_reach_the_index_as_deltas(
    world: World, fleet: list[dict], changes: list[dict], built_after: int, asks: list[dict],
) -> None:
    """Bookings inserted, deleted, moved and released in bulk, atoms added with their bookings and
    node facts changed after the index was built: once the index has applied every notification
    (booking deltas, node re-reads) it holds the tables' bookings and answers what SQL answers.
    The build happens after a random prefix of the changes, so the notifications of that prefix
    arrive after a read that already saw them (they must change nothing)."""
    built_after = min(built_after, len(changes))
    with psycopg.connect(world.conninfo, autocommit=True) as conn, \
            psycopg.connect(world.conninfo, autocommit=True) as listener:
        listener.execute("LISTEN bc_capacity")
        base = _sql(conn, "SELECT epoch_ms(compute_now()) AS now")[0]["now"] + 2 * HOUR
        pool = _seed(conn, world, fleet, base)
        _changes(conn, pool, changes[:built_after], base, 0)

        async def build_then_apply() -> tuple[PoolIndex, set[tuple]]:
            db = AsyncConnectionPool(world.conninfo, min_size=1, max_size=2, open=False)
            await db.open()
            try:
                capacity = CapacityIndex(db)
                capacity.pools, capacity.ready = {pool: await _built(world.conninfo, pool)}, True
                _changes(conn, pool, changes[built_after:], base, built_after)
                token = uuid.uuid4().hex
                conn.execute("SELECT pg_notify('bc_capacity', 'barrier ' || %s)", (token,))
                payloads, heard = [], False
                for note in listener.notifies(timeout=30):
                    if note.payload == f"barrier {token}":
                        heard = True
                        break
                    if note.payload.startswith(pool + " "):
                        payloads.append(note.payload)
                assert heard
                await capacity._apply(payloads)
                index = capacity.pools[pool]
                return index, _index_bookings(index)
            finally:
                await db.close()

        index, held = asyncio.run(build_then_apply())
        rows = _sql(conn, "SELECT b.atom_id, epoch_ms(lower(b.during)) AS s, epoch_ms(upper(b.during)) AS e"
                          " FROM bookings b JOIN atoms a ON a.id = b.atom_id JOIN nodes n ON n.id = a.node_id"
                          " WHERE n.pool_id = %s", (pool,))
        assert held == {(r["atom_id"], r["s"], r["e"]) for r in rows}, json.dumps(changes)
        for ask in asks:
            w = _window(ask, base)
            assert index.fits(w) == _brute_force(conn, pool, w), (ask, json.dumps(changes))


# -- changes made elsewhere reach the live index ---------------------------------------------

def _live(stack: tuple, world: World) -> PoolIndex:
    server, _ = stack
    capacity = server.app.runtime.capacity
    server.call(capacity.barrier())
    pool = capacity.pool(world.pool_id)
    assert pool is not None
    return pool


def _free(pool: PoolIndex, node_id: str, start: int, end: int) -> int:
    return sum(1 for a in pool.nodes[node_id].usable("") if a.free_for(start, end))


@pytest.fixture
def small_world(stack: tuple) -> World:
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=1)
    yield w
    w.close()


def test_a_create_cancel_and_extend_reach_the_index(stack: tuple, small_world: World) -> None:
    world = small_world
    node = world.nodes[0].id
    start = world.later(24)
    r = world.create(count=3, start=start, duration="2h")
    assert r.state == "placed", r
    pool = _live(stack, world)
    assert _free(pool, node, start, start + 2 * HOUR) == 5
    assert _free(pool, node, start + 2 * HOUR, start + 3 * HOUR) == 8

    world.user.res("Extend", pb.ExtendReservationRequest(tenant_id=world.tenant, reservation_id=r.id, by="1h",
                                                         idempotency_key="ext"))
    pool = _live(stack, world)
    assert _free(pool, node, start + 2 * HOUR, start + 3 * HOUR) == 5

    world.user.res("Cancel", pb.CancelReservationRequest(tenant_id=world.tenant, reservation_id=r.id))
    pool = _live(stack, world)
    assert _free(pool, node, start, start + 3 * HOUR) == 8


def test_a_cordon_and_a_gpu_health_change_reach_the_index(stack: tuple, small_world: World) -> None:
    world = small_world
    node = world.nodes[0]
    start = world.later(24)
    w = Window(1, planner.ANY, "", {}, start, start + HOUR)
    assert _live(stack, world).fits(w) == {node.id}

    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node.id, state="cordoned"))
    assert _live(stack, world).fits(w) == set()
    world.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=node.id, state="ready"))
    assert _live(stack, world).fits(w) == {node.id}

    world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(
        node_id=node.id, device_uuid=f"GPU-{node.name}-0", health="unhealthy"))
    pool = _live(stack, world)
    assert len(pool.nodes[node.id].usable("")) == 7
    assert pool.fits(Window(8, planner.ANY, "", {}, start, start + HOUR)) == set()


def test_a_new_node_and_a_direct_booking_reach_the_index(stack: tuple, small_world: World) -> None:
    """A node registered after the build and a booking written by some other path (here plain
    SQL, as a repair or an expiry would) are in the index's next answer."""
    world = small_world
    added = world.add_node()
    start = world.later(24)
    assert added.id in _live(stack, world).nodes
    world.sql("INSERT INTO identities (id, kind, name) VALUES ('u', 'user', 'u') ON CONFLICT DO NOTHING")
    rid = "rsv_" + uuid.uuid4().hex[:16]
    world.sql("INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request,"
              " request_hash, state, during) VALUES (%s, %s, %s, 'u', %s, %s, 'h', 'placed',"
               " tstzrange(compute_now(), compute_now() + interval '1 day'))",
              (rid, world.tenant, world.pool_id, rid, Jsonb({})))
    world.sql("INSERT INTO allocations (id, reservation_id, node_id, state, device_ids) VALUES (%s, %s, %s, 'placed', '{}')",
              ("alloc_" + rid, rid, added.id))
    world.sql("INSERT INTO bookings (atom_id, allocation_id, during) SELECT id, %s,"
              " tstzrange(from_epoch_ms(%s), from_epoch_ms(%s), '[)') FROM atoms WHERE node_id = %s",
              ("alloc_" + rid, start, start + HOUR, added.id))
    pool = _live(stack, world)
    assert _free(pool, added.id, start, start + HOUR) == 0
    assert pool.fits(Window(8, planner.ANY, "", {}, start, start + HOUR)) == {world.nodes[0].id}
    world.sql("DELETE FROM allocations WHERE id = %s", ("alloc_" + rid,))
    assert _free(_live(stack, world), added.id, start, start + HOUR) == 8


def test_creates_are_planned_by_the_index(stack: tuple, small_world: World) -> None:
    """With the index built, a create is planned in memory (the SQL shortlist is the fallback)."""
    world = small_world
    capacity = stack[0].app.runtime.capacity
    _live(stack, world)
    before = capacity.planned
    start = world.later(30)
    r = world.create(count=2, start=start, duration="1h")
    assert r.state == "placed"
    assert capacity.planned == before + 1
    assert _free(_live(stack, world), world.nodes[0].id, start, start + HOUR) == 6


def test_a_stale_index_proposes_and_the_commit_decides(stack: tuple, small_world: World) -> None:
    """The index believes a booked node is free (as if a notification were still on its way): the
    create's insert finds the overlap, refreshes that node from the table under the lock and, with
    nothing else fitting, the reservation goes pending; nothing is double-booked."""
    world = small_world
    server = stack[0]
    capacity = server.app.runtime.capacity
    node = world.nodes[0].id
    start = world.later(40)
    assert world.create(count=8, start=start, duration="1h").state == "placed"
    pool = _live(stack, world)
    stale = pool.nodes[node].with_bookings([], pool.nodes[node].ticket)

    async def forget() -> None:
        pool.put(stale)
    server.call(forget())
    assert _free(pool, node, start, start + HOUR) == 8
    before = capacity.planned

    r = world.create(count=8, start=start, duration="1h")
    assert r.state == "pending"
    assert capacity.planned == before + 1  # the stale index proposed the node
    assert _free(capacity.pool(world.pool_id), node, start, start + HOUR) == 0  # refreshed by the lost race
    booked = world.sql("SELECT count(*) FROM bookings b JOIN atoms a ON a.id = b.atom_id WHERE a.node_id = %s"
                       " AND b.during && tstzrange(from_epoch_ms(%s), from_epoch_ms(%s))", (node, start, start + HOUR))
    assert booked == [(8,)]


def test_a_required_label_counts_only_with_its_value_and_source() -> None:
    """A binding's capability label (e.g. bc.dev/cap.binding.kubernetes) must be the system's:
    an operator label of the same name and value does not make a node fit."""
    key = "bc.dev/cap.binding.kubernetes"
    window = Window(1, "any", "", {}, 0, 1, required=((key, "true", "system"),))

    def node(labels: dict) -> Node:
        return Node("node_x", "pool_x", "x", labels, frozenset(), "ready", "connected")

    assert node({key: {"value": "true", "source": "system"}}).matches(window)
    assert not node({key: {"value": "true", "source": "operator"}}).matches(window)
    assert not node({}).matches(window)
    assert node({}).matches(Window(1, "any", "", {}, 0, 1))
