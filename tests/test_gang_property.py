"""No partial gang ever holds devices (issue "Gangs", spec "How a gang is placed"): over random
fleets, bursts of concurrent gangs and single requests, and releases, every gang reservation holds
all its members or none, its members share one label value, and no node is held twice. Checked
after every step, and also over and over while each burst is in flight."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from bettercompute.v1 import reservations_pb2 as pb
from tests.conftest import stateful_examples
from tests.invariants import check_invariants
from tests.support import Client, ServerThread, World, gpus, make_world
from tests.test_concurrency import outcome

KEY = "fabric.domain"
HOUR_MS = 3_600_000

# Every live member of every gang reservation of the tenant, with its node's label value.
GANG_MEMBERS = """
SELECT r.id, r.state, (r.request #>> '{gang,size}')::int AS size, r.request #>> '{gang,topologyKey}' AS gang_key,
       a.node_id, a.gang_group, n.labels -> (r.request #>> '{gang,topologyKey}') ->> 'value' AS label
FROM reservations r
LEFT JOIN allocations a ON a.reservation_id = r.id AND a.state IN ('placed', 'binding', 'bound')
LEFT JOIN nodes n ON n.id = a.node_id
WHERE r.tenant_id = %s AND r.request ? 'gang'
"""


def gang_violations(conn: psycopg.Connection, tenant: str) -> list[str]:
    """What breaks "all members or none, one label value, no node twice", read in one snapshot."""
    with conn.transaction():
        rows = conn.execute(GANG_MEMBERS, (tenant,)).fetchall()
    held: dict[str, list[tuple[Any, ...]]] = {}
    for rid, state, size, key, node, group, label in rows:
        held.setdefault(rid, [])
        if node is not None:
            held[rid].append((state, size, key, node, group, label))
    problems = []
    for rid, members in held.items():
        if not members:
            continue
        state, size, key = members[0][:3]
        nodes = [m[3] for m in members]
        if len(members) != size:
            problems.append(f"{rid} ({state}) holds {len(members)} of {size} members")
        if len(set(nodes)) != len(nodes):
            problems.append(f"{rid} holds a node twice: {nodes}")
        if len({m[4] for m in members}) != 1:
            problems.append(f"{rid} members placed under several values: {[m[4] for m in members]}")
        if key and (len({m[5] for m in members}) != 1 or members[0][5] is None):
            problems.append(f"{rid} members do not share one {key}: {[m[5] for m in members]}")
    return problems


@dataclass(frozen=True)
class Ask:
    count: int
    size: int  # 1: a single request
    key: str
    start_in: int | None


ASKS = st.builds(
    Ask,
    count=st.sampled_from([1, 2, 4, 8]),
    size=st.sampled_from([1, 1, 2, 3, 4]),
    key=st.sampled_from([KEY, KEY, ""]),
    start_in=st.sampled_from([None, HOUR_MS, HOUR_MS + 20 * 60_000]),
)
NODES = st.lists(st.tuples(st.sampled_from(["fab-a", "fab-b", "fab-c", ""]), st.sampled_from([4, 8])),
                 min_size=2, max_size=8)


class GangsAndSingles(RuleBasedStateMachine):
    stack: tuple[ServerThread, Client]

    def __init__(self) -> None:
        super().__init__()
        server, root = self.stack
        self.w: World = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=10_000)
        self.known: list[str] = []

    @initialize(nodes=NODES)
    def fleet(self, nodes: list[tuple[str, int]]) -> None:
        for value, count in nodes:
            name = f"p{uuid.uuid4().hex[:8]}"
            self.w.add_node(gpus(name, count=count), name=name, system_labels={KEY: value} if value else {})

    def _create(self, ask: Ask, now_ms: int) -> tuple[str, Any]:
        kw: dict[str, Any] = {}
        if ask.size > 1:
            kw["gang"] = pb.Gang(size=ask.size, topology_key=ask.key)
        if ask.start_in is not None:
            kw["start"] = now_ms + ask.start_in
        return outcome(lambda: self.w.create(count=ask.count, duration="2h", **kw))

    @rule(asks=st.lists(ASKS, min_size=2, max_size=6))
    def burst(self, asks: list[Ask]) -> None:
        """Creates in flight together, while a watcher checks the gangs again and again."""
        now_ms = self.w.sql("SELECT epoch_ms(compute_now())")[0][0]
        done = threading.Event()
        seen: list[str] = []

        def watch() -> None:
            with psycopg.connect(self.w.conninfo, autocommit=True) as conn:
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                while not done.is_set():
                    seen.extend(gang_violations(conn, self.w.tenant))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(len(asks)) as pool:
                results = list(pool.map(lambda a: self._create(a, now_ms), asks))
        finally:
            done.set()
            watcher.join()
        assert seen == [], seen[:5]
        for code, reply in results:
            assert code == "ok", (code, reply)
            self.known.append(reply.id)

    @precondition(lambda self: self.known)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.known))
        code, reply = outcome(lambda: self.w.user.res(
            "Release", pb.ReleaseReservationRequest(tenant_id=self.w.tenant, reservation_id=rid)))
        assert code == "ok", (code, reply)

    @invariant()
    def every_gang_holds_all_its_members_or_none(self) -> None:
        with psycopg.connect(self.w.conninfo, autocommit=True) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            assert gang_violations(conn, self.w.tenant) == []
        check_invariants(self.w.conninfo, self.w.tenant)

    def teardown(self) -> None:
        self.w.close()


def test_no_partial_gang_ever_holds_devices(stack: tuple[ServerThread, Client], pytestconfig: pytest.Config) -> None:
    GangsAndSingles.stack = stack
    run_state_machine_as_test(
        GangsAndSingles,
        settings=settings(max_examples=stateful_examples(pytestconfig), stateful_step_count=8,
                          suppress_health_check=[*settings.default.suppress_health_check,
                                                 HealthCheck.filter_too_much]),
    )
