"""Webhook and Watch defects an earlier review left: a delivery sent while a smaller event id was
still uncommitted (a client resuming Watch after it missed that event), a few tenants' dead DNS
names holding every lookup thread, and a claim that read every pending delivery to pick a few.
Real PostgreSQL, a real control plane, real HTTP receivers on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.conftest import module_stack
from tests.support import Client, ServerThread, World
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
