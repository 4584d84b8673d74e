"""Leftovers of admission (DESIGN.md sections 7, 7a and 8; spec "Drafts and idempotency"), each
an attack or a race that broke a promise before its fix: the live-drafts cap under concurrent
creates."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest

from controlplane.common.status import error_info
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world


def live_drafts(world: World, identity_id: str) -> int:
    return world.sql("SELECT count(*) FROM reservations WHERE owner_identity_id = %s"
                     " AND state IN ('draft', 'awaiting-confirmation')", (identity_id,))[0][0]


def outcome(call, *args) -> str:
    """The reservation's state, or the spec code the call failed with ('draft-limit' for the
    live-drafts cap's refusal)."""
    try:
        return call(*args).state
    except grpc.RpcError as exc:
        info = error_info(exc)
        assert info is not None, f"no ErrorInfo on {exc}"
        return "draft-limit" if info.metadata.get("reason") == "draft-limit" else info.reason


def refused_concurrently(world: World, creates: int, threads: int = 16) -> list[str]:
    """`creates` creates of 2 GPUs with distinct keys, at once, from the world's user: its quota
    (1 GPU) refuses each one that gets a draft (QUOTA_EXCEEDED), so each leaves its draft."""
    requests = [world.create_request(key=f"burst-{i}", count=2) for i in range(creates)]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda r: outcome(world.user.res, "Create", r), requests))


def max_connections(pg_uri: str) -> int:
    with psycopg.connect(pg_uri) as conn:
        return int(conn.execute("SHOW max_connections").fetchone()[0])


@pytest.fixture(scope="module")
def capped(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, max_drafts_per_identity=3)


@pytest.fixture(scope="module")
def wide(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """A cap just above max_connections: far from it, creates count under the shared lock."""
    yield from module_stack(pg_uri, max_drafts_per_identity=max_connections(pg_uri) + 4)


# The live-drafts cap under concurrency -------------------------------------------------------


def test_concurrent_creates_with_distinct_keys_never_take_an_identity_past_its_draft_cap(capped) -> None:
    """Transaction 1 counted the identity's drafts in one statement and inserted in another: 24
    creates at once each saw room, and the identity held far more than 3 drafts."""
    server, root = capped
    w = make_world(server.endpoint, root, server.conninfo, nodes=1, quota=1)
    try:
        outcomes = refused_concurrently(w, 24)
        assert live_drafts(w, w.user_id) == 3
        assert sorted(set(outcomes)) == ["QUOTA_EXCEEDED", "draft-limit"]
        assert outcomes.count("QUOTA_EXCEEDED") == 3 and outcomes.count("draft-limit") == 21
        # The held keys are still decided on retry, and another identity has room of its own.
        assert outcome(w.create) == "draft-limit"  # a new key: still capped
        assert outcome(w.user.res, "Create", w.create_request(key=next(
            f"burst-{i}" for i, o in enumerate(outcomes) if o == "QUOTA_EXCEEDED"), count=2)) == "QUOTA_EXCEEDED"
        _, other = w.identity()
        assert w.create(other, count=1).state == "placed"
    finally:
        w.close()


def test_the_cap_holds_when_a_burst_crosses_it_from_far_below(wide) -> None:
    """Far from the cap the identity's lock is shared (creates do not wait for each other); a
    burst that crosses from far below to past the cap still stops exactly at it."""
    server, root = wide
    cap = server.settings.max_drafts_per_identity
    w = make_world(server.endpoint, root, server.conninfo, nodes=1, quota=1)
    try:
        outcomes = refused_concurrently(w, cap + 12)
        assert live_drafts(w, w.user_id) == cap
        assert outcomes.count("QUOTA_EXCEEDED") == cap and outcomes.count("draft-limit") == 12
    finally:
        w.close()
