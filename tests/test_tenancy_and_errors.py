"""Authentication, tenancy, admin guards, error hygiene and the per-RPC log line."""

from __future__ import annotations

import grpc
import psycopg
import pytest
import structlog

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import bootstrap
from tests.support import Client, ServerThread, World, make_world, rpc_error


def test_missing_or_bad_token_is_unauthenticated(world: World) -> None:
    for token in ("", "bct_not-a-real-token"):
        client = Client(world.endpoint, token)
        if not token:
            client.metadata = ()
        with pytest.raises(grpc.RpcError) as exc:
            world.create(client)
        code, reason, _ = rpc_error(exc)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        client.close()


def test_another_tenants_token_is_denied_on_create_and_not_found_on_get(world: World, stack) -> None:
    server, root = stack
    ours = world.create(count=1)
    other = make_world(server.endpoint, root, server.conninfo, nodes=0)
    with pytest.raises(grpc.RpcError) as exc:
        world.create(other.user)  # our tenant id, their token
    assert rpc_error(exc)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    with pytest.raises(grpc.RpcError) as exc:
        other.user.res("Get", pb.GetReservationRequest(tenant_id=other.tenant, reservation_id=ours.id))
    assert rpc_error(exc)[1] == "NOT_FOUND"
    for method in ("Release", "Cancel"):
        with pytest.raises(grpc.RpcError) as exc:
            other.user.res(method, getattr(pb, f"{method}ReservationRequest")(
                tenant_id=other.tenant, reservation_id=ours.id))
        assert rpc_error(exc)[1] == "NOT_FOUND"
    listed = other.user.res("List", pb.ListReservationsRequest(tenant_id=other.tenant, scope="all"))
    assert ours.id not in [r.id for r in listed.items]
    assert world.user.res("Get", pb.GetReservationRequest(tenant_id=world.tenant,
                                                          reservation_id=ours.id)).state in ("placed", "binding")


def test_admin_needs_the_root_tenant(world: World) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        world.user.admin("CreateTenant", apb.CreateTenantRequest(id="sneaky", name="x"))
    assert rpc_error(exc)[1] == "ACCESS_DENIED"


def test_invalid_cedar_is_invalid_input(world: World) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        world.root.admin("PutPolicy", apb.PutPolicyRequest(tenant_id=world.tenant, cedar="permit(principal,"))
    code, reason, details = rpc_error(exc)
    assert reason == "INVALID_INPUT" and details["field"] == "cedar"


def test_operators_cannot_set_system_labels(world: World) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        world.root.admin("RegisterNode", apb.RegisterNodeRequest(
            pool_id=world.pool_id, name="fake-fabric", labels={"fabric.domain": "f1"}))
    assert rpc_error(exc)[1] == "INVALID_INPUT"


def test_node_selector_matches_labels(world: World) -> None:
    labelled = world.add_node(labels={"rack": "r7"}, system_labels={"fabric.domain": "fab-1"})
    r = world.create(count=1, node_selector={"rack": "r7", "fabric.domain": "fab-1"})
    assert r.allocations[0].node_id == labelled.id
    miss = world.create(count=1, node_selector={"rack": "r8"})
    assert miss.state == "pending" and "without the selected labels" in miss.conditions[0].message


def test_every_rpc_logs_one_line_with_method_tenant_code_duration_and_request_id(world: World) -> None:
    with structlog.testing.capture_logs() as logs:
        call = world.user._r.Create.with_call
        _, rendezvous = call(world.create_request(count=1),
                             metadata=world.user.metadata + (("x-request-id", "req-abc-123"),), timeout=30)
        with pytest.raises(grpc.RpcError):
            world.create(count=0)
    lines = [e for e in logs if e.get("event") == "rpc"]
    assert len(lines) == 2
    ok, bad = lines
    assert ok["method"] == "/bettercompute.v1.Reservations/Create" and ok["tenant"] == world.tenant
    assert ok["code"] == "OK" and ok["request_id"] == "req-abc-123" and ok["duration_ms"] >= 0
    assert ok["identity"] == world.user_id
    assert bad["code"] == "INVALID_INPUT" and len(bad["request_id"]) == 32
    assert dict(rendezvous.trailing_metadata())["x-request-id"] == "req-abc-123"


def test_internal_errors_reveal_no_traceback_or_sql(database: str) -> None:
    server = ServerThread(database, workers=False)
    try:
        root = Client(server.endpoint, bootstrap.ensure_root(database))
        w = make_world(server.endpoint, root, database, nodes=1)
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("ALTER TABLE authz_projection RENAME TO authz_projection_gone")
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(grpc.RpcError) as exc:
                w.create(count=1)
        code, reason, details = rpc_error(exc)
        assert (code, reason) == (grpc.StatusCode.INTERNAL, "INTERNAL")
        message = exc.value.details()
        assert message == "internal error"
        assert "authz_projection" not in str(exc.value) and "Traceback" not in str(exc.value)
        assert any(e.get("event") == "rpc failed" and e.get("exc_info") for e in logs)  # the trace stays in the log
        line = next(e for e in logs if e.get("event") == "rpc")
        assert line["code"] == "INTERNAL" and line["request_id"] == details["requestId"]
        assert w.sql("SELECT count(*) FROM reservations")[0][0] == 0  # nothing half-written
        root.close()
    finally:
        server.stop()


def test_health_and_reflection_are_served(world: World) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(world.endpoint)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="bettercompute.v1.Reservations"), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=10))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"bettercompute.v1.Reservations", "bettercompute.v1.Admin"} <= names
    channel.close()


def test_clock_control_is_refused_unless_enabled(world: World) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        world.root.admin("AdvanceClock", apb.AdvanceClockRequest(by_ms=60_000))
    assert rpc_error(exc)[1] == "INVALID_STATE"
    assert world.root.admin("GetClock", apb.GetClockRequest()).offset_ms == 0
