"""Events.Watch from now: a stream streams every event that commits after it started, including
one a writer open at the start commits later with a smaller id than events already visible, and
none that had committed before it started. The response headers say when the start is fixed, so
no test guesses with a sleep. Real PostgreSQL, a real control plane, real writers held open."""

from __future__ import annotations

from tests.support import World
from tests.test_watch import Stream, _begin_event, kinds, reserve


def opened(world: World, **request: object) -> Stream:
    """A from-now Watch whose start the server has fixed (its response headers arrived)."""
    stream = Stream(world.user, tenant_id=world.tenant, from_now=True, **request)
    stream.call.initial_metadata()
    return stream


def test_from_now_streams_a_smaller_id_that_commits_after_the_start(world: World) -> None:
    """A writer open when the stream starts holds a smaller id than an event already visible: it
    commits after the start, so it is streamed (it was lost: the stream started after the largest
    visible id). The larger one, committed before the start, is not."""
    reserve(world)  # committed before the stream, no writer open
    slow = _begin_event(world, "test/slow")
    slow_id = slow.execute("SELECT currval('events_id_seq')").fetchone()[0]
    try:
        r = reserve(world)  # a larger id, committed before the stream starts
        [(placed_id,)] = world.sql("SELECT id FROM events WHERE subject = %s", (f"reservation/{r.id}",))
        assert slow_id < placed_id
        stream = opened(world)
    finally:
        slow.commit()
        slow.close()
    with stream:
        late = stream.take(1)
        assert kinds(late) == [("test.late", "test/slow")] and late[0].id == slow_id
        r2 = reserve(world)
        # Neither of the reservations committed before the start comes before it.
        assert kinds(stream.take(1)) == [("reservation.placed", f"reservation/{r2.id}")]
        stream.quiet(0.2)


def test_from_now_skips_what_committed_before_the_start_across_batches_and_filters(world: World) -> None:
    """More events committed before the start than one read takes (above the final ids, as a
    writer is open): none is streamed; a rolled-back writer leaves nothing; the filter holds."""
    slow = _begin_event(world, "test/slow")
    try:
        world.sql("INSERT INTO events (tenant_id, type, subject, data) "
                  "SELECT %s, 'test.before', 'test/before', '{}' FROM generate_series(1, 600)", (world.tenant,))
        every = opened(world)
        narrow = opened(world, types=["test."], subject="test/before")
    finally:
        slow.rollback()
        slow.close()
    with every, narrow:
        r = reserve(world)
        assert kinds(every.take(1)) == [("reservation.placed", f"reservation/{r.id}")]
        world.sql("INSERT INTO events (tenant_id, type, subject, data) VALUES "
                  "(%s, 'test.other', 'test/other', '{}'), (%s, 'test.after', 'test/before', '{}')",
                  (world.tenant, world.tenant))
        world.sql("SELECT pg_notify('bc_events', %s)", (world.tenant,))
        assert kinds(narrow.take(1)) == [("test.after", "test/before")]
        assert kinds(every.take(2)) == [("test.other", "test/other"), ("test.after", "test/before")]
        every.quiet(0.2)
        narrow.quiet(0.1)
