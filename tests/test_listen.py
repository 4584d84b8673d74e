"""The one LISTEN helper (controlplane.listen) on a real PostgreSQL: notifications in order, the
RECONNECTED marker first and after every lost connection, a notification sent while no one
listened lost but announced by the marker, one log line per outage, a wait its consumer interrupts,
a prompt and clean stop; and
each of its consumers (the work queue, the Watch hub, webhook delivery, the pending worker, the
gateway) still reacting after the server killed its listening connection."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from structlog.testing import capture_logs

from bettercompute.v1 import reservations_pb2 as pb
from controlplane import db, event_hub
from controlplane import listen as listen_module
from controlplane.config import Settings
from controlplane.listen import RECONNECTED, TICK, WOKEN, Listener, listen
from controlplane.runtime import Runtime
from controlplane.webhooks import delivery
from controlplane.workers import queue
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, gpus, make_world
from tests.test_gateway import (  # noqa: F401 - fixtures
    GatewayThread, _close_sessions, connected, gateway, latest, node_row, pool_id)
from tests.test_watch import Stream, kinds
from tests.test_webhooks import LOOPBACK, Receiver, create_hook, receiver  # noqa: F401 - fixture

WAIT = 30  # seconds: a bound on waiting for a positive signal, never a pause


def backends(conninfo: str, name: str) -> list[int]:
    """The backends of the LISTEN connections serving the listener `name` on this database (the
    listeners of one process share one)."""
    return listen_module.backend_pids(conninfo, name)


def until(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return result


def kill_listener(conninfo: str, name: str) -> None:
    """Terminate the listener's backend and wait until it listens again on a new one."""
    [old] = until(lambda: backends(conninfo, name), f"{name} listening")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (old,))
    until(lambda: (pids := backends(conninfo, name)) and old not in pids, f"{name} listening again")


def notify(conninfo: str, *notes: tuple[str, str]) -> None:
    """Each notification in its own transaction, in order."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for channel, payload in notes:
            conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))


async def take(listener: Listener) -> Any:
    return await asyncio.wait_for(anext(listener), WAIT)


async def pids(conninfo: str, name: str) -> list[int]:
    return await asyncio.to_thread(backends, conninfo, name)


# The helper --------------------------------------------------------------------------------

def test_the_marker_comes_first_then_notifications_on_several_channels_in_order(database: str) -> None:
    async def scenario() -> None:
        stopping = asyncio.Event()
        async with listen(database, ["bc_t_a", "bc_t_b"], stopping, name="t-order") as listener:
            assert await take(listener) is RECONNECTED
            sent = [("bc_t_a", "1"), ("bc_t_b", "2"), ("bc_t_a", "3")]
            await asyncio.to_thread(notify, database, *sent)
            async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
                async with conn.transaction():  # one commit: they arrive together
                    for payload in ("4", "5"):
                        await conn.execute("SELECT pg_notify('bc_t_b', %s)", (payload,))
            got = [await take(listener) for _ in range(5)]
            assert [(n.channel, n.payload) for n in got] == sent + [("bc_t_b", "4"), ("bc_t_b", "5")]
            assert listener.connects == 1

    asyncio.run(scenario())


def test_the_marker_comes_again_after_the_server_ends_the_listening_backend(database: str) -> None:
    async def scenario() -> None:
        stopping = asyncio.Event()
        async with listen(database, ["bc_t_a"], stopping, name="t-kill") as listener:
            assert await take(listener) is RECONNECTED
            for round_ in range(2):
                [old] = await pids(database, "t-kill")
                async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
                    await conn.execute("SELECT pg_terminate_backend(%s)", (old,))
                assert await take(listener) is RECONNECTED
                assert old not in await pids(database, "t-kill")
                await asyncio.to_thread(notify, database, ("bc_t_a", f"after-{round_}"))
                assert (await take(listener)).payload == f"after-{round_}"
            assert listener.connects == 3

    asyncio.run(scenario())


def test_a_notification_sent_while_disconnected_is_lost_and_the_marker_says_re_read(
        pg_uri: str, database: str) -> None:
    """The database refuses connections for a while: several attempts fail, one warning is logged
    for the whole outage, the notification sent meanwhile never comes, the marker does."""
    dbname = conninfo_to_dict(database)["dbname"]

    def allow(yes: bool) -> None:
        with psycopg.connect(pg_uri, autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS {'true' if yes else 'false'}")

    async def scenario() -> None:
        stopping = asyncio.Event()
        notifier = await psycopg.AsyncConnection.connect(database, autocommit=True)  # open before the outage
        try:
            async with listen(database, ["bc_t_a"], stopping, name="t-outage") as listener:
                assert await take(listener) is RECONNECTED
                [old] = await pids(database, "t-outage")
                await asyncio.to_thread(allow, False)
                await notifier.execute("SELECT pg_terminate_backend(%s)", (old,))
                reconnected = asyncio.ensure_future(take(listener))
                while listener.failed_attempts < 3:  # a positive signal: the outage is under way
                    assert not reconnected.done()
                    await asyncio.sleep(0.02)
                await notifier.execute("SELECT pg_notify('bc_t_a', 'missed')")
                await asyncio.to_thread(allow, True)
                assert await reconnected is RECONNECTED
                await notifier.execute("SELECT pg_notify('bc_t_a', 'after')")
                assert (await take(listener)).payload == "after"  # not 'missed': re-reading is the rule
        finally:
            await notifier.close()
            await asyncio.to_thread(allow, True)

    with capture_logs() as logs:
        asyncio.run(scenario())
    mine = [e for e in logs if e.get("listener") == "t-outage"]
    assert [e["event"] for e in mine] == ["listen connection lost; reconnecting", "listen connection restored"]
    assert mine[1]["failed_attempts"] >= 3


def test_a_tick_comes_when_nothing_was_heard_for_the_timeout(database: str) -> None:
    async def scenario() -> None:
        stopping = asyncio.Event()
        async with listen(database, ["bc_t_a"], stopping, name="t-tick", timeout=0.05) as listener:
            assert await take(listener) is RECONNECTED
            assert await take(listener) is TICK
            listener.timeout = None
            await asyncio.to_thread(notify, database, ("bc_t_a", "heard"))
            assert (await take(listener)).payload == "heard"

    asyncio.run(scenario())


def test_interrupt_ends_a_wait_with_no_timeout_and_the_connection_goes_on_listening(database: str) -> None:
    async def scenario() -> None:
        stopping = asyncio.Event()
        async with listen(database, ["bc_t_a"], stopping, name="t-woken", interruptible=True) as listener:
            assert await take(listener) is RECONNECTED
            waiting = asyncio.ensure_future(take(listener))  # no timeout: only a notification ends it
            while not listener.waiting:
                await asyncio.sleep(0.01)  # a positive signal: it is waiting for notifications
            listener.interrupt()
            assert await waiting is WOKEN
            # Interrupted before the wait: at once, after what was already received.
            await asyncio.to_thread(notify, database, ("bc_t_a", "1"))
            assert (await take(listener)).payload == "1"
            async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
                async with conn.transaction():  # one commit: they arrive together
                    for payload in ("2", "3"):
                        await conn.execute("SELECT pg_notify('bc_t_a', %s)", (payload,))
            assert (await take(listener)).payload == "2"
            listener.interrupt()
            assert (await take(listener)).payload == "3"
            assert await take(listener) is WOKEN
            await asyncio.to_thread(notify, database, ("bc_t_a", "4"))
            assert (await take(listener)).payload == "4"
            assert listener.connects == 1

    asyncio.run(scenario())


def test_only_a_listener_made_interruptible_takes_an_interrupt(database: str) -> None:
    """The others never watch for one while they wait (one task fewer per wait)."""
    async def scenario() -> None:
        async with listen(database, ["bc_t_a"], asyncio.Event(), name="t-plain") as listener:
            with pytest.raises(RuntimeError, match="not made interruptible"):
                listener.interrupt()

    asyncio.run(scenario())


def test_stopping_ends_it_promptly_and_leaves_no_connection_or_task(database: str) -> None:
    async def consume(listener: Listener, seen: list[Any]) -> None:
        async for item in listener:
            seen.append(item)

    async def stop_while_waiting(conninfo: str, name: str, waiting: Callable[[Listener, list[Any]], bool]) -> None:
        stopping = asyncio.Event()
        seen: list[Any] = []
        async with listen(conninfo, ["bc_t_a"], stopping, name=name) as listener:
            consumer = asyncio.ensure_future(consume(listener, seen))
            while not waiting(listener, seen):
                await asyncio.sleep(0.02)
            stopping.set()
            await asyncio.wait_for(consumer, WAIT)  # ends by itself: nothing cancels it
        assert listener.connection is None
        assert asyncio.all_tasks() == {asyncio.current_task()}

    async def scenario() -> None:
        # Waiting for a notification, with no timeout.
        await stop_while_waiting(database, "t-stop", lambda listener, seen: seen == [RECONNECTED])
        assert await pids(database, "t-stop") == []
        # Retrying a database that does not exist, between attempts.
        nowhere = db.with_database(database, f"missing_{uuid.uuid4().hex[:8]}")
        await stop_while_waiting(nowhere, "t-stop-outage", lambda listener, seen: listener.failed_attempts >= 2)

    asyncio.run(scenario())


def test_the_listeners_of_one_process_share_one_connection_and_each_hears_only_its_channels(
        database: str) -> None:
    """One LISTEN backend for both; each gets its own channels' notifications, in order; a
    listener that joins later with a channel of its own gets its marker once that channel is
    listened, and the first one neither loses a notification nor gets a second marker."""
    async def scenario() -> None:
        stopping = asyncio.Event()
        async with listen(database, ["bc_t_a"], stopping, name="t-first") as first:
            assert await take(first) is RECONNECTED
            async with listen(database, ["bc_t_b", "bc_t_a"], stopping, name="t-second") as second:
                assert await take(second) is RECONNECTED
                shared = await pids(database, "t-first")
                assert len(shared) == 1 and shared == await pids(database, "t-second")
                await asyncio.to_thread(notify, database, ("bc_t_a", "1"), ("bc_t_b", "2"), ("bc_t_a", "3"))
                assert [(n.channel, n.payload) for n in [await take(first), await take(first)]] == [
                    ("bc_t_a", "1"), ("bc_t_a", "3")]
                assert [(n.channel, n.payload) for n in [await take(second) for _ in range(3)]] == [
                    ("bc_t_a", "1"), ("bc_t_b", "2"), ("bc_t_a", "3")]
                assert (first.connects, second.connects) == (1, 1)
            # The second left: the first goes on, on the same connection.
            await asyncio.to_thread(notify, database, ("bc_t_b", "unheard"), ("bc_t_a", "4"))
            assert (await take(first)).payload == "4"
            assert await pids(database, "t-first") == shared
        assert await pids(database, "t-first") == []  # the last to leave closed it

    asyncio.run(scenario())


def test_a_lost_shared_connection_gives_every_listener_the_marker_and_a_reset_only_its_own(
        database: str) -> None:
    async def scenario() -> None:
        stopping = asyncio.Event()
        async with listen(database, ["bc_t_a"], stopping, name="t-one") as one, \
                listen(database, ["bc_t_a"], stopping, name="t-two", own_connection=True) as two:
            assert (await take(one), await take(two)) == (RECONNECTED, RECONNECTED)
            [old] = await pids(database, "t-one")
            assert two.connection is not None and two.connection.info.backend_pid != old  # its queries' own
            async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
                await conn.execute("SELECT pg_terminate_backend(%s)", (old,))
            assert (await take(one), await take(two)) == (RECONNECTED, RECONNECTED)
            # A reset: that listener starts over (a new connection of its own), the other is untouched.
            queries = two.connection.info.backend_pid
            await two.reset()
            assert await take(two) is RECONNECTED
            assert two.connection is not None and two.connection.info.backend_pid != queries
            await asyncio.to_thread(notify, database, ("bc_t_a", "after"))
            assert (await take(one)).payload == "after" and (await take(two)).payload == "after"
            assert (one.connects, two.connects) == (2, 3)

    asyncio.run(scenario())


def test_after_a_reset_the_marker_comes_before_any_notification_with_the_connection_back(database: str) -> None:
    """A consumer with a connection of its own resets; a notification arrives during the back-off:
    the marker comes first, with a new connection open, then the notification (never a
    notification while its connection is closed)."""
    async def scenario() -> None:
        stopping = asyncio.Event()
        async with listen(database, ["bc_t_a"], stopping, name="t-reset", own_connection=True) as listener:
            assert await take(listener) is RECONNECTED
            await asyncio.to_thread(notify, database, ("bc_t_a", "before"))
            while not listener._received:  # a positive signal: delivered, not yet taken
                await asyncio.sleep(0.01)
            await listener.reset()
            await asyncio.to_thread(notify, database, ("bc_t_a", "during"))
            while not listener._received:  # delivered while the marker is due
                await asyncio.sleep(0.01)
            assert await take(listener) is RECONNECTED
            assert listener.connection is not None and not listener.connection.closed
            assert (await take(listener)).payload == "during"  # "before" is covered by the re-read

    asyncio.run(scenario())


# Its consumers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Pending reservations retried only hourly, so a placement within seconds was woken; loopback
    webhook receivers allowed."""
    yield from module_stack(pg_uri, pending_retry_seconds=3600, webhook_allow=LOOPBACK, webhook_attempt_seconds=5)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> World:
    server, root = stack
    return make_world(server.endpoint, root, server.conninfo, nodes=0)


def later(world: World) -> int:
    """A start a day away: the reservation stays placed."""
    return world.sql("SELECT epoch_ms(compute_now())")[0][0] + 86_400_000


def test_the_work_queue_handles_an_item_queued_after_its_listener_was_killed(database: str) -> None:
    # No safety poll (work_safety_poll_seconds): only a NOTIFY (or the marker) wakes it.
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE handled (subject text NOT NULL)")

    async def record(conn: psycopg.AsyncConnection, rt: Runtime, subject: str) -> None:
        await conn.execute("INSERT INTO handled (subject) VALUES (%s)", (subject,))

    def handled() -> list[str]:
        with psycopg.connect(database, autocommit=True) as conn:
            return [s for (s,) in conn.execute("SELECT subject FROM handled")]

    async def scenario() -> None:
        stop = asyncio.Event()
        pool = await db.open_pool(database, size=4)
        settings = Settings(database_url=database, work_safety_poll_seconds=3600.0)
        runner = asyncio.ensure_future(queue.run(Runtime(pool, settings), database, stop,
                                                 {"reservation": record}))
        try:
            await asyncio.to_thread(kill_listener, database, "work-queue")
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute("SELECT schedule_work('reservation', 'after-the-kill', compute_now())")
            assert await asyncio.to_thread(until, lambda: handled() == ["after-the-kill"], "the item handled")
        finally:
            stop.set()
            await asyncio.wait_for(runner, WAIT)
            await pool.close()

    asyncio.run(scenario())


def test_a_watch_stream_gets_events_missed_while_the_hub_was_disconnected_and_after(
        world: World, stack: tuple[ServerThread, Client], monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = stack
    world.add_node(gpus("w-watch"))
    monkeypatch.setattr(event_hub, "POLL_SECONDS", 3600.0)  # no safety net: only notifications and the marker
    with Stream(world.user, tenant_id=world.tenant) as stream:
        first = world.create(start=later(world))
        # Streamed: the watcher has read up to the frontier and waits to be woken.
        assert kinds(stream.take(1, timeout=WAIT)) == [("reservation.placed", f"reservation/{first.id}")]
        # Committed without a notification, as if sent while no one listened.
        world.sql("INSERT INTO events (tenant_id, type, subject, data) VALUES (%s, 'test.missed', 'test/m', '{}')",
                  (world.tenant,))
        kill_listener(server.conninfo, "event-hub")
        assert kinds(stream.take(1, timeout=WAIT)) == [("test.missed", "test/m")]
        r = world.create(start=later(world))
        assert kinds(stream.take(1, timeout=WAIT)) == [("reservation.placed", f"reservation/{r.id}")]


def test_webhook_delivery_delivers_an_event_committed_after_its_listener_was_killed(
        world: World, stack: tuple[ServerThread, Client], receiver: Receiver,  # noqa: F811 - the fixture
        monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = stack
    monkeypatch.setattr(delivery, "POLICY", delivery.RetryPolicy(poll_seconds=3600))  # no safety net
    world.add_node(gpus("w-hook"))
    create_hook(world, receiver.url)
    kill_listener(server.conninfo, "webhooks")
    r = world.create(start=later(world))
    until(lambda: receiver.of(f"reservation/{r.id}"), "the delivery")


def test_the_pending_worker_places_a_reservation_when_capacity_frees_after_its_listener_was_killed(
        world: World, stack: tuple[ServerThread, Client]) -> None:
    server, _ = stack
    world.add_node(gpus("w-pend"))
    start = later(world)
    holder = world.create(count=8, start=start)
    waiting = world.create(count=8, start=start)
    assert (holder.state, waiting.state) == ("placed", "pending")
    kill_listener(server.conninfo, "pending")
    world.user.res("Release", pb.ReleaseReservationRequest(tenant_id=world.tenant, reservation_id=holder.id))
    until(lambda: world.user.res("Get", pb.GetReservationRequest(
        tenant_id=world.tenant, reservation_id=waiting.id)).state == "placed", "the waiting one placed")


def test_the_gateway_pushes_desired_state_after_its_listener_was_killed(
        gateway: GatewayThread, pool_id: str) -> None:  # noqa: F811 - the fixtures
    node, session = connected(gateway, pool_id, "gpu-listen")
    kill_listener(gateway.conninfo, "gateway")
    with psycopg.connect(gateway.conninfo, autocommit=True) as conn:
        conn.execute("SELECT bump_desired(%s)", (node.node_id,))
    state = latest(session, gateway.conninfo, node.node_id)
    assert state.generation == node_row(gateway.conninfo, node.node_id)["desired_generation"]
    session.close()
