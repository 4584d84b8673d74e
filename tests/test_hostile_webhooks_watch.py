"""Webhooks and Watch as a hostile tenant uses them, after the SSRF, limits and tenancy reviews
(tests/test_webhook_ssrf.py, tests/test_hostile_hooks.py, tests/test_hostile_tenant.py)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from bettercompute.v1 import events_pb2 as epb
from controlplane.webhooks import sender, targets
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world, rpc_error
from tests.test_watch import Stream
from tests.test_webhook_ssrf import TRICKLE, Peer
from tests.test_webhooks import LOOPBACK, Receiver, create_hook, deliveries, eventually, hooks, reserve


@pytest.fixture(scope="module")
def short(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Loopback receivers allowed; a one-second deadline per attempt (and per URL check)."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=1)


def new_world(stack: tuple[ServerThread, Client]) -> World:
    server, root = stack
    return make_world(server.endpoint, root, server.conninfo)


class Resolver:
    """The system resolver, as a hostile tenant's DNS makes it behave: a name under
    `blackhole.test` is never answered (its authoritative servers drop queries: the C library's
    getaddrinfo blocks its thread until its own timeouts, seconds to minutes), a name under
    `loop.test` answers 127.0.0.1 at once; other names go to the real resolver."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.blocked = 0
        real = socket.getaddrinfo

        def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
            name = host.decode() if isinstance(host, bytes) else str(host)
            if name.endswith("blackhole.test"):
                with self.lock:
                    self.blocked += 1
                self.release.wait(120)
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            if name.endswith("loop.test"):
                return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", int(port)))]
            return real(host, port, *args, **kw)

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Resolver]:
    r = Resolver(monkeypatch)
    try:
        yield r
    finally:
        r.release.set()


def test_a_name_that_never_resolves_does_not_lock_other_tenants_out_of_webhooks(
        short: tuple[ServerThread, Client], resolver: Resolver) -> None:
    """Attack: tenant A registers webhooks (and so has targets checked) at names whose DNS never
    answers. Each check gives up at its deadline, but the resolver's thread runs on: with the
    lookups on the event loop's shared executor (a handful of threads), A's abandoned lookups held
    every thread, and every other tenant's URL check and delivery to a name timed out behind them
    (and anything else of the process on that executor, such as connecting to a database by
    name). A tenant's lookups still running are capped, on threads of their own."""
    a, b = new_world(short), new_world(short)
    receiver = Receiver()

    def hostile(n: int) -> str:
        with pytest.raises(grpc.RpcError) as exc:
            create_hook(a, f"http://h{n}.blackhole.test:9/hook")
        return rpc_error(exc)[1]

    try:
        with ThreadPoolExecutor(40) as pool:
            assert set(pool.map(hostile, range(40))) == {"INVALID_INPUT"}
        assert resolver.blocked  # A's lookups still run
        port = receiver.url.rsplit(":", 1)[1]
        hook = create_hook(b, f"http://hook.loop.test:{port}")  # checked by name, while A's hang
        assert hook.url.startswith("http://hook.loop.test:")
        subject = reserve(b)
        hit = eventually(lambda: receiver.of(subject))[0]
        assert hit.signed and hit.status == 200
        hooks(b.user, "Delete", epb.DeleteWebhookRequest(tenant_id=b.tenant, webhook_id=hook.id))
        # A few of A's lookups ever ran; the others were refused without a thread.
        assert resolver.blocked == targets.LOOKUPS_PER_TENANT
    finally:
        resolver.release.set()
        receiver.close()
        a.close()
        b.close()


@pytest.fixture(scope="module")
def patient(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Loopback receivers allowed; a deadline per attempt longer than any test waits."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=300)


class Flood:
    """A receiver on 127.0.0.1 that reads the request's head and then sends `head` followed by
    `line` over and over, as fast as the client reads, until the client goes."""

    def __init__(self, head: bytes, line: bytes) -> None:
        self.head, self.chunk = head, line * (65536 // len(line))
        self.sent: list[int] = []  # bytes sent per connection, once the client went
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        sent = 0
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536) or b"\r\n\r\n"
            conn.sendall(self.head)
            while True:
                conn.sendall(self.chunk)
                sent += len(self.chunk)
        except OSError:
            self.sent.append(sent)
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_an_endless_answer_ends_the_attempt_at_once(patient: tuple[ServerThread, Client]) -> None:
    """Attack: a receiver answers "100 Continue" and then header lines without end, as fast as
    they are read. Only the status matters, but the interim answer's headers were read to their
    blank line: the attempt parsed the flood on the event loop it shares with the API, burning CPU
    until the deadline. The answer's head is capped: past it, the attempt ends, not an HTTP answer.
    (A 2xx followed by an endless body held: the attempt ends at the status line.)"""
    world = new_world(patient)
    interim = Flood(b"HTTP/1.1 100 Continue\r\n", b"x-flood: y\r\n")
    body = Flood(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999999\r\n\r\n", b"x" * 64)
    try:
        flooded, endless = create_hook(world, interim.url), create_hook(world, body.url)
        reserve(world)
        d = eventually(lambda: next((d for d in deliveries(world, flooded).values() if d.last_error), None))
        assert (d.last_error, d.HasField("last_status")) == (sender.BAD_ANSWER, False)
        d = eventually(lambda: next((d for d in deliveries(world, endless).values() if d.state != "pending"), None))
        assert (d.state, d.last_status, d.attempts) == ("delivered", 200, 1)
        # Each connection was cut after a small part of the flood.
        assert max(eventually(lambda: interim.sent) + eventually(lambda: body.sent)) < 16 << 20
    finally:
        interim.close()
        body.close()
        world.close()


@pytest.fixture(scope="module")
def capped(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Loopback allowed; a deadline longer than any test; 3 attempts per process, 2 per tenant."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=600, webhook_concurrency=3,
                            webhook_tenant_concurrency=2)


def test_deleting_a_webhook_mid_attempt_does_not_free_its_tenants_slot(capped: tuple[ServerThread, Client]) -> None:
    """Attack: tenant A's slow receivers hold its two slots; A deletes a webhook whose attempt is
    in flight. The attempt runs on to its deadline, but its lease was a column of the delivery
    row the delete removed, so the cap counted one attempt fewer and A took another slot: deleting
    and recreating webhooks, A held every slot of the process and other tenants waited. A lease
    now outlives its webhook until the attempt records its outcome or the lease ends."""
    a, b = new_world(capped), new_world(capped)
    slow, quick = Peer(TRICKLE, gap=0.1), Receiver()
    try:
        made = [create_hook(a, slow.url) for _ in range(3)]
        reserve(a)  # one event, three deliveries: two attempts start (A's cap)
        eventually(lambda: slow.open == 2)
        in_flight = [h for h in made if any(d.attempts for d in deliveries(a, h).values())]
        assert len(in_flight) == 2
        hooks(a.user, "Delete", epb.DeleteWebhookRequest(tenant_id=a.tenant, webhook_id=in_flight[0].id))
        create_hook(b, quick.url)
        subject = reserve(b)
        eventually(lambda: quick.of(subject))
        assert (slow.open, slow.max_open, slow.accepted) == (2, 2, 2)
        slow.close()  # the attempts end: the deleted webhook's gives its lease back too
        eventually(lambda: a.sql("SELECT count(*) FROM webhook_leases WHERE webhook_id = %s",
                                 (in_flight[0].id,))[0][0] == 0)
    finally:
        slow.close()
        quick.close()
        a.close()
        b.close()


def test_a_redirect_is_not_followed(short: tuple[ServerThread, Client]) -> None:
    """Held: a receiver answering 307 (or 302) with a Location elsewhere, here another allowed
    receiver standing for an internal one, is a failed attempt; nothing goes to the Location."""
    world = new_world(short)
    inside = Receiver()
    redirect = Peer(f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {inside.url}\r\nContent-Length: 0\r\n\r\n".encode())
    try:
        hook = create_hook(world, redirect.url)
        reserve(world)
        d = eventually(lambda: next((d for d in deliveries(world, hook).values() if d.last_error), None))
        assert (d.last_error, d.last_status) == ("HTTP 307", 307)
        assert inside.of() == []
    finally:
        redirect.close()
        inside.close()
        world.close()


def test_watch_and_webhook_filters_at_and_past_their_limits(short: tuple[ServerThread, Client]) -> None:
    """Held: filters are bounded (32 types of at most 128 characters, a subject of at most 256)
    and exact: LIKE wildcards are refused, and a subject's prefix or a type prefix without its dot
    matches nothing else."""
    world = new_world(short)
    try:
        longest = ["a" * 125 + f".{i:02d}" for i in range(32)]
        for fields, field in (({"types": longest + ["b."]}, "types"), ({"types": ["a" * 129]}, "types"),
                              ({"subject": "r/" + "x" * 255}, "subject"), ({"types": ["reservation.%"]}, "types"),
                              ({"types": [".reservation"]}, "types"), ({"subject": "reservation/\x00"}, "subject"),
                              ({"subject": "reservation/%"}, "subject"), ({"subject": "reservation/_*"}, "subject")):
            with Stream(world.user, tenant_id=world.tenant, **fields) as stream:
                with pytest.raises(grpc.RpcError) as exc:
                    stream.take(1)
            assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": field}), fields
        with pytest.raises(grpc.RpcError) as exc:
            create_hook(world, "http://127.0.0.1:9/", event_types=longest + ["b."])
        assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": "eventTypes"})
        subject = reserve(world)
        with Stream(world.user, tenant_id=world.tenant, types=longest) as by_long, \
                Stream(world.user, tenant_id=world.tenant, subject="reservation/") as prefix, \
                Stream(world.user, tenant_id=world.tenant, types=["reservation"]) as no_dot, \
                Stream(world.user, tenant_id=world.tenant, subject=subject, types=["reservation."]) as exact:
            assert exact.take(1)[0].subject == subject
            for stream in (by_long, prefix, no_dot):
                stream.quiet()
    finally:
        world.close()
