"""Webhooks and Watch as a hostile tenant uses them: what a first review did not try."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world
from tests.test_watch import PER_IDENTITY, PER_TENANT, capped, reopens, reserve, small  # noqa: F401 (fixtures)

FLOOD = """
INSERT INTO events (tenant_id, type, subject, data)
SELECT %s, 'test.flood', 'test/flood', jsonb_build_object('pad', repeat('x', 8000))  -- no reservation's: streamed to anyone
FROM generate_series(1, %s)
"""


def stalled(client: Client, world: World) -> Any:
    """A Watch call whose client reads one event and then never reads again."""
    call = events_pb2_grpc.EventsStub(client.channel).Watch(
        epb.WatchRequest(tenant_id=world.tenant), metadata=client.metadata, timeout=300)
    next(call)
    return call


def slots_come_back(world: World, ident: str, client: Client, then: Callable[[], object]) -> None:
    """`client` fills the identity's Watch slots with streams it never reads (a backlog of ~32 MB,
    more than every window and socket buffer), `then` runs, and a fresh token of the identity must
    open a stream again within 30 s."""
    world.sql(FLOOD, (world.tenant, 4000))
    calls = [stalled(client, world) for _ in range(PER_IDENTITY)]
    then()
    fresh = Client(world.endpoint, world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident)).secret)
    try:
        reopens(fresh, world, seconds=30).call.cancel()
    finally:
        for call in calls:
            call.cancel()
        fresh.close()
        client.close()


def test_a_consumer_that_never_reads_still_loses_its_stream_when_its_token_expires(small: World) -> None:
    """Attack: hold the identity's Watch slots past the token's life by never reading, so the
    server stays suspended in a send (not in the wait that checks the token)."""
    ident, _ = small.identity()
    token = small.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=ident, ttl="4s"))
    slots_come_back(small, ident, Client(small.endpoint, token.secret), then=lambda: None)


def test_a_consumer_that_never_reads_loses_its_stream_when_its_token_is_revoked(small: World) -> None:
    """Attack: keep streaming to a token that was revoked, by never reading."""
    ident, client = small.identity()
    slots_come_back(small, ident, client,
                    then=lambda: small.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident)))


@pytest.fixture(scope="module")
def stall_capped(pg_uri: str) -> Any:
    yield from module_stack(pg_uri, watch_streams_per_identity=PER_IDENTITY, watch_streams_per_tenant=PER_TENANT,
                            watch_send_seconds=1.0)


def test_a_consumer_that_never_reads_is_dropped_and_its_slot_freed(stall_capped: tuple[ServerThread, Client]) -> None:
    """Attack: fill the tenant's Watch slots with streams whose client never reads, with a token
    that lives on: every colleague is locked out of Watch for as long as the connections live."""
    server, root = stall_capped
    world = make_world(server.endpoint, root, server.conninfo)
    reserve(world)
    world.sql(FLOOD, (world.tenant, 4000))
    _, client = world.identity()
    calls = [stalled(client, world) for _ in range(PER_IDENTITY)]
    try:
        reopens(client, world, seconds=30).call.cancel()
    finally:
        for call in calls:
            call.cancel()
        client.close()

