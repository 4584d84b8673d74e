"""Concurrency invariants against the real control plane (STYLE.md "Tests"): no atom is ever
double-booked, quota used equals the sum of live charges and never exceeds the limit, an
idempotency key names one reservation, and every state reached is allowed by the state table.

The invariants are read in SQL, in one REPEATABLE READ snapshot, without trusting the EXCLUDE
constraint or the quota code: they are recomputed from the rows.
"""

from __future__ import annotations

import random
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from bettercompute.v1 import reservations_pb2 as pb
from controlplane.common.status import error_info
from controlplane.ids import draft_id
from controlplane.reservations import states
from tests.conftest import stateful_examples
from tests.invariants import ENDED, check_invariants
from tests.support import Client, ServerThread, World, gpus, make_world

def outcome(call: Any) -> tuple[str, Any]:
    """("ok", reply) or (spec error code, details) of one RPC."""
    try:
        return "ok", call()
    except grpc.RpcError as exc:
        info = error_info(exc)
        if info is None:
            return f"grpc:{exc.code().name}", str(exc)
        return info.reason, dict(info.metadata)


# Many concurrent creates and releases -----------------------------------------------------

SHAPES = [(1, ""), (2, ""), (4, ""), (8, ""), (2, "nvlink-all"), (4, "nvlink-all"), (8, "nvlink-all")]
HOUR_MS = 3_600_000
# Windows start an hour ahead (before any start-time machinery wakes), staggered by up to 30
# minutes, two hours long: they differ, and all of them overlap, so the pool runs out.
STARTS = [HOUR_MS, HOUR_MS + 15 * 60_000, HOUR_MS + 30 * 60_000]


@dataclass(frozen=True)
class Call:
    key: str
    count: int
    topology: str
    start_in: int = HOUR_MS


def test_concurrent_creates_and_releases_keep_every_invariant(stack: tuple[ServerThread, Client]) -> None:
    server, root = stack
    quota = 28  # more than the 24 GPUs: the pool runs out first (pending), then the quota
    w = make_world(server.endpoint, root, server.conninfo, nodes=3, quota=quota)
    rnd = random.Random(20240611)
    now_ms = w.sql("SELECT epoch_ms(compute_now())")[0][0]

    # Shared keys: the same request from several threads, a burst of three at once (so twins race
    # through admission together) and the rest later (so they find the key past the draft stage).
    groups: list[list[Call]] = []
    for i in range(12):
        count, topology = rnd.choice(SHAPES)
        call = Call(f"shared-{i}", count, topology, rnd.choice(STARTS))
        groups += [[call] * 3] + [[call]] * rnd.randint(1, 3)
    while sum(map(len, groups)) < 150:
        count, topology = rnd.choice(SHAPES)
        groups.append([Call(f"single-{len(groups)}", count, topology, rnd.choice(STARTS))])
    rnd.shuffle(groups)
    calls = [c for g in groups for c in g]

    def create(c: Call) -> tuple[str, Any]:
        return outcome(lambda: w.create(key=c.key, count=c.count, topology=c.topology, duration="2h",
                                        start=now_ms + c.start_in))

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(create, calls))

    by_key: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for c, (code, reply) in zip(calls, results):
        by_key[c.key].append((code, reply))
        if code == "ok":
            assert reply.state in (states.PLACED, states.PENDING), (c, reply.state)
            assert reply.id == draft_id(w.tenant, w.user_id, c.key), "the id is the draft id of the key"
        else:
            assert code == "QUOTA_EXCEEDED", (c, code, reply)
    for key, answers in by_key.items():
        codes = {code for code, _ in answers}
        ids = {reply.id for code, reply in answers if code == "ok"}
        # While nothing is refunded, a key answered once is answered the same way every time.
        assert len(codes) == 1 and len(ids) <= 1, (key, answers)

    placed = {r.id for code, r in results if code == "ok" and r.state == states.PLACED}
    assert placed, "nothing was placed"
    assert any(code == "QUOTA_EXCEEDED" for code, _ in results), "the quota never ran out"

    s = check_invariants(w.conninfo, w.tenant)
    keys = {k["idempotency_key"] for k in s["keys"]}
    assert keys == {c.key for c in calls}, "every key has exactly one row"
    assert s["used"][0]["used"] > quota - 8, "the quota was not used up"

    # Release half of them concurrently, some twice at once.
    admitted = sorted({r.id for code, r in results if code == "ok"})
    to_release = rnd.sample(admitted, len(admitted) // 2)
    release_calls = to_release + rnd.sample(to_release, len(to_release) // 3)
    rnd.shuffle(release_calls)

    def release(rid: str) -> tuple[str, Any]:
        request = pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=rid)
        return outcome(lambda: w.user.res("Release", request))

    with ThreadPoolExecutor(16) as pool:
        released = list(pool.map(release, release_calls))
    for rid, (code, reply) in zip(release_calls, released):
        assert code == "ok", (rid, code, reply)
        assert reply.state in (states.RELEASED, states.CANCELLED), (rid, reply.state)

    s = check_invariants(w.conninfo, w.tenant)
    final = {b["id"]: b["state"] for b in s["bookings"]}
    assert all(final[rid] in (states.RELEASED, states.CANCELLED) for rid in to_release)
    refunded = [c for c in s["charges"] if c["id"] in to_release and c["live"]]
    assert refunded == [], f"released reservations still charged: {refunded}"

    # Churn: creates (fresh keys, some shared), releases and cancels of any key, all at once, while
    # the pending worker places what the releases free.
    ops: list[tuple[str, Call]] = []
    for i in range(6):
        count, topology = rnd.choice(SHAPES)
        ops += [("create", Call(f"churn-shared-{i}", count, topology, rnd.choice(STARTS)))] * 3
    for i in range(40):
        count, topology = rnd.choice(SHAPES)
        ops.append(("create", Call(f"churn-{i}", count, topology, rnd.choice(STARTS))))
    every_key = sorted({c.key for _, c in ops} | set(by_key))
    ops += [(rnd.choice(["release", "release", "cancel"]), Call(rnd.choice(every_key), 0, ""))
            for _ in range(50)]
    rnd.shuffle(ops)

    def churn(op: tuple[str, Call]) -> tuple[str, Any]:
        kind, c = op
        if kind == "create":
            return create(c)
        rid = draft_id(w.tenant, w.user_id, c.key)
        if kind == "release":
            return release(rid)
        request = pb.CancelReservationRequest(tenant_id=w.tenant, reservation_id=rid)
        return outcome(lambda: w.user.res("Cancel", request))

    with ThreadPoolExecutor(16) as pool:
        churned = list(pool.map(churn, ops))
    allowed = {
        "create": {"QUOTA_EXCEEDED", states.PLACED, states.PENDING, states.RELEASED, states.CANCELLED},
        "release": {"NOT_FOUND", states.RELEASED, states.CANCELLED},
        "cancel": {"NOT_FOUND", "INVALID_STATE", states.CANCELLED},
    }
    ids_by_key: dict[str, set[str]] = defaultdict(set)
    for (kind, c), (code, reply) in zip(ops, churned):
        answer = reply.state if code == "ok" else code
        assert answer in allowed[kind], (kind, c, code, reply)
        if code == "ok":
            ids_by_key[c.key].add(reply.id)
    assert all(ids == {draft_id(w.tenant, w.user_id, k)} for k, ids in ids_by_key.items()), ids_by_key
    check_invariants(w.conninfo, w.tenant)


# A random walk of create / release / cancel, checking the invariants after every step ----------

TOPOLOGIES = ["", "nvlink-all", "numa"]
START_IN = st.sampled_from([None, HOUR_MS])  # now (binding starts at once) or an hour ahead
CREATE = "compute:reservations:create"
# People may book; an agent in a delegated session needs its person's confirmation to create.
AGENT_POLICY = "permit(principal, action, resource) unless { context.delegated };"


class CreateReleaseCancel(RuleBasedStateMachine):
    """One small pool per run: two 4-GPU nodes (one with two NVLink domains), quota 6. A person
    creates, releases and cancels; their agent creates too, held for the person's confirmation,
    which the person approves or rejects, or lets run out."""

    stack: tuple[ServerThread, Client]

    def __init__(self) -> None:
        super().__init__()
        server, root = self.stack
        self.w: World = make_world(server.endpoint, root, server.conninfo, nodes=0, quota=6, policy=AGENT_POLICY)
        for domains in (1, 2):
            name = f"s{uuid.uuid4().hex[:8]}"
            self.w.add_node(gpus(name, count=4, domains=domains), name=name)
        self.agent_id, self.agent = self.w.identity(
            kind="agent", person_identity_id=self.w.user_id, confirm_actions=[CREATE])
        self.shapes: dict[str, tuple[int, str, int | None]] = {}  # key -> count, topology, start
        self.known: dict[str, str] = {}  # reservation id -> the state last answered
        self.confirmations: dict[str, tuple[str, str]] = {}  # reservation id -> (confirmation id, state)

    def _create(self, who: str, key: int, count: int, topology: str, start_in: int | None) -> tuple[str, str, Any]:
        k = f"{who}{key}"
        if k not in self.shapes:
            start = None if start_in is None else self.w.sql("SELECT epoch_ms(compute_now())")[0][0] + start_in
            self.shapes[k] = (count, topology, start)
        count, topology, start = self.shapes[k]
        client, identity = (self.w.user, self.w.user_id) if who == "u" else (self.agent, self.agent_id)
        rid = draft_id(self.w.tenant, identity, k)
        code, reply = outcome(lambda: self.w.create(client, key=k, count=count, topology=topology, start=start))
        if code == "ok":
            assert reply.id == rid
            before = self.known.get(rid)
            if before in ENDED:
                assert reply.state == before, "a retry returns the stored reservation"
            else:
                # Placed, or binding already when it starts now (the reconciler runs meanwhile).
                assert reply.state in states.BOOKED | {states.PENDING, states.EXPIRED}, reply.state
            self.known[rid] = reply.state
        return rid, code, reply

    @rule(key=st.integers(0, 5), count=st.integers(1, 4), topology=st.sampled_from(TOPOLOGIES), start_in=START_IN)
    def person_creates(self, key: int, count: int, topology: str, start_in: int | None) -> None:
        rid, code, reply = self._create("u", key, count, topology, start_in)
        if code == "QUOTA_EXCEEDED":
            assert rid not in self.known, f"QUOTA_EXCEEDED for {rid}, already admitted as {self.known[rid]}"
        else:
            assert code == "ok", (code, reply)
            assert reply.state != states.EXPIRED

    @rule(key=st.integers(0, 3), count=st.integers(1, 4), topology=st.sampled_from(TOPOLOGIES), start_in=START_IN)
    def agent_creates(self, key: int, count: int, topology: str, start_in: int | None) -> None:
        rid, code, reply = self._create("a", key, count, topology, start_in)
        held = self.confirmations.get(rid)
        decided = held[1] if held else None
        if code == "CONFIRMATION_REQUIRED":
            assert decided in (None, "pending"), (decided, reply)
            assert reply["reservationId"] == rid
            if held:
                assert reply["confirmationId"] == held[0], "a retry asks again for the same confirmation"
            self.confirmations[rid] = (reply["confirmationId"], "pending")
        elif code == "ACCESS_DENIED":
            assert decided == "rejected", (decided, reply)
        elif code == "QUOTA_EXCEEDED":
            assert decided == "approved" and rid not in self.known, (decided, reply)
        else:
            assert code == "ok", (decided, code, reply)
            if decided == "deadline-passed":
                assert reply.state == states.EXPIRED, "a retry after the deadline finds it expired"
            else:
                assert decided == "approved" and reply.state != states.EXPIRED, (decided, reply.state)

    @precondition(lambda self: any(s == "pending" for _, s in self.confirmations.values()))
    @rule(data=st.data(), verdict=st.sampled_from(["Approve", "Reject", "deadline-passes"]))
    def person_decides(self, data: st.DataObject, verdict: str) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, (_, s) in self.confirmations.items() if s == "pending")))
        cid = self.confirmations[rid][0]
        if verdict == "deadline-passes":  # IAM's deadline, moved into the past
            self.w.sql("UPDATE confirmations SET expires_at = compute_now() - interval '1 second'"
                       " WHERE id = %s RETURNING id", (cid,))
            self.confirmations[rid] = (cid, "deadline-passed")
            return
        request = pb.DecideConfirmationRequest(tenant_id=self.w.tenant, confirmation_id=cid)
        decided = self.w.user.conf(verdict, request)
        assert decided.state == {"Approve": "approved", "Reject": "rejected"}[verdict]
        self.confirmations[rid] = (cid, decided.state)

    @precondition(lambda self: any(k.startswith("u") for k in self.shapes))
    @rule(data=st.data())
    def person_reuses_a_key_for_another_request(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(k for k in self.shapes if k.startswith("u"))))
        count, topology, start = self.shapes[k]
        code, details = outcome(lambda: self.w.create(key=k, count=count % 4 + 1, topology=topology, start=start))
        assert code == "CONFLICT", (code, details)
        assert details["reservationId"] == draft_id(self.w.tenant, self.w.user_id, k)

    @precondition(lambda self: self.known)
    @rule(data=st.data())
    def person_releases(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.known)))
        before = self.known[rid]
        code, reply = outcome(lambda: self.w.user.res(
            "Release", pb.ReleaseReservationRequest(tenant_id=self.w.tenant, reservation_id=rid)))
        assert code == "ok", (code, reply)
        if before in ENDED:
            assert reply.state == before, "releasing an ended reservation changes nothing"
        else:
            assert reply.state in (states.RELEASED, states.CANCELLED), reply.state
        self.known[rid] = reply.state

    @precondition(lambda self: self.known)
    @rule(data=st.data())
    def person_cancels(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.known)))
        before = self.known[rid]
        code, reply = outcome(lambda: self.w.user.res(
            "Cancel", pb.CancelReservationRequest(tenant_id=self.w.tenant, reservation_id=rid)))
        if before in ENDED:
            assert code == "INVALID_STATE", (before, code, reply)
            return
        if code == "INVALID_STATE":  # started meanwhile: past its start, or binding or active
            assert reply["state"] in (states.BINDING, states.ACTIVE) or reply.get("reason") == "started", (before, reply)
            return
        assert code == "ok", (before, code, reply)
        assert reply.state == states.CANCELLED
        self.known[rid] = reply.state

    @invariant()
    def invariants_hold(self) -> None:
        check_invariants(self.w.conninfo, self.w.tenant)

    def teardown(self) -> None:
        self.w.close()  # the user's and the agent's channels, and the SQL connection


def test_random_create_release_cancel_keeps_every_invariant(
    stack: tuple[ServerThread, Client], pytestconfig: pytest.Config
) -> None:
    """Deadline and seed come from the suite's Hypothesis profile (tests/conftest.py); --slow
    runs more examples."""
    CreateReleaseCancel.stack = stack
    run_state_machine_as_test(
        CreateReleaseCancel,
        settings=settings(max_examples=stateful_examples(pytestconfig), stateful_step_count=20,
                          suppress_health_check=[*settings.default.suppress_health_check,
                                                 HealthCheck.filter_too_much]),
    )


def test_releasing_a_reservation_awaiting_confirmation_cancels_it(stack: tuple[ServerThread, Client]) -> None:
    """lifecycle.release cancels a pending, queued or awaiting-confirmation reservation; the state
    table must let each of them become cancelled, or release answers INVALID_STATE."""
    server, root = stack
    w = make_world(server.endpoint, root, server.conninfo, nodes=1, quota=8, policy=AGENT_POLICY)
    _, agent = w.identity(kind="agent", person_identity_id=w.user_id, confirm_actions=[CREATE])
    code, details = outcome(lambda: w.create(agent, key="held", count=1))
    assert code == "CONFIRMATION_REQUIRED", (code, details)
    rid = details["reservationId"]
    code, reply = outcome(lambda: w.user.res(
        "Release", pb.ReleaseReservationRequest(tenant_id=w.tenant, reservation_id=rid)))
    assert code == "ok", (code, reply)
    assert reply.state == states.CANCELLED
    check_invariants(w.conninfo, w.tenant)
