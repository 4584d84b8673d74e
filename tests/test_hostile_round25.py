"""Hostile review, round 25 (the lead's own): what the sixth round's reading of the event hub found.

- **A policy change while the hub was disconnected streamed a whole batch.** A Watch stream
  decides again before its next event when the hub hears `bc_access_changed` (PutPolicy,
  RemoveMembership: round 24d). A notification sent while the hub's LISTEN connection is down is
  lost, and the reconnect re-checked revoked tokens but not access: a stream in the middle of a
  batch read before the change streamed the rest of it (up to 500 events) under the old policy.
  Now a reconnect has every stream decide again before its next event (event_hub._handle).
"""

from __future__ import annotations

import time

import grpc
import pytest

from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import events_pb2_grpc
from tests.support import Client, ServerThread, World, error_of
from tests.test_hostile_round24d import BURST, DENIED, IN_FLIGHT
from tests.test_listen import kill_listener


def test_a_policy_changed_while_the_hub_was_disconnected_is_decided_before_the_next_event(
        world: World, stack: tuple[ServerThread, Client]) -> None:
    """Attack: a member about to lose the events reads its stream slowly; the policy that refuses
    it commits while the hub listens to nothing (written here without its notification, as one
    sent during the gap is lost), then the hub reconnects. The batch read before must not keep
    coming."""
    server, _ = stack
    world.sql(BURST, (world.tenant,))
    ident, client = world.identity()
    # BDP probing off: the window stays at its initial 64 KiB (tests/test_hostile_round24d.py).
    channel = grpc.insecure_channel(world.endpoint, options=[("grpc.http2.bdp_probe", 0)])
    call = events_pb2_grpc.EventsStub(channel).Watch(
        epb.WatchRequest(tenant_id=world.tenant), metadata=client.metadata, timeout=120)
    try:
        assert next(call).type == "test.burst"
        time.sleep(0.5)  # the server fills the window and waits in a send
        world.sql("""
            INSERT INTO policies (tenant_id, cedar) VALUES (%(tenant)s, %(cedar)s)
            ON CONFLICT (tenant_id) DO UPDATE SET cedar = EXCLUDED.cedar, version = policies.version + 1
            """, {"tenant": world.tenant, "cedar": "permit(principal, action, resource);\n"
                  f'forbid(principal == Identity::"{ident}", action == Action::"compute:events:read", resource);'})
        kill_listener(server.conninfo, "event-hub")
        after = 0
        try:
            for _ in call:
                after += 1
                if after > IN_FLIGHT:
                    pytest.fail(f"{after} events streamed after the policy refused the stream (at most "
                                f"{IN_FLIGHT} could have been in flight)")
        except grpc.RpcError as exc:
            assert error_of(exc)[:2] == DENIED, exc
        else:
            pytest.fail("the stream ended OK")
    finally:
        call.cancel()
        channel.close()
