"""API tokens: an expiry on every token, revocation by id, prefix or identity without the secret,
and the interceptor refusing request-streaming calls it cannot authenticate."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import grpc
import psycopg
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import db
from controlplane.api.interceptor import ApiInterceptor
from tests.support import Client, ServerThread, World, rpc_error

DAY_MS = 86_400_000


def _list(world: World) -> pb.ListReservationsResponse:
    assert world.user is not None
    return world.user.res("List", pb.ListReservationsRequest(tenant_id=world.tenant))


def _unauthenticated(client: Client, tenant: str) -> dict[str, str]:
    with pytest.raises(grpc.RpcError) as exc:
        client.res("List", pb.ListReservationsRequest(tenant_id=tenant))
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    return details


def _mint(world: World, identity: str, **kw: Any) -> apb.Token:
    return world.root.admin("CreateToken", apb.CreateTokenRequest(identity_id=identity, **kw))


def _now_ms(world: World) -> int:
    return world.sql("SELECT epoch_ms(now())")[0][0]


def test_a_token_gets_the_default_lifetime_an_id_and_a_prefix_and_lists_without_its_secret(world: World) -> None:
    before = _now_ms(world)
    token = _mint(world, world.user_id)
    assert token.id.startswith("tok_") and token.secret.startswith(token.prefix) and len(token.prefix) == 12
    # The default lifetime is 30 days (BC_TOKEN_TTL_SECONDS).
    assert before + 30 * DAY_MS <= token.expires_at <= _now_ms(world) + 30 * DAY_MS
    listed = world.root.admin("ListTokens", apb.ListTokensRequest(identity_id=world.user_id)).items
    assert token.id in [t.id for t in listed]
    assert all(t.secret == "" for t in listed)
    mine = next(t for t in listed if t.id == token.id)
    assert (mine.prefix, mine.expires_at, mine.revoked_at) == (token.prefix, token.expires_at, 0)


def test_root_mints_with_an_explicit_expiry_and_an_expired_token_is_unauthenticated(world: World) -> None:
    at = _now_ms(world) + 7 * DAY_MS
    assert _mint(world, world.user_id, expires_at=at).expires_at == at
    short = _mint(world, world.user_id, ttl="2s")
    client = Client(world.endpoint, short.secret)
    try:
        client.res("List", pb.ListReservationsRequest(tenant_id=world.tenant))  # valid now
        deadline = time.monotonic() + 30
        while True:
            try:
                client.res("List", pb.ListReservationsRequest(tenant_id=world.tenant))
            except grpc.RpcError:
                break
            assert time.monotonic() < deadline, "the token never expired"
            time.sleep(0.2)
        details = _unauthenticated(client, world.tenant)
        assert details["tokenId"] == short.id
        assert _now_ms(world) >= short.expires_at
    finally:
        client.close()
    # Listed only when asked for inactive ones.
    live = world.root.admin("ListTokens", apb.ListTokensRequest(identity_id=world.user_id)).items
    everything = world.root.admin("ListTokens", apb.ListTokensRequest(identity_id=world.user_id,
                                                                      include_inactive=True)).items
    assert short.id not in [t.id for t in live] and short.id in [t.id for t in everything]


@pytest.mark.parametrize("fields, field", [
    ({"ttl": "0s"}, "ttl"),
    ({"ttl": "soon"}, "ttl"),
    ({"ttl": "400d"}, "ttl"),  # beyond BC_TOKEN_MAX_TTL_SECONDS (366 days)
    ({"expires_at": 1_000}, "expiresAt"),  # in the past
    ({"ttl": "1h", "expires_at": 9_999_999_999_999}, "ttl"),
])
def test_a_bad_expiry_is_invalid_input_naming_the_field(world: World, fields: dict[str, Any], field: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        _mint(world, world.user_id, **fields)
    code, reason, details = rpc_error(exc)
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", field)


def test_revoke_by_id_and_by_prefix_without_the_secret(world: World) -> None:
    by_id, by_prefix, kept = (_mint(world, world.user_id) for _ in range(3))
    clients = {t.id: Client(world.endpoint, t.secret) for t in (by_id, by_prefix, kept)}
    try:
        for t in (by_id, by_prefix, kept):
            clients[t.id].res("List", pb.ListReservationsRequest(tenant_id=world.tenant))
        revoked = world.root.admin("RevokeTokens", apb.RevokeTokensRequest(token_id=by_id.id)).items
        assert [t.id for t in revoked] == [by_id.id] and revoked[0].revoked_at > 0
        revoked = world.root.admin("RevokeTokens", apb.RevokeTokensRequest(prefix=by_prefix.prefix)).items
        assert [t.id for t in revoked] == [by_prefix.id]
        _unauthenticated(clients[by_id.id], world.tenant)
        _unauthenticated(clients[by_prefix.id], world.tenant)
        clients[kept.id].res("List", pb.ListReservationsRequest(tenant_id=world.tenant))
        # Again: the same token, revoked at the first time.
        again = world.root.admin("RevokeTokens", apb.RevokeTokensRequest(token_id=by_id.id)).items
        assert [(t.id, t.revoked_at) for t in again] == [(by_id.id, revoked_at(world, by_id.id))]
    finally:
        for client in clients.values():
            client.close()


def revoked_at(world: World, token_id: str) -> int:
    return world.sql("SELECT epoch_ms(revoked_at) FROM api_tokens WHERE id = %s", (token_id,))[0][0]


def test_revoke_every_token_of_an_identity_leaves_others_alone(world: World) -> None:
    ident, first = world.identity()
    second = Client(world.endpoint, _mint(world, ident).secret)
    try:
        revoked = world.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident)).items
        assert len(revoked) == 2 and {t.identity_id for t in revoked} == {ident}
        _unauthenticated(first, world.tenant)
        _unauthenticated(second, world.tenant)
        _list(world)  # the world's user is another identity
        assert world.root.admin("RevokeTokens", apb.RevokeTokensRequest(identity_id=ident)).items == []
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("fields, code, reason, field", [
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "tokenId"),
    ({"token_id": "tok_" + "0" * 26, "identity_id": "x"}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT",
     "identityId"),
    ({"prefix": "bct_short"}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "prefix"),
    ({"token_id": "tok_" + "0" * 26}, grpc.StatusCode.NOT_FOUND, "NOT_FOUND", None),
    ({"identity_id": "nobody-here"}, grpc.StatusCode.NOT_FOUND, "NOT_FOUND", None),
])
def test_revoke_refuses_bad_requests(world: World, fields: dict[str, Any], code: grpc.StatusCode, reason: str,
                                     field: str | None) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        world.root.admin("RevokeTokens", apb.RevokeTokensRequest(**fields))
    got_code, got_reason, details = rpc_error(exc)
    assert (got_code, got_reason, details.get("field")) == (code, reason, field)


def test_only_root_lists_and_revokes_tokens(world: World) -> None:
    assert world.user is not None
    token = _mint(world, world.user_id)
    for method, request in (("ListTokens", apb.ListTokensRequest(identity_id=world.user_id)),
                            ("RevokeTokens", apb.RevokeTokensRequest(token_id=token.id))):
        with pytest.raises(grpc.RpcError) as exc:
            world.user.admin(method, request)
        assert rpc_error(exc)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED")
    _list(world)


# The interceptor fails closed on request-streaming handlers ------------------------------------


class _Probe:
    """A real server with the API interceptor and a service of request-streaming methods."""

    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.reached: list[str] = []
        self.grpc, self.port = server.call(self._start())

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        async def collect(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
            self.reached.append("stream_unary")
            return b"".join([r async for r in requests])

        async def echo(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            self.reached.append("stream_stream")
            async for r in requests:
                yield r

        handlers = {"Collect": grpc.stream_unary_rpc_method_handler(collect),
                    "Echo": grpc.stream_stream_rpc_method_handler(echo)}
        server = grpc.aio.server(interceptors=[ApiInterceptor(self.server.app.pool)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Probe", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        self.server.call(self.grpc.stop(0))


@pytest.fixture
def probe(stack: tuple[ServerThread, Client]) -> Any:
    found = _Probe(stack[0])
    yield found
    found.stop()


@pytest.mark.parametrize("authorised", [False, True])
def test_request_streaming_handlers_are_refused_before_they_run(probe: _Probe, world: World,
                                                                authorised: bool) -> None:
    metadata = world.root.metadata if authorised else ()
    with grpc.insecure_channel(f"127.0.0.1:{probe.port}") as channel:
        collect = channel.stream_unary("/test.Probe/Collect")
        echo = channel.stream_stream("/test.Probe/Echo")
        with pytest.raises(grpc.RpcError) as unary:
            collect(iter([b"a", b"b"]), metadata=metadata, timeout=10)
        with pytest.raises(grpc.RpcError) as streaming:
            list(echo(iter([b"a", b"b"]), metadata=metadata, timeout=10))
    for exc in (unary, streaming):
        code, reason, details = rpc_error(exc)
        assert (code, reason) == (grpc.StatusCode.UNIMPLEMENTED, "UNSUPPORTED")
        assert details["method"].startswith("/test.Probe/")
    assert probe.reached == []


# Upgrading a database whose tokens had no expiry --------------------------------------------


def test_the_migration_gives_tokens_from_before_an_id_and_an_expiry(pg_uri: str) -> None:
    """Migrations up to 0006 with a token as they wrote it, then the rest: the token gets an id
    and expires 30 days after the upgrade, so no permanent token survives it."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_uri, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    conninfo = db.with_database(pg_uri, name)
    with psycopg.connect(conninfo) as conn:
        conn.execute("CREATE TABLE schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL"
                     " DEFAULT now())")
        for path in sorted(db.MIGRATIONS.glob("*.sql")):
            if path.name < "0008":
                conn.execute(path.read_text())
                conn.execute("INSERT INTO schema_migrations (name) VALUES (%s)", (path.name,))
        conn.execute("INSERT INTO identities (id, kind, name) VALUES ('old', 'user', 'old')")
        conn.execute("INSERT INTO api_tokens (token_hash, identity_id) VALUES (sha256('bct_old'), 'old')")
    assert "0008_token_expiry.sql" in db.migrate(conninfo)
    with psycopg.connect(conninfo) as conn:
        token_id, days = conn.execute(
            "SELECT id, extract(epoch FROM expires_at - now()) / 86400 FROM api_tokens").fetchone()
    assert re.fullmatch(r"tok_[0-9a-f]{26}", token_id)
    assert 29.9 < days <= 30
