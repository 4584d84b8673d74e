"""A webhook reads a tenant's events, so it is held to what Events.Watch of the same event types
would be allowed (compute:events:read), at Create and again at every delivery with its creator's
authority: real control plane, real receivers on loopback, real Cedar policies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from controlplane.webhooks import authority
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, rpc_error
from tests.test_webhooks import LOOPBACK, SECRET, Receiver, eventually, hooks, release, reserve

MANAGE = 'permit(principal == Identity::"{who}", action == Action::"compute:webhooks:manage", resource);'
EVERYTHING = 'permit(principal == Identity::"{who}", action, resource);'
# events:read narrowed to reservation.released: a filter of that type only (all types is [] and refused).
# With reservations:read, as a webhook delivers a reservation's events only to a creator who may get it.
RELEASED_ONLY = ('permit(principal == Identity::"{who}", action == Action::"compute:events:read", resource) '
                 'when { resource.types != [] && ["reservation.released"].containsAll(resource.types) };\n'
                 'permit(principal == Identity::"{who}", action == Action::"compute:reservations:read", resource);')


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=5)


def creator(world: World, *rules: str) -> tuple[str, Client]:
    """A second identity of the tenant; the policy lets the world's user do anything and it `rules`."""
    ident, client = world.identity()
    world.policy("\n".join([EVERYTHING.replace("{who}", world.user_id), *(r.replace("{who}", ident) for r in rules)]))
    return ident, client


def create(client: Client, world: World, url: str, types: list[str] = ()) -> epb.Webhook:  # type: ignore[assignment]
    return hooks(client, "Create", epb.CreateWebhookRequest(tenant_id=world.tenant, url=url, secret=SECRET,
                                                            event_types=list(types)))


def refused(client: Client, world: World, url: str, types: list[str] = ()) -> dict[str, str]:  # type: ignore[assignment]
    with pytest.raises(grpc.RpcError) as exc:
        create(client, world, url, types)
    _, code, details = rpc_error(exc)
    assert code == "ACCESS_DENIED" and details["action"] == "compute:events:read", details
    return details


def settled(world: World, hook: epb.Webhook, subject: str) -> list[Any]:
    """The webhook's deliveries of `subject` that are no longer pending."""
    listed = hooks(world.user, "ListDeliveries", epb.ListDeliveriesRequest(tenant_id=world.tenant, webhook_id=hook.id))
    return [d for d in listed.items if d.subject == subject and d.state != "pending"]


def delivery_of(world: World, hook: epb.Webhook, subject: str) -> Any:
    return next(iter(settled(world, hook, subject)), None)


def watch_refused(client: Client, world: World, types: list[str]) -> bool:
    stream = events_pb2_grpc.EventsStub(client.channel).Watch(
        epb.WatchRequest(tenant_id=world.tenant, types=types), metadata=client.metadata, timeout=30)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            next(iter(stream))
    finally:
        stream.cancel()
    return rpc_error(exc)[1] == "ACCESS_DENIED"


def test_manage_without_events_read_cannot_create_a_webhook(world: World) -> None:
    _, hooker = creator(world, MANAGE)
    url = "http://127.0.0.1:9/hook"  # never called: nothing is created
    assert json.loads(refused(hooker, world, url)["eventTypes"]) == ["*"]  # every type
    assert json.loads(refused(hooker, world, url, ["reservation."])["eventTypes"]) == ["reservation."]
    assert world.sql("SELECT count(*) FROM webhooks WHERE tenant_id = %s", (world.tenant,))[0][0] == 0


def test_events_read_narrowed_to_some_types_cannot_subscribe_to_others(world: World) -> None:
    _, hooker = creator(world, MANAGE, RELEASED_ONLY)
    receiver = Receiver()
    try:
        details = refused(hooker, world, receiver.url, ["reservation.placed", "reservation.released"])
        assert json.loads(details["eventTypes"]) == ["reservation.placed"]  # the entry refused, not the allowed one
        assert json.loads(refused(hooker, world, receiver.url, ["reservation."])["eventTypes"]) == ["reservation."]
        assert json.loads(refused(hooker, world, receiver.url)["eventTypes"]) == ["*"]  # every type
        # Watch decides the same filters the same way.
        assert watch_refused(hooker, world, ["reservation.placed"])
        hook = create(hooker, world, receiver.url, ["reservation.released"])
        assert list(hook.event_types) == ["reservation.released"]
        subject = reserve(world)
        release(world, subject)
        hit = eventually(lambda: receiver.of(subject))[0]
        assert hit.signed and hit.event["type"] == "reservation.released"
        assert eventually(lambda: delivery_of(world, hook, subject)).state == "delivered"
    finally:
        receiver.close()


def test_a_policy_tightened_after_creation_stops_the_deliveries_it_no_longer_allows(world: World) -> None:
    hooker_id, hooker = creator(world, EVERYTHING)
    mine, control = Receiver(), Receiver()
    try:
        hook = create(hooker, world, mine.url)
        create(world.user, world, control.url)  # the world's user keeps events:read: its webhook goes on
        before = authority.DECISIONS.decided
        first, second = reserve(world), reserve(world)
        eventually(lambda: mine.of(first) and mine.of(second))
        assert eventually(lambda: delivery_of(world, hook, second)).state == "delivered"
        # One decision per webhook and policy version, not one per delivery (two webhooks, one version).
        assert authority.DECISIONS.decided - before <= 2

        world.policy("\n".join([EVERYTHING.replace("{who}", world.user_id), MANAGE.replace("{who}", hooker_id)]))
        later = reserve(world)
        eventually(lambda: control.of(later))  # the event was worked on
        refused_delivery = eventually(lambda: delivery_of(world, hook, later))
        assert (refused_delivery.state, refused_delivery.last_error) == ("dead", authority.REFUSED)
        assert not refused_delivery.HasField("last_status")
        assert mine.of(later) == []

        # Allowed again (a new policy version): later events flow; the refused one stays dead.
        world.policy("\n".join([EVERYTHING.replace("{who}", world.user_id), EVERYTHING.replace("{who}", hooker_id)]))
        again = reserve(world)
        eventually(lambda: mine.of(again))
        assert mine.of(later) == []
    finally:
        mine.close()
        control.close()


def test_events_read_narrowed_after_creation_keeps_only_the_webhooks_it_still_allows(world: World) -> None:
    hooker_id, hooker = creator(world, EVERYTHING)
    released, every = Receiver(), Receiver()
    try:
        narrow = create(hooker, world, released.url, ["reservation.released"])
        wide = create(hooker, world, every.url)
        world.policy("\n".join([EVERYTHING.replace("{who}", world.user_id),
                                RELEASED_ONLY.replace("{who}", hooker_id)]))
        subject = reserve(world)
        release(world, subject)
        assert eventually(lambda: released.of(subject))[0].event["type"] == "reservation.released"
        assert eventually(lambda: delivery_of(world, narrow, subject)).state == "delivered"
        # The webhook of every type is what a Watch with no type filter is: refused now, each event.
        listed = eventually(lambda: len(settled(world, wide, subject)) == 2 and settled(world, wide, subject))
        assert sorted((d.event_type, d.last_error) for d in listed) == [
            ("reservation.placed", authority.REFUSED), ("reservation.released", authority.REFUSED)]
        assert every.of(subject) == []
    finally:
        released.close()
        every.close()


def test_a_webhook_of_an_offboarded_creator_delivers_nothing(world: World) -> None:
    hooker_id, hooker = creator(world, EVERYTHING)
    mine, control = Receiver(), Receiver()
    try:
        hook = create(hooker, world, mine.url)
        create(world.user, world, control.url)
        first = reserve(world)
        eventually(lambda: mine.of(first))
        world.root.admin("OffboardIdentity", apb.OffboardIdentityRequest(identity_id=hooker_id,
                                                                         successor_identity_id=world.user_id))
        later = reserve(world)
        eventually(lambda: control.of(later))
        gone = eventually(lambda: delivery_of(world, hook, later))
        assert (gone.state, gone.last_error) == ("dead", authority.CREATOR_GONE)
        assert mine.of(later) == []
    finally:
        mine.close()
        control.close()
