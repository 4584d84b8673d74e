"""A create whose tenant has read its pool before checks its request against that view and sends
the draft's insert with its facts read (controlplane/reservations/draft_ahead.py): one round trip
instead of two. Whatever changed since the view, or whatever the facts would refuse, the insert
must not ride along: the create answers exactly as one that read first, and writes nothing it
would not have written (real server, real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane.ids import draft_id
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world, rpc_error
from tests.test_hostile_time import lock_waited

DAY = 86_400_000


def drafts_written(world: World, server: ServerThread) -> dict[str, float]:
    registry = server.app.runtime.metrics.registry
    return {how: registry.get_sample_value("bc_create_drafts_total", {"how": how}) or 0.0
            for how in ("ahead", "after_read")}


def written_since(before: dict[str, float], world: World, server: ServerThread) -> dict[str, float]:
    now = drafts_written(world, server)
    return {how: now[how] - before[how] for how in now}


def refused(call) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return rpc_error(exc)


def row_of(world: World, key: str) -> list[tuple]:
    return world.sql("SELECT r.state, r.request_hash, r.request->'resources', a.attributes FROM reservations r"
                     " LEFT JOIN authz_projection a ON a.reservation_id = r.id WHERE r.id = %s",
                     (draft_id(world.tenant, world.user_id, key),))


def test_the_second_create_in_a_pool_is_written_ahead_and_stores_what_a_read_first_create_stores(
        world: World, server: ServerThread) -> None:
    before = drafts_written(world, server)
    first = world.create(key="first", count=2, duration="3h")
    assert written_since(before, world, server) == {"ahead": 0, "after_read": 1}  # nothing seen yet
    second = world.create(key="second", count=2, duration="3h")
    assert written_since(before, world, server) == {"ahead": 1, "after_read": 1}
    assert first.state == second.state == "placed" and first.id != second.id
    (state_a, hash_a, resources_a, attributes_a), = row_of(world, "first")
    (state_b, hash_b, resources_b, attributes_b), = row_of(world, "second")
    assert hash_a == hash_b and resources_a == resources_b and attributes_a == attributes_b
    # The stored key answers as stored, and another request under it is a CONFLICT.
    assert world.create(key="second", count=2, duration="3h").id == second.id
    code, reason, details = refused(lambda: world.create(key="second", count=1, duration="3h"))
    assert (code, reason, details) == (grpc.StatusCode.ABORTED, "CONFLICT", {"reservationId": second.id})
    assert written_since(before, world, server) == {"ahead": 1, "after_read": 1}


def test_a_pool_changed_since_it_was_seen_is_read_first_and_the_draft_stores_the_change(
        world: World, server: ServerThread) -> None:
    world.create(key="seen")
    world.sql("UPDATE pools SET policy = policy || '{\"perGpu\": {\"vcpu\": 3, \"memoryGiB\": 5}}'::jsonb"
              " WHERE id = %s", (world.pool_id,))
    before = drafts_written(world, server)
    assert world.create(key="after", count=2).state in ("placed", "pending")  # the nodes list no host resources
    assert written_since(before, world, server) == {"ahead": 0, "after_read": 1}
    (_, _, resources, attributes), = row_of(world, "after")
    assert (resources["vcpu"], resources["memoryGiB"]) == (6, 10)
    assert (attributes["vcpu"], attributes["memoryGiB"]) == (6, 10)
    assert world.create(key="again", count=2).state in ("placed", "pending")  # the new view is the one seen now
    assert written_since(before, world, server) == {"ahead": 1, "after_read": 1}


def test_a_pool_no_longer_offered_refuses_as_not_found_and_writes_nothing(world: World, server: ServerThread) -> None:
    guest = make_world(world.endpoint, world.root, world.conninfo, nodes=0)
    try:
        world.root.admin("OfferPool", apb.OfferPoolRequest(pool_id=world.pool_id, tenant_id=guest.tenant))
        guest.pool_id = world.pool_id
        assert guest.create(key="while-offered").state == "placed"
        guest.sql("DELETE FROM pool_offers WHERE pool_id = %s AND tenant_id = %s", (world.pool_id, guest.tenant))
        code, reason, _ = refused(lambda: guest.create(key="after-revoke"))
        assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
        assert row_of(guest, "after-revoke") == []
    finally:
        guest.close()


def test_a_start_beyond_the_horizon_is_refused_and_writes_nothing(world: World, server: ServerThread) -> None:
    world.create(key="seen")
    now = world.sql("SELECT epoch_ms(compute_now())")[0][0]
    too_far = now + (server.settings.max_start_ahead_days + 1) * DAY
    code, reason, details = refused(lambda: world.create(key="far", start=too_far))
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "start")
    assert row_of(world, "far") == []
    within = now + (server.settings.max_start_ahead_days - 1) * DAY
    before = drafts_written(world, server)
    assert world.create(key="near", start=within).state == "placed"
    assert written_since(before, world, server) == {"ahead": 1, "after_read": 0}


@pytest.fixture(scope="module")
def capped(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, max_drafts_per_identity=2)


def test_an_identity_at_its_draft_cap_is_refused_ahead_as_after_a_read(capped: tuple[ServerThread, Client]) -> None:
    server, root = capped
    world = make_world(server.endpoint, root, server.conninfo, quota=1)
    try:
        assert world.create(key="placed").state == "placed"  # the pool seen; the quota now full
        for key in ("d1", "d2"):  # refused by quota: each leaves its draft
            assert refused(lambda: world.create(key=key))[1] == "QUOTA_EXCEEDED"
        before = drafts_written(world, server)
        code, reason, details = refused(lambda: world.create(key="d3"))
        assert (code, reason, details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED",
                                                     "draft-limit")
        assert row_of(world, "d3") == [] and written_since(before, world, server) == {"ahead": 0, "after_read": 0}
    finally:
        world.close()


def test_another_tenants_view_of_the_pool_is_not_this_tenants(world: World, server: ServerThread) -> None:
    """The owner has seen its pool; a tenant it is not offered to naming it is NOT_FOUND, and
    nothing is written for it."""
    world.create(key="owner-sees")
    stranger = make_world(world.endpoint, world.root, world.conninfo, nodes=0)
    try:
        request = stranger.create_request(key="theirs", pool_id=world.pool_id)
        code, reason, _ = refused(lambda: stranger.user.res("Create", request))
        assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
        assert stranger.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (stranger.tenant,)) == [(0,)]
    finally:
        stranger.close()


def test_a_request_refused_on_the_seen_view_gets_the_refusal_of_the_facts(world: World, server: ServerThread) -> None:
    """A request the seen view refuses is checked against the facts, not answered from the view:
    the pool was changed to allow it."""
    world.create(key="seen")
    code, reason, _ = refused(lambda: world.create(key="k8s", binding="kubernetes"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, reason
    world.sql("UPDATE pools SET policy = policy || '{\"kubernetes\": {\"namespace\": \"ml\"}}'::jsonb"
              " WHERE id = %s", (world.pool_id,))
    placed = world.create(key="k8s-2", binding="kubernetes")
    assert placed.state in ("placed", "binding", "pending"), placed


def test_an_identity_removed_while_its_create_waits_for_the_draft_room_is_refused_and_writes_nothing(
        world: World, server: ServerThread) -> None:
    """The guard read the membership before the removal; the insert, after the draft room's lock,
    is refused by the owner's membership trigger, and the create answers as one that read first:
    ACCESS_DENIED, nothing written."""
    ident, client = world.identity()
    world.create(client, key="seen")
    with psycopg.connect(world.conninfo, autocommit=True) as holder, ThreadPoolExecutor(1) as pool:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(hashtextextended('drafts:' || %s, 0))", (ident,))
        pending = pool.submit(lambda: refused(lambda: world.create(client, key="late")))
        lock_waited(world, "advisory")
        world.sql("DELETE FROM memberships WHERE identity_id = %s AND tenant_id = %s", (ident, world.tenant))
        holder.execute("COMMIT")
        code, reason, details = pending.result(timeout=30)
    assert (code, reason, details) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED", {"tenantId": world.tenant})
    assert world.sql("SELECT count(*) FROM reservations WHERE owner_identity_id = %s AND idempotency_key = 'late'",
                     (ident,)) == [(0,)]
