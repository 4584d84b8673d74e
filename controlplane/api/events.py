"""Servicers for Events (Watch) and Webhooks: parse, call one domain function, convert."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import struct_pb2

from bettercompute.v1 import events_pb2 as pb
from bettercompute.v1 import events_pb2_grpc as rpc
from controlplane import watch
from controlplane.event_hub import EventHub
from controlplane.api.interceptor import caller
from controlplane.runtime import Runtime
from controlplane.webhooks import manage

Ctx = grpc.aio.ServicerContext


def event(row: dict[str, Any]) -> pb.Event:
    data = struct_pb2.Struct()
    data.update(row["data"])
    return pb.Event(id=row["id"], type=row["type"], subject=row["subject"], tenant_id=row["tenant_id"],
                    time=row["time_ms"], data=data)


def webhook(row: dict[str, Any]) -> pb.Webhook:
    return pb.Webhook(id=row["id"], tenant_id=row["tenant_id"], url=row["url"], event_types=row["event_types"],
                      created_by=row["created_by"], created_at=row["created_ms"],
                      secret=row.get("secret", ""))


def delivery(row: dict[str, Any]) -> pb.Delivery:
    return pb.Delivery(
        event_id=row["event_id"], event_type=row["event_type"], subject=row["subject"], state=row["state"],
        attempts=row["attempts"], last_attempt_at=row["last_attempt_ms"], last_status=row["last_status"],
        last_error=row["last_error"], next_attempt_at=row["next_attempt_ms"], created_at=row["created_ms"],
    )


class EventsServicer(rpc.EventsServicer):
    def __init__(self, rt: Runtime, hub: EventHub) -> None:
        self.rt = rt
        self.hub = hub

    async def Watch(self, request: pb.WatchRequest, context: Ctx) -> AsyncIterator[pb.Event]:  # type: ignore[override]
        raw = {"tenant_id": request.tenant_id, "after_id": request.after_id, "from_now": request.from_now,
               "types": list(request.types), "subject": request.subject}
        # The response headers tell the client that the stream is open and its start fixed.
        async for row in watch.watch(self.rt, self.hub, caller(), raw, lambda: context.send_initial_metadata(())):
            yield event(row)


class WebhooksServicer(rpc.WebhooksServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def Create(self, request: pb.CreateWebhookRequest, context: Ctx) -> pb.Webhook:
        return webhook(await manage.create(self.rt, caller(), {
            "tenant_id": request.tenant_id, "url": request.url, "secret": request.secret,
            "event_types": list(request.event_types)}))

    async def Get(self, request: pb.GetWebhookRequest, context: Ctx) -> pb.Webhook:
        return webhook(await manage.get(self.rt, caller(), request.tenant_id, request.webhook_id))

    async def List(self, request: pb.ListWebhooksRequest, context: Ctx) -> pb.ListWebhooksResponse:
        rows, next_cursor = await manage.list_(self.rt, caller(), request.tenant_id, request.limit, request.cursor)
        return pb.ListWebhooksResponse(items=[webhook(r) for r in rows], next_cursor=next_cursor)

    async def Delete(self, request: pb.DeleteWebhookRequest, context: Ctx) -> pb.Webhook:
        return webhook(await manage.delete(self.rt, caller(), request.tenant_id, request.webhook_id))

    async def ListDeliveries(self, request: pb.ListDeliveriesRequest, context: Ctx) -> pb.ListDeliveriesResponse:
        rows, before = await manage.deliveries(self.rt, caller(), {
            "tenant_id": request.tenant_id, "webhook_id": request.webhook_id, "limit": request.limit,
            "before_event_id": request.before_event_id})
        return pb.ListDeliveriesResponse(items=[delivery(r) for r in rows], next_before_event_id=before)
