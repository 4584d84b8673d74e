"""A hostile tenant (DESIGN.md sections 6 and 7): a member of tenant A only attacks tenant B through
every tenant RPC. Every object of B is NOT_FOUND for it, exactly as an absent one (never a hint it
exists), every call naming B is ACCESS_DENIED, no error detail carries B's data, B's events never
reach A, a non-root caller is ACCESS_DENIED on every root-only RPC, and a revoked, expired or
offboarded token is UNAUTHENTICATED on every service."""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import grants_pb2 as gpb
from bettercompute.v1 import instances_pb2 as ipb
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import providers_pb2 as ppb
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import usage_pb2 as upb
from controlplane import bootstrap
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world, rpc_error
from tests.test_watch import Stream
from tests.vps_support import SimThread, Stubs, make_vps, sim  # noqa: F401 (fixture)
from tests.test_webhooks import SECRET, Receiver

LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)
SERVICES = {
    "Reservations": pb, "Confirmations": pb, "Admin": apb, "Capacity": cpb, "NodeAdmin": npb, "Events": epb,
    "Webhooks": epb, "ProviderAccounts": ppb, "Projects": ppb, "ReservationGrants": gpb, "Instances": ipb,
    "Usage": upb,
}
ROOT_ONLY = ("Admin", "NodeAdmin", "ProviderAccounts")
ROOT_ONLY_METHODS = (("ReservationGrants", "Create"), ("ReservationGrants", "End"))
AGENT_POLICY = "permit(principal, action, resource) unless { context.delegated };"


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Loopback webhook receivers allowed."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=5)


def methods(service: str) -> list[Any]:
    return list(SERVICES[service].DESCRIPTOR.services_by_name[service].methods)


def invoke(client: Client, method: Any, request: Any = None, timeout: float = 30) -> Any:
    """Call any method of the API by its descriptor; a streaming answer is read to its end."""
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = client.channel.unary_stream if method.server_streaming else client.channel.unary_unary
    call = kind(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_cls.FromString)
    answer = call(request if request is not None else request_cls(), metadata=client.metadata, timeout=timeout)
    return list(answer) if method.server_streaming else answer


def failure(fn: Any, *args: Any, **kw: Any) -> tuple[grpc.StatusCode, str, dict[str, str], str]:
    """(gRPC code, spec code, details, message) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as exc:
        fn(*args, **kw)
    code, reason, details = rpc_error(exc)
    return code, reason, details, exc.value.details() or ""


def stub(client: Client, service: str) -> Any:
    return getattr(SERVICES[service], f"{service}Stub", None) or _grpc_stub(client, service)


def _grpc_stub(client: Client, service: str) -> Any:
    module = __import__(SERVICES[service].__name__ + "_grpc", fromlist=["_"])
    return getattr(module, f"{service}Stub")(client.channel)


def call(client: Client, service: str, method: str, request: Any) -> Any:
    return getattr(_grpc_stub(client, service), method)(request, metadata=client.metadata, timeout=30)


class Pair:
    """Tenant A (the attacker: `a.user` is a member of A only) and tenant B (the victim) with objects
    of every kind A could aim at."""

    def __init__(self, server: ServerThread, root: Client) -> None:
        self.server = server
        self.a = make_world(server.endpoint, root, server.conninfo, nodes=1)
        self.b = make_world(server.endpoint, root, server.conninfo, nodes=1)
        b = self.b
        self.b_rsv = b.create(count=1, start=b.later())  # stays placed
        self.b_hook = call(b.user, "Webhooks", "Create", epb.CreateWebhookRequest(
            tenant_id=b.tenant, url="http://127.0.0.1:9/b-secret-hook", secret=SECRET))
        b.policy(AGENT_POLICY)
        _, agent = b.identity(kind="agent", person_identity_id=b.user_id,
                              confirm_actions=["compute:reservations:create"])
        _, _, details, _ = failure(b.create, agent, count=1)
        self.b_confirmation = details["confirmationId"]
        b.policy("permit(principal, action, resource);")

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(scope="module")
def pair(stack: tuple[ServerThread, Client]) -> Iterator[Pair]:
    p = Pair(*stack)
    yield p
    p.close()


def absent_rsv() -> str:
    return "rsv_" + "0" * 52


def tenant_calls(p: Pair, tenant: str) -> list[tuple[str, str, Any]]:
    """Every tenant RPC, naming `tenant`, aimed at B's objects where it takes one."""
    b = p.b
    rid, pool = p.b_rsv.id, b.pool_id
    create = b.create_request(count=1)
    create.tenant_id = tenant
    return [
        ("Reservations", "Create", create),
        ("Reservations", "Get", pb.GetReservationRequest(tenant_id=tenant, reservation_id=rid)),
        ("Reservations", "List", pb.ListReservationsRequest(tenant_id=tenant, scope="all", cursor=rid)),
        ("Reservations", "Extend", pb.ExtendReservationRequest(tenant_id=tenant, reservation_id=rid, by="1h",
                                                               idempotency_key="x")),
        ("Reservations", "Renew", pb.RenewReservationRequest(tenant_id=tenant, reservation_id=rid)),
        ("Reservations", "Release", pb.ReleaseReservationRequest(tenant_id=tenant, reservation_id=rid)),
        ("Reservations", "Cancel", pb.CancelReservationRequest(tenant_id=tenant, reservation_id=rid)),
        ("Confirmations", "Get", pb.GetConfirmationRequest(tenant_id=tenant, confirmation_id=p.b_confirmation)),
        ("Confirmations", "Approve", pb.DecideConfirmationRequest(tenant_id=tenant,
                                                                  confirmation_id=p.b_confirmation)),
        ("Confirmations", "Reject", pb.DecideConfirmationRequest(tenant_id=tenant,
                                                                 confirmation_id=p.b_confirmation)),
        ("Capacity", "Timeline", cpb.TimelineRequest(tenant_id=tenant, pool_id=pool)),
        ("Capacity", "Preview", create),
        ("Capacity", "Rollup", cpb.RollupRequest(tenant_id=tenant, pool_id=pool)),
        ("Webhooks", "Create", epb.CreateWebhookRequest(tenant_id=tenant, url="http://127.0.0.1:9/x")),
        ("Webhooks", "Get", epb.GetWebhookRequest(tenant_id=tenant, webhook_id=p.b_hook.id)),
        ("Webhooks", "List", epb.ListWebhooksRequest(tenant_id=tenant, cursor=p.b_hook.id)),
        ("Webhooks", "Delete", epb.DeleteWebhookRequest(tenant_id=tenant, webhook_id=p.b_hook.id)),
        ("Webhooks", "ListDeliveries", epb.ListDeliveriesRequest(tenant_id=tenant, webhook_id=p.b_hook.id)),
        ("Projects", "Create", ppb.CreateProjectRequest(tenant_id=tenant, name="x")),
        ("Projects", "List", ppb.ListProjectsRequest(tenant_id=tenant)),
        ("ReservationGrants", "Get", gpb.GetReservationGrantRequest(tenant_id=tenant,
                                                                    grant_id="rgrant_" + "0" * 26)),
        ("ReservationGrants", "List", gpb.ListReservationGrantsRequest(tenant_id=tenant)),
        ("Instances", "Create", ipb.CreateInstanceRequest(tenant_id=tenant, pool_id=pool, flavor="n2-standard-8",
                                                          name="x", idempotency_key="x")),
        ("Instances", "Get", ipb.InstanceRequest(tenant_id=tenant, instance_id="inst_" + "0" * 26)),
        ("Instances", "List", ipb.ListInstancesRequest(tenant_id=tenant)),
        ("Instances", "Stop", ipb.InstanceRequest(tenant_id=tenant, instance_id="inst_" + "0" * 26)),
        ("Instances", "Start", ipb.InstanceRequest(tenant_id=tenant, instance_id="inst_" + "0" * 26)),
        ("Instances", "Delete", ipb.InstanceRequest(tenant_id=tenant, instance_id="inst_" + "0" * 26)),
        ("Usage", "Query", upb.QueryUsageRequest(tenant_id=tenant, meter="gpu.hours", pool_id=pool)),
    ]


def leaks(p: Pair, details: dict[str, str], message: str) -> list[str]:
    """B's data found in an error: its pool, nodes, reservation ids beyond what A sent, its hook URL."""
    text = message + " " + " ".join(f"{k}={v}" for k, v in details.items())
    secrets = [p.b.pool_id, p.b_hook.url, *(n.id for n in p.b.nodes), *(n.name for n in p.b.nodes), p.b.user_id]
    return [s for s in secrets if s and s in text and s not in ("",)]


def test_every_tenant_rpc_naming_tenant_b_is_access_denied(pair: Pair) -> None:
    for service, method, request in tenant_calls(pair, pair.b.tenant):
        code, reason, details, message = failure(call, pair.a.user, service, method, request)
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED"), (service, method, reason)
        assert not leaks(pair, details, message), (service, method, details, message)


def test_a_watch_naming_tenant_b_is_access_denied(pair: Pair) -> None:
    watch = methods("Events")[0]
    code, reason, details, message = failure(invoke, pair.a.user, watch,
                                             epb.WatchRequest(tenant_id=pair.b.tenant))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    assert not leaks(pair, details, message)


def test_b_objects_under_a_tenant_are_not_found_as_absent_ones(pair: Pair) -> None:
    a, b = pair.a, pair.b
    absent_hook = "whk_" + "0" * 26
    absent_conf = "conf_" + "0" * 26
    cases = [
        ("Reservations", "Get", lambda r: pb.GetReservationRequest(tenant_id=a.tenant, reservation_id=r), "rsv"),
        ("Reservations", "Extend", lambda r: pb.ExtendReservationRequest(
            tenant_id=a.tenant, reservation_id=r, by="1h", idempotency_key="x"), "rsv"),
        ("Reservations", "Renew", lambda r: pb.RenewReservationRequest(tenant_id=a.tenant, reservation_id=r), "rsv"),
        ("Reservations", "Release", lambda r: pb.ReleaseReservationRequest(tenant_id=a.tenant, reservation_id=r),
         "rsv"),
        ("Reservations", "Cancel", lambda r: pb.CancelReservationRequest(tenant_id=a.tenant, reservation_id=r), "rsv"),
        ("Confirmations", "Get", lambda c: pb.GetConfirmationRequest(tenant_id=a.tenant, confirmation_id=c), "conf"),
        ("Confirmations", "Approve", lambda c: pb.DecideConfirmationRequest(tenant_id=a.tenant, confirmation_id=c),
         "conf"),
        ("Confirmations", "Reject", lambda c: pb.DecideConfirmationRequest(tenant_id=a.tenant, confirmation_id=c),
         "conf"),
        ("Webhooks", "Get", lambda h: epb.GetWebhookRequest(tenant_id=a.tenant, webhook_id=h), "hook"),
        ("Webhooks", "Delete", lambda h: epb.DeleteWebhookRequest(tenant_id=a.tenant, webhook_id=h), "hook"),
        ("Webhooks", "ListDeliveries", lambda h: epb.ListDeliveriesRequest(tenant_id=a.tenant, webhook_id=h),
         "hook"),
        ("Capacity", "Timeline", lambda p: cpb.TimelineRequest(tenant_id=a.tenant, pool_id=p), "pool"),
        ("Capacity", "Rollup", lambda p: cpb.RollupRequest(tenant_id=a.tenant, pool_id=p), "pool"),
        ("Capacity", "Preview", lambda p: a.create_request(pool_id=p), "pool"),
        ("Reservations", "Create", lambda p: a.create_request(pool_id=p), "pool"),
        ("Instances", "Create", lambda p: ipb.CreateInstanceRequest(
            tenant_id=a.tenant, pool_id=p, flavor="n2-standard-8", name="x", idempotency_key="k" + p[-8:]), "pool"),
    ]
    theirs = {"rsv": pair.b_rsv.id, "conf": pair.b_confirmation, "hook": pair.b_hook.id, "pool": b.pool_id}
    absent = {"rsv": absent_rsv(), "conf": absent_conf, "hook": absent_hook, "pool": "pool_" + "0" * 26}
    for service, method, build, kind in cases:
        got = failure(call, a.user, service, method, build(theirs[kind]))
        none = failure(call, a.user, service, method, build(absent[kind]))
        assert got[:2] == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND"), (service, method, got)
        # The same answer as for an absent object, but for the id itself.
        assert got[3].replace(theirs[kind], "ID") == none[3].replace(absent[kind], "ID"), (service, method)
        assert {k: v.replace(theirs[kind], "ID") for k, v in got[2].items()} == \
               {k: v.replace(absent[kind], "ID") for k, v in none[2].items()}, (service, method)
    # B's objects are untouched.
    again = call(b.user, "Reservations", "Get", pb.GetReservationRequest(tenant_id=b.tenant,
                                                                         reservation_id=pair.b_rsv.id))
    assert again.state == pair.b_rsv.state and again.during.end == pair.b_rsv.during.end
    assert call(b.user, "Webhooks", "Get", epb.GetWebhookRequest(tenant_id=b.tenant, webhook_id=pair.b_hook.id))
    assert call(b.user, "Confirmations", "Get", pb.GetConfirmationRequest(
        tenant_id=b.tenant, confirmation_id=pair.b_confirmation)).state == "pending"


def test_b_cursors_list_nothing_of_b(pair: Pair) -> None:
    a, b = pair.a, pair.b
    listed = call(a.user, "Reservations", "List", pb.ListReservationsRequest(
        tenant_id=a.tenant, scope="all", cursor=pair.b_rsv.id))
    assert all(r.tenant_id == a.tenant for r in listed.items)
    hooks = call(a.user, "Webhooks", "List", epb.ListWebhooksRequest(tenant_id=a.tenant, cursor=pair.b_hook.id))
    assert all(h.tenant_id == a.tenant for h in hooks.items)
    b_event = b.sql("SELECT max(id) FROM events WHERE tenant_id = %s", (b.tenant,))[0][0]
    own = call(a.user, "Webhooks", "Create", epb.CreateWebhookRequest(
        tenant_id=a.tenant, url="http://127.0.0.1:9/a-hook", secret=SECRET))
    try:
        deliveries = call(a.user, "Webhooks", "ListDeliveries", epb.ListDeliveriesRequest(
            tenant_id=a.tenant, webhook_id=own.id, before_event_id=b_event + 1))
        assert all(d.subject != f"reservation/{pair.b_rsv.id}" for d in deliveries.items)
    finally:
        call(a.user, "Webhooks", "Delete", epb.DeleteWebhookRequest(tenant_id=a.tenant, webhook_id=own.id))


@pytest.mark.parametrize("variant", [str.upper, lambda s: s + " ", lambda s: " " + s, lambda s: s + "\n",
                                     lambda s: s.replace("_", "-")])
def test_ids_that_differ_in_case_or_spacing_reach_nothing(pair: Pair, variant: Any) -> None:
    a, b = pair.a, pair.b
    for service, method, request in [
        ("Reservations", "Get", pb.GetReservationRequest(tenant_id=a.tenant, reservation_id=variant(pair.b_rsv.id))),
        ("Reservations", "Get", pb.GetReservationRequest(tenant_id=variant(b.tenant), reservation_id=pair.b_rsv.id)),
        ("Webhooks", "Get", epb.GetWebhookRequest(tenant_id=a.tenant, webhook_id=variant(pair.b_hook.id))),
        ("Capacity", "Timeline", cpb.TimelineRequest(tenant_id=a.tenant, pool_id=variant(b.pool_id))),
        ("Confirmations", "Get", pb.GetConfirmationRequest(tenant_id=a.tenant,
                                                           confirmation_id=variant(pair.b_confirmation))),
    ]:
        code, reason, details, message = failure(call, a.user, service, method, request)
        assert reason in ("INVALID_INPUT", "NOT_FOUND", "ACCESS_DENIED"), (service, method, reason)
        assert not leaks(pair, details, message)


def test_a_non_root_caller_is_denied_every_root_only_rpc(pair: Pair) -> None:
    a = pair.a
    swept = 0
    for service in ROOT_ONLY:
        for method in methods(service):
            request = message_factory.GetMessageClass(method.input_type)()
            if "tenant_id" in request.DESCRIPTOR.fields_by_name:
                for tenant in (a.tenant, bootstrap.ROOT_TENANT):
                    request.tenant_id = tenant
                    assert failure(invoke, a.user, method, request)[1] == "ACCESS_DENIED", (service, method.name)
            else:
                assert failure(invoke, a.user, method, request)[:2] == (
                    grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED"), (service, method.name)
            swept += 1
    for service, name in ROOT_ONLY_METHODS:
        method = SERVICES[service].DESCRIPTOR.services_by_name[service].methods_by_name[name]
        for tenant in (a.tenant, bootstrap.ROOT_TENANT):
            request = message_factory.GetMessageClass(method.input_type)(
                tenant_id=tenant, account_id="pacct_" + "0" * 26, grant_id="rgrant_" + "0" * 26) \
                if name == "End" else message_factory.GetMessageClass(method.input_type)(
                tenant_id=tenant, account_id="pacct_" + "0" * 26, reservation_id="r", grant_tenant_id=a.tenant,
                slots=1, starts_at=1, ends_at=2, idempotency_key="k")
            assert failure(invoke, a.user, method, request)[1] == "ACCESS_DENIED", (service, name)
        swept += 1
    assert swept >= 30
    # Root's "all" listing of grants is root's alone.
    assert failure(call, a.user, "ReservationGrants", "List", gpb.ListReservationGrantsRequest(
        tenant_id=a.tenant, all=True))[1] == "ACCESS_DENIED"


def _every_method() -> list[Any]:
    return [m for service in SERVICES for m in methods(service)]


@pytest.mark.parametrize("how", ["revoked", "expired", "offboarded"])
def test_a_dead_token_is_unauthenticated_on_every_service(pair: Pair, how: str) -> None:
    a = pair.a
    ident, client = a.identity()
    call(client, "Reservations", "List", pb.ListReservationsRequest(tenant_id=a.tenant))  # alive first
    if how == "revoked":
        a.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident))
    elif how == "expired":
        a.sql("UPDATE api_tokens SET created_at = now() - interval '2 seconds',"
              " expires_at = now() - interval '1 second' WHERE identity_id = %s", (ident,))
    else:
        a.root.admin("OffboardIdentity", apb.OffboardIdentityRequest(identity_id=ident,
                                                                     successor_identity_id=a.user_id))
    every = _every_method()
    assert len(every) >= 60
    for method in every:
        request = message_factory.GetMessageClass(method.input_type)()
        if "tenant_id" in request.DESCRIPTOR.fields_by_name:
            request.tenant_id = a.tenant
        code, reason, _, _ = failure(invoke, client, method, request)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"), method.full_name


def test_b_events_never_reach_a_watch_even_filtered_by_b_subject(pair: Pair) -> None:
    a, b = pair.a, pair.b
    subject = f"reservation/{pair.b_rsv.id}"
    b_last = b.sql("SELECT max(id) FROM events WHERE tenant_id = %s", (b.tenant,))[0][0]
    with Stream(a.user, tenant_id=a.tenant, subject=subject) as by_subject, \
            Stream(a.user, tenant_id=a.tenant, after_id=max(0, b_last - 1)) as resumed:
        call(b.user, "Reservations", "Release", pb.ReleaseReservationRequest(
            tenant_id=b.tenant, reservation_id=pair.b_rsv.id))
        # B's release event is written; then one of A's own, which A's resumed stream must see.
        mine = a.create(count=1)
        got = resumed.take(1)
        assert got[0].tenant_id == a.tenant and got[0].subject == f"reservation/{mine.id}"
        assert all(e.tenant_id == a.tenant for e in got)
        by_subject.quiet()
    pair.b_rsv = call(b.user, "Reservations", "Get", pb.GetReservationRequest(
        tenant_id=b.tenant, reservation_id=pair.b_rsv.id))


def test_b_events_never_reach_a_webhook(pair: Pair) -> None:
    a, b = pair.a, pair.b
    receiver = Receiver()
    try:
        hook = call(a.user, "Webhooks", "Create", epb.CreateWebhookRequest(
            tenant_id=a.tenant, url=receiver.url, secret=SECRET))
        theirs = b.create(count=1)
        mine = a.create(count=1)
        wait_for(lambda: receiver.of(subject=f"reservation/{mine.id}"))
        assert not receiver.of(subject=f"reservation/{theirs.id}")
        assert all(h.event["tenantId"] == a.tenant for h in receiver.hits)
        call(a.user, "Webhooks", "Delete", epb.DeleteWebhookRequest(tenant_id=a.tenant, webhook_id=hook.id))
    finally:
        receiver.close()


def wait_for(check: Any, seconds: float = 20) -> Any:
    import time
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_delegated_agent_acts_only_where_its_person_is_a_member(pair: Pair) -> None:
    """An agent acts for its person: a tenant its person is not a member of is not the agent's either,
    whatever memberships the agent row carries."""
    a, b = pair.a, pair.b
    _, agent = a.identity(kind="agent", tenants=[a.tenant, b.tenant], person_identity_id=a.user_id)
    code, reason, _, _ = failure(call, agent, "Reservations", "List", pb.ListReservationsRequest(
        tenant_id=b.tenant, scope="all"))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    assert failure(b.create, agent, count=1)[1] == "ACCESS_DENIED"
    # In the person's tenant, the agent works.
    assert call(agent, "Reservations", "List", pb.ListReservationsRequest(tenant_id=a.tenant)) is not None


def test_a_spot_victim_is_never_told_which_reservation_of_another_tenant_preempted_it(
        stack: tuple[ServerThread, Client]) -> None:
    """B owns a pool offered to A; A's spot work there is preempted by B's regular reservation. A sees
    its notice, its condition and its events, but never B's reservation id."""
    server, root = stack
    b = make_world(server.endpoint, root, server.conninfo, nodes=1)
    a = make_world(server.endpoint, root, server.conninfo, nodes=0)
    try:
        b.sql("UPDATE pools SET policy = policy || '{\"spot\": {\"noticeSeconds\": 600}}'::jsonb WHERE id = %s",
              (b.pool_id,))
        root.admin("OfferPool", apb.OfferPoolRequest(pool_id=b.pool_id, tenant_id=a.tenant))
        spot = a.create(count=8, pool_id=b.pool_id, spot=True, duration="8h")
        assert spot.state == "placed", spot
        server.call(server.app.runtime.capacity.barrier())
        with Stream(a.user, tenant_id=a.tenant, subject=f"reservation/{spot.id}",
                    types=["reservation.preempting"]) as stream:
            theirs = b.create(count=8)
            assert theirs.state == "placed", theirs
            notice = stream.take(1)[0]
        seen = call(a.user, "Reservations", "Get", pb.GetReservationRequest(tenant_id=a.tenant,
                                                                             reservation_id=spot.id))
        preempting = [c for c in seen.conditions if c.type == "Preempting"]
        assert preempting, seen.conditions
        assert theirs.id not in str(seen)
        assert theirs.id not in str(notice) and notice.data["noticeUntil"] > 0
        stored = a.sql("SELECT data FROM events WHERE subject = %s", (f"reservation/{spot.id}",))
        assert all(theirs.id not in str(d) for (d,) in stored)
    finally:
        a.close()
        b.close()


def test_a_delegated_agent_is_never_allowed_what_its_person_is_refused(world: World) -> None:
    """IAM refuses the person a create: its agent, acting for it, is refused too (ACCESS_DENIED,
    no confirmation the person could only approve into a refusal), and nothing is placed."""
    world.policy('permit(principal, action, resource);\n'
                 f'forbid(principal == Identity::"{world.user_id}", action == Action::"compute:reservations:create",'
                 ' resource);')
    assert failure(world.create, world.user, count=1)[1] == "ACCESS_DENIED"
    _, agent = world.identity(kind="agent", person_identity_id=world.user_id)
    assert failure(world.create, agent, count=1)[1] == "ACCESS_DENIED"
    _, held = world.identity(kind="agent", person_identity_id=world.user_id,
                             confirm_actions=["compute:reservations:create"])
    world.policy('permit(principal, action, resource) unless { context.delegated };\n'
                 f'forbid(principal == Identity::"{world.user_id}", action == Action::"compute:reservations:create",'
                 ' resource);')
    assert failure(world.create, held, count=1)[1] == "ACCESS_DENIED"
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s AND state NOT IN ('draft', 'denied')",
                     (world.tenant,))[0][0] == 0
    assert world.sql("SELECT count(*) FROM confirmations WHERE tenant_id = %s", (world.tenant,))[0][0] == 0
    # What the person may do, its agent may do.
    world.policy("permit(principal, action, resource);")
    assert world.create(agent, count=1).state in ("placed", "binding")


def test_b_grants_instances_and_usage_are_not_found_or_absent_for_a(pair: Pair, sim: SimThread) -> None:
    a, b = pair.a, pair.b
    vps = make_vps(b, sim, total=4)
    grant = vps.grant(slots=1)
    inst = vps.instance()
    theirs = Stubs(a.user)
    cases = [
        ("grants", "Get", lambda g: gpb.GetReservationGrantRequest(tenant_id=a.tenant, grant_id=g), grant.id,
         "rgrant_" + "0" * 26),
        *[("instances", m, lambda i: ipb.InstanceRequest(tenant_id=a.tenant, instance_id=i), inst.id,
           "inst_" + "0" * 26) for m in ("Get", "Stop", "Start", "Delete")],
    ]
    for service, method, build, their_id, absent in cases:
        got = failure(theirs, service, method, build(their_id))
        none = failure(theirs, service, method, build(absent))
        assert got[:2] == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND"), (service, method, got)
        assert got[3].replace(their_id, "ID") == none[3].replace(absent, "ID")
        assert {k: v.replace(their_id, "ID") for k, v in got[2].items()} == \
               {k: v.replace(absent, "ID") for k, v in none[2].items()}
    assert grant.id not in str(theirs("grants", "List", gpb.ListReservationGrantsRequest(tenant_id=a.tenant)))
    assert inst.id not in str(theirs("instances", "List", ipb.ListInstancesRequest(tenant_id=a.tenant)))
    assert not theirs("usage", "Query", upb.QueryUsageRequest(tenant_id=a.tenant, meter="vm.", pool_id=b.pool_id)).items
    # A's own instance on B's pool, not offered to A: NOT_FOUND, as an absent pool.
    assert failure(vps.instance, theirs, tenant=a.tenant)[1] == "NOT_FOUND"
    assert vps.instance_call("Get", inst.id).state == inst.state  # B's instance untouched


def test_an_agent_acting_for_an_offboarded_person_is_unauthenticated(world: World) -> None:
    """Offboarding disables the person's agents; an agent for the person cannot be registered
    afterwards (INVALID_STATE, tests/test_hostile_round25e.py), and one whose row exists anyway (made
    before that check) must not act for the person who is gone either."""
    person, _ = world.identity()
    world.root.admin("OffboardIdentity", apb.OffboardIdentityRequest(identity_id=person,
                                                                     successor_identity_id=world.user_id))
    assert failure(world.identity, kind="agent", person_identity_id=person)[1] == "INVALID_STATE"
    agent_id = f"agent-late-{world.tenant}"
    world.sql("INSERT INTO identities (id, kind, name, delegator_id) VALUES (%s, 'agent', %s, %s)",
              (agent_id, agent_id, person))
    world.sql("INSERT INTO memberships (tenant_id, identity_id) VALUES (%s, %s)", (world.tenant, agent_id))
    agent = Client(world.endpoint, world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=agent_id)).secret)
    try:
        code, reason, _, _ = failure(call, agent, "Reservations", "List", pb.ListReservationsRequest(
            tenant_id=world.tenant))
    finally:
        agent.close()
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")


def test_an_agent_cannot_be_registered_to_act_for_another_agent(world: World) -> None:
    """An agent acts for a person: one registered for an agent would be decided as that agent's
    person (and have its confirmations approved by the agent), beyond the real person's say."""
    agent_id, _ = world.identity(kind="agent", person_identity_id=world.user_id)
    code, reason, details, _ = failure(world.identity, kind="agent", person_identity_id=agent_id)
    assert (code, reason, details.get("field")) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "delegation.personIdentityId")
