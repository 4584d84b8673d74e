"""Webhook and Watch defects an earlier review left: a delivery sent while a smaller event id was
still uncommitted (a client resuming Watch after it missed that event), a few tenants' dead DNS
names holding every lookup thread, and a claim that read every pending delivery to pick a few.
Real PostgreSQL, a real control plane, real HTTP receivers on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import psycopg
import pytest

from controlplane.webhooks import queries, targets
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world, rpc_error
from tests.test_hostile_webhooks_watch import Resolver, resolver  # noqa: F401 - names under blackhole.test never answer
from tests.test_watch import Stream, _begin_event, kinds
from tests.test_webhooks import LOOPBACK, Receiver, create_hook, eventually, reserve


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=5)


def _until(check: Any, seconds: float) -> None:
    """Wait until `check()` or `seconds` pass, whichever comes first (asserts nothing)."""
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_webhook_sends_an_event_only_once_every_smaller_id_is_final(world: World) -> None:
    """A client resumes Watch after the last event id it received, by Watch or by webhook. Event
    ids come from a sequence, so a writer still open can commit a smaller id after a larger one
    committed; Watch holds the larger one back, but a webhook sent it at once, and the event that
    committed after it had an id below the client's resumption point: missed for good. Now, when
    the receiver gets an event, every smaller id of the tenant that will ever exist is visible."""
    visible_below: dict[int, set[int]] = {}

    def answer(event: dict[str, Any], attempt: int) -> int:
        with psycopg.connect(world.conninfo, autocommit=True) as conn:
            rows = conn.execute("SELECT id FROM events WHERE tenant_id = %s AND id < %s",
                                (world.tenant, event["id"])).fetchall()
        visible_below.setdefault(event["id"], {row[0] for row in rows})
        return 200

    receiver = Receiver(answer)
    try:
        create_hook(world, receiver.url)  # every type
        slow = _begin_event(world, "test/slow")  # a writer that took an id and stays open
        slow_id = slow.execute("SELECT currval('events_id_seq')").fetchone()[0]
        try:
            subject = reserve(world)  # a larger id, committed first
            _until(lambda: receiver.of(subject), 3)  # a delivery that does not wait comes now
        finally:
            slow.commit()
            slow.close()
        placed = eventually(lambda: receiver.of(subject))[0].event
        late = eventually(lambda: receiver.of("test/slow"))[0].event
        assert late["id"] == slow_id < placed["id"]
        assert slow_id in visible_below[placed["id"]]  # committed before the larger id went out
        # So a Watch resumed after the id the webhook gave streams what comes next, and nothing
        # below it is still to commit.
        with Stream(world.user, tenant_id=world.tenant, after_id=placed["id"]) as stream:
            later = reserve(world)
            assert kinds(stream.take(1)) == [("reservation.placed", later)]
        # A writer that rolls back holds nothing for good.
        gone = _begin_event(world, "test/gone")
        try:
            subject = reserve(world)
            _until(lambda: receiver.of(subject), 1)
        finally:
            gone.rollback()
            gone.close()
        eventually(lambda: receiver.of(subject))
        final = {row[0] for row in world.sql("SELECT id FROM events WHERE tenant_id = %s", (world.tenant,))}
        for event_id, seen in visible_below.items():
            assert {i for i in final if i < event_id} <= seen, event_id
    finally:
        receiver.close()


@pytest.fixture(scope="module")
def short(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Loopback receivers allowed; a one-second deadline per attempt (and per URL check)."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=1)


def _hang(world: World, names: list[str]) -> set[str]:
    """Webhooks created at names whose DNS never answers, all at once: the error codes."""
    def create(name: str) -> str:
        with pytest.raises(grpc.RpcError) as exc:
            create_hook(world, f"http://{name}.blackhole.test:9/hook")
        return rpc_error(exc)[1]

    with ThreadPoolExecutor(len(names)) as pool:
        return set(pool.map(create, names))


def test_a_few_tenants_dead_names_cannot_starve_other_tenants_deliveries(
        short: tuple[ServerThread, Client], resolver: Resolver) -> None:
    """Attack: eight tenants each look up names whose DNS never answers (webhooks created at
    them, retried): at four lookups each they held all 32 lookup threads until the resolver gave
    up, and every other tenant's delivery timed out waiting for a thread. Names not known to
    resolve now share half the threads; a delivery host that resolved before keeps the rest."""
    server, root = short
    victim = make_world(server.endpoint, root, server.conninfo)
    hostile = [make_world(server.endpoint, root, server.conninfo, nodes=0) for _ in range(9)]
    receiver = Receiver()
    try:
        port = receiver.url.rsplit(":", 1)[1]
        create_hook(victim, f"http://victim.loop.test:{port}/hook")  # resolved, so known to resolve
        with ThreadPoolExecutor(len(hostile)) as pool:
            codes = set().union(*pool.map(
                lambda w: _hang(w[1], [f"t{w[0]}-{n}" for n in range(targets.LOOKUPS_PER_TENANT * 2)]),
                enumerate(hostile)))
        assert codes == {"INVALID_INPUT"}
        subject = reserve(victim)
        hit = eventually(lambda: receiver.of(subject))[0]  # its lookup found a thread
        assert hit.signed and hit.status == 200
        assert resolver.blocked == targets.UNPROVEN_LOOKUPS  # the rest were refused without a thread
        # A new name is one of those not known to resolve: refused while their share is taken.
        with pytest.raises(grpc.RpcError) as exc:
            create_hook(victim, f"http://new.loop.test:{port}/hook")
        assert rpc_error(exc)[1] == "INVALID_INPUT"
    finally:
        resolver.release.set()
        receiver.close()
        victim.close()
        for w in hostile:
            w.close()


def test_a_name_whose_lookup_hung_is_refused_without_a_thread_for_a_while(
        short: tuple[ServerThread, Client], resolver: Resolver) -> None:
    """A webhook whose host stopped answering DNS took a thread at every attempt, each held until
    the resolver gave up; now the name is refused at once while its lookup hangs and a while after."""
    server, root = short
    world = make_world(server.endpoint, root, server.conninfo, nodes=0)
    try:
        for _ in range(3):  # one after another: each waits out its deadline
            assert _hang(world, ["again"]) == {"INVALID_INPUT"}
        assert resolver.blocked == 1
        resolver.release.set()  # the resolver gives up: still refused for STUCK_SECONDS
        eventually(lambda: targets.LOOKUPS.stuck.get("again.blackhole.test", 0) < float("inf"))
        assert _hang(world, ["again"]) == {"INVALID_INPUT"}
        assert resolver.blocked == 1
    finally:
        resolver.release.set()
        world.close()


def _backlog(world: World, subjects: list[str], per_subject: int) -> None:
    """`per_subject` events of each subject, one subject's after another, committed together."""
    world.sql("""INSERT INTO events (tenant_id, type, subject, data)
                 SELECT %s, 'test.backlog', s.subject, jsonb_build_object('n', n)
                 FROM generate_series(1, %s) n, unnest(%s::text[]) WITH ORDINALITY s(subject, o)
                 ORDER BY o, n""", (world.tenant, per_subject, subjects))


def _rows_read(plan: dict[str, Any], table: str) -> float:
    """Rows an EXPLAIN ANALYZE plan read from `table`: returned or filtered out, every loop."""
    own = 0.0
    if plan.get("Relation Name") == table:
        own = (plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
               + plan.get("Rows Removed by Index Recheck", 0)) * plan["Actual Loops"]
    return own + sum(_rows_read(child, table) for child in plan.get("Plans", []))


def test_the_claim_reads_a_few_rows_of_a_tenant_with_a_long_backlog(world: World) -> None:
    """A receiver that fails holds its subject's later deliveries: all due, none the first of its
    subject. The claim ranked every due pending delivery of every tenant to pick a few, so one
    tenant's backlog made every claim of every worker read all of it. Now it reads, per tenant,
    at most its free slots' worth of deliveries that may go (the first of their subject)."""
    receiver = Receiver(lambda event, attempt: 503)
    try:
        create_hook(world, receiver.url)
        _backlog(world, ["test/stuck"], 2000)
        eventually(lambda: receiver.of("test/stuck"))  # the first one failed: the rest wait behind it
        params = {"limit": 8, "lease_seconds": 10.0, "tenant_limit": 2}
        with psycopg.connect(world.conninfo) as conn:  # rolled back: nothing claimed for good
            cur = psycopg.ClientCursor(conn)
            cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queries.CLAIM, params)
            claim = cur.fetchone()[0][0]["Plan"]
            cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queries.NEXT_DUE, params)
            next_due = cur.fetchone()[0][0]["Plan"]
            conn.rollback()
        read = _rows_read(claim, "webhook_deliveries"), _rows_read(next_due, "webhook_deliveries")
        assert read[0] < 100 and read[1] < 100, read
        assert world.sql("SELECT count(*) FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id"
                         " WHERE w.tenant_id = %s AND d.state = 'pending'", (world.tenant,))[0][0] == 2000
    finally:
        receiver.close()


def test_the_bounded_claim_keeps_order_per_subject_and_the_tenant_cap(world: World) -> None:
    """A backlog over several subjects, and more events of them committed while it drains: each
    subject's events arrive in id order, each only once the one before it was answered, and the
    tenant never holds more leases than its cap (2) when a request arrives."""
    leased: list[tuple[int, int]] = []  # at each request: the tenant's leases, and its subject's

    def answer(event: dict[str, Any], attempt: int) -> int:
        leased.append(world.sql(
            """SELECT count(*), count(*) FILTER (WHERE d.subject = %s)
               FROM webhook_leases l JOIN webhook_deliveries d USING (webhook_id, event_id)
               WHERE l.tenant_id = %s AND l.leased_until > compute_now()""",
            (event["subject"], world.tenant))[0])
        return 200

    receiver = Receiver(answer)
    subjects = [f"test/s{n}" for n in range(5)]
    try:
        create_hook(world, receiver.url)
        _backlog(world, subjects, 6)
        eventually(lambda: receiver.of())
        _backlog(world, subjects, 6)  # while the first batch drains
        eventually(lambda: len(receiver.of()) >= 60, timeout=60)
        ids = {s: [row[0] for row in world.sql(
            "SELECT id FROM events WHERE tenant_id = %s AND subject = %s ORDER BY id", (world.tenant, s))]
            for s in subjects}
        for s in subjects:
            assert [h.event["id"] for h in receiver.of(s)] == ids[s]  # in order, each once
        assert len(leased) == 60
        assert max(tenant for tenant, _ in leased) == 2  # the cap, reached and never passed
        assert {subject for _, subject in leased} == {1}  # one attempt of a subject at a time
    finally:
        receiver.close()
