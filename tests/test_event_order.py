"""Events of one subject are in the order they happened (DESIGN.md section 13: webhooks deliver
"in order per subject"; Watch streams by event id). Ids come from a sequence, so that order holds
only while every writer of a subject's events holds the subject's row lock from before it takes
an event id until it commits: a writer that took its id first and waited for the lock after would
commit an event describing a later state under a smaller id than the one it waited for.

The audit (2026-12-02) found every emitter of reservation, reservation-grant and provider
reservation events locking its subject first. This test pins it for the busiest subject: a
reservation extended and released while the reconciler moves it, each writer queued on the row
in a known order, by a transaction the test holds open and a lock the test holds."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf.json_format import MessageToDict

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from controlplane.common.locks import pool_lock_key
from controlplane.config import Settings
from controlplane.reservations import reconciler, states
from tests.support import Client, ServerThread, World, get, make_world
from tests.test_hostile_faults import WAIT, until
from tests.test_watch import Stream

HOUR = 3_600_000


@pytest.fixture
def api_world(database: str) -> Iterator[tuple[World, ServerThread]]:
    """A control plane without workers (the test runs the reconciler's pass itself, on a
    connection it holds), with clock control."""
    server = ServerThread(database, Settings(database_url=database, clock_control=True), workers=False)
    root = Client(server.endpoint, bootstrap.ensure_root(database))
    world = make_world(server.endpoint, root, database)
    try:
        yield world, server
    finally:
        world.close()
        root.close()
        server.stop()


class HeldPass:
    """The reconciler's pass over one reservation in a transaction of a pooled connection, left
    open once the pass is done until `commit()`: what the work queue runs, held at its commit."""

    def __init__(self, server: ServerThread, rid: str) -> None:
        self.server, self.rid = server, rid
        self.done = threading.Event()
        self.pid = 0
        self._go: asyncio.Event | None = None
        self._future = asyncio.run_coroutine_threadsafe(self._run(), server.loop)

    async def _run(self) -> None:
        self._go = asyncio.Event()
        rt = self.server.app.runtime
        async with rt.pool.connection() as conn:
            async with conn.transaction():
                self.pid = (await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone())["pid"]
                await reconciler.reconcile(conn, rt, self.rid)
                self.done.set()
                await self._go.wait()

    def commit(self) -> None:
        """Commit the pass (a no-op once committed)."""
        until(lambda: self._go is not None, "the pass to start")
        self.server.loop.call_soon_threadsafe(self._go.set)  # type: ignore[union-attr]
        self._future.result(WAIT)


def waiting_behind(conninfo: str, pid: int) -> list[int]:
    """The backends waiting on a lock that `pid` holds, directly or behind another waiter."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [p for (p,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            " AND pid <> pg_backend_pid()")
            if p != pid and _blocked_by(conn, p, pid)]


def _blocked_by(conn: psycopg.Connection, waiter: int, holder: int, depth: int = 0) -> bool:
    blockers = conn.execute("SELECT unnest(pg_blocking_pids(%s))", (waiter,)).fetchall()
    return any(b == holder or (depth < 4 and _blocked_by(conn, b, holder, depth + 1)) for (b,) in blockers)


def took_event_ids(conninfo: str, pids: list[int]) -> list[int]:
    """Those of `pids` whose transaction took an event id: next_event_id() (migration 0050) holds
    the writer's floor lock (an advisory lock, two-key form objsubid 2) from its first id to commit."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [p for (p,) in conn.execute(
            "SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
            " AND classid >= 1000000000 AND pid = ANY(%s)", (pids,))]


def in_background(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    answer: dict[str, Any] = {}

    def run() -> None:
        try:
            answer["ok"] = call()
        except grpc.RpcError as exc:
            answer["error"] = (exc.code(), exc.details())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, answer


def test_a_reservation_extended_and_released_while_the_reconciler_moves_it_has_its_events_in_that_order(
        api_world: tuple[World, ServerThread]) -> None:
    """The reconciler's pass moves a placed reservation to binding at its start and is held open
    (its event id taken, not committed). An extend, let through the pool lock only then, waits for
    the row; a release waits behind it. Neither has taken an event id while it waits, and Watch
    (in id order, as webhooks deliver) gives placed, binding, extended, released: the order they
    committed in. A writer that took its id before the row lock would show here, the release's
    event before the extend's or the binding's."""
    world, server = api_world
    start = world.later(1)
    r = world.create(count=1, start=start, duration="1h")
    assert r.state == "placed"
    world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=HOUR + 60_000))  # past its start
    new_end = r.during.end + HOUR
    extend = lambda: world.user.res("Extend", pb.ExtendReservationRequest(  # noqa: E731
        tenant_id=world.tenant, reservation_id=r.id, until=new_end, idempotency_key="order-1"))
    release = lambda: world.user.res("Release", pb.ReleaseReservationRequest(  # noqa: E731
        tenant_id=world.tenant, reservation_id=r.id))

    with psycopg.connect(world.conninfo) as gate:
        # The pool lock, so the extend (which takes it before the row) waits until the pass holds the row.
        gate.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (pool_lock_key(world.pool_id),))
        gate_pid = gate.execute("SELECT pg_backend_pid()").fetchone()[0]
        extending, extended = in_background(extend)
        [extender] = until(lambda: waiting_behind(world.conninfo, gate_pid), "the extend to wait for the pool lock")
        held = HeldPass(server, r.id)
        assert held.done.wait(WAIT), "the reconciler's pass did not finish"
        gate.rollback()  # the extend goes on to the row, which the pass holds
    try:
        until(lambda: extender in waiting_behind(world.conninfo, held.pid), "the extend to wait for the row")
        releasing, released = in_background(release)
        waiters = until(lambda: len(got := waiting_behind(world.conninfo, held.pid)) == 2 and got,
                        "the release to wait behind the extend")
        early = took_event_ids(world.conninfo, waiters)
        assert took_event_ids(world.conninfo, [held.pid]) == [held.pid]  # the check sees a writer that did
    finally:
        held.commit()
    extending.join(WAIT)
    releasing.join(WAIT)
    assert early == [], "a writer waiting for the reservation's row lock had already taken an event id"

    assert extended.get("ok") is not None and extended["ok"].extended, extended
    assert released.get("ok") is not None and released["ok"].state == "released", released
    with Stream(world.user, tenant_id=world.tenant, after_id=0, subject=f"reservation/{r.id}") as stream:
        seen = stream.take(4, timeout=WAIT)
        stream.quiet()
    assert [e.type for e in seen] == ["reservation.placed", "reservation.binding", "reservation.extended",
                                      "reservation.released"]
    data = [MessageToDict(e.data) for e in seen]
    assert [d["state"] for d in data] == ["placed", "binding", "binding", "released"]
    assert (data[2]["from"], data[2]["to"]) == (r.during.end, new_end)
    for before, after in zip(data, data[1:]):  # every step one the state table allows
        assert before["state"] == after["state"] or before["state"] in states.sources_of(after["state"])
    assert get(world, r.id).state == data[-1]["state"]
