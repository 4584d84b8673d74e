"""Webhooks cannot be used to reach inside: local targets are refused in every spelling, at
registration and again at each attempt, an attempt connects to the address it checked, tenants
see fixed error texts only; and one tenant's slow receivers cannot stall the others' webhooks (a
total deadline per attempt, a per-tenant concurrency cap, a per-tenant webhook count)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import psycopg
import psycopg.rows
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bettercompute.v1 import events_pb2 as epb
from controlplane.ids import new_id
from controlplane.webhooks import delivery, queries, sender, targets
from tests.conftest import module_stack
from tests.support import Client, ServerThread, World, make_world, rpc_error
from tests.test_webhooks import SECRET, Receiver, create_hook, deliveries, eventually, hooks, reserve

LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)

# Every spelling tried; all of them are refused.
LOCAL = [
    # IPv4 loopback, unspecified, private, shared, link-local (cloud metadata), multicast, broadcast
    "http://127.0.0.1/", "http://127.1/", "http://127.0.1/", "http://2130706433/", "http://0x7f000001/",
    "http://017700000001/", "http://0177.0.0.1/", "http://0x7f.1/", "http://0x7f.0x0.0x0.0x1/",
    "http://127.000.000.001/", "http://127.255.255.254:8080/", "http://0/", "http://0.0.0.0/",
    "http://10.0.0.1/", "http://012.1/", "http://172.16.0.1/", "http://192.168.1.1/", "http://3232235777/",
    "http://100.64.0.1/", "http://169.254.169.254/latest/meta-data/", "http://0xa9fea9fe/",
    "http://2852039166/", "http://224.0.0.1/", "http://239.255.255.250/", "http://255.255.255.255/",
    "http://192.0.2.1/", "http://198.18.0.1/", "http://240.0.0.1/",
    # IPv6 loopback, unspecified, link-local, unique local, multicast, zone ids
    "http://[::1]/", "http://[0:0:0:0:0:0:0:1]/", "http://[::]/", "http://[fe80::1]/", "http://[fe80::1%25lo]/",
    "http://[fe80::1%25eth0]:8080/", "http://[fc00::1]/", "http://[fd00:ec2::254]/", "http://[ff02::1]/",
    "http://[fec0::1]/", "http://[2001:db8::1]/", "http://[2001::1]/",
    # IPv4 inside IPv6: mapped, compatible, 6to4, NAT64
    "http://[::ffff:127.0.0.1]/", "http://[::ffff:7f00:1]/", "http://[0:0:0:0:0:ffff:127.0.0.1]/",
    "http://[::ffff:169.254.169.254]/", "http://[::ffff:10.0.0.1]/", "http://[::127.0.0.1]/",
    "http://[::7f00:1]/", "http://[2002:7f00:1::]/", "http://[2002:a9fe:a9fe::1]/", "http://[64:ff9b::127.0.0.1]/",
    "http://[64:ff9b::a9fe:a9fe]/", "http://[64:ff9b:1::a00:1]/",
    # names
    "http://localhost/", "http://LOCALHOST/", "http://localhost./", "http://api.localhost/",
    "http://localhost.localdomain/", "http://no-such-host.invalid/",
    # parser confusion
    "http://8.8.8.8@127.0.0.1/", "http://127.0.0.1:80@8.8.8.8/", "http://127.0.0.1\\@8.8.8.8/",
    "http://127.0.0.1%2f@8.8.8.8/", "http://127.0.0.1./", "http://127.0.0.1\t/", "http://8.8.8.8:0/",
]
PUBLIC = {
    "http://8.8.8.8/": "8.8.8.8", "https://1.1.1.1:8443/hook?x=1": "1.1.1.1",
    "http://134744072/": "8.8.8.8", "http://[2606:4700:4700::1111]/": "2606:4700:4700::1111",
    "http://[::ffff:8.8.8.8]/": "8.8.8.8", "http://[2002:808:808::1]/": "2002:808:808::1",
    "http://[64:ff9b::8.8.8.8]/": "64:ff9b::808:808",
}


def check(url: str, allow: tuple[Any, ...] = ()) -> str:
    """The address an attempt would connect to (or the refusal)."""
    async def run() -> str:
        return (await targets.resolve(targets.parse(url), allow)).addresses[0]

    return asyncio.run(run())


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery, "POLICY", delivery.RetryPolicy(
        max_attempts=3, base_seconds=0.2, cap_seconds=0.4, poll_seconds=1))


@pytest.mark.parametrize("url", LOCAL)
def test_every_spelling_of_a_local_address_is_refused(url: str) -> None:
    with pytest.raises((targets.Refused, ValueError)):
        check(url)


@pytest.mark.parametrize("url,address", PUBLIC.items())
def test_public_addresses_are_allowed_and_are_what_the_attempt_connects_to(url: str, address: str) -> None:
    assert check(url) == address


def test_the_allowlist_is_the_only_way_to_a_local_address() -> None:
    assert check("http://127.0.0.1:9/", LOOPBACK) == "127.0.0.1"
    assert check("http://127.1:9/", LOOPBACK) == "127.0.0.1"
    assert check("http://[::ffff:127.0.0.1]:9/", LOOPBACK) == "127.0.0.1"  # connects over IPv4
    for url in ("http://127.0.0.2/", "http://[::1]/", "http://10.0.0.1/", "http://169.254.169.254/"):
        with pytest.raises(targets.Refused):
            check(url, LOOPBACK)
    with pytest.raises(ValueError):  # a zone id even when its network is allowed
        check("http://[fe80::1%25lo]/", (ipaddress.ip_network("fe80::/10"),))


def test_a_name_is_refused_when_any_of_its_addresses_is_local() -> None:
    public, local = ipaddress.ip_address("8.8.8.8"), ipaddress.ip_address("10.1.2.3")
    assert targets.judge("example.com", [public, ipaddress.ip_address("2606:4700::1")], ()) == (
        "8.8.8.8", "2606:4700::1")
    with pytest.raises(targets.Refused):
        targets.judge("example.com", [public, local], ())
    with pytest.raises(targets.Refused):
        targets.judge("example.com", [ipaddress.ip_address("fe80::1%eth0")], ())


@given(st.text(alphabet="0123456789abcdefx.", min_size=1, max_size=20))
def test_integer_octal_hex_and_short_ipv4_forms_are_read_as_the_c_library_reads_them(host: str) -> None:
    try:
        expected = ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        expected = None
    assert targets.inet_aton(host) == expected


def test_registration_refuses_local_targets_naming_the_url(world: World) -> None:
    messages = set()
    for url in LOCAL:
        with pytest.raises(grpc.RpcError) as exc:
            create_hook(world, url)
        assert rpc_error(exc)[1:] == ("INVALID_INPUT", {"field": "url"}), url
        messages.add(exc.value.details())
    # One text whether the name does not resolve or resolves to a local address: no DNS oracle.
    assert f"url: {targets.REFUSED}" in messages
    assert not any("127.0.0.1" in m or "Errno" in m for m in messages)
    hook = create_hook(world, "http://8.8.8.8:9/hook")  # public: accepted (no event, no attempt)
    hooks(world.user, "Delete", epb.DeleteWebhookRequest(tenant_id=world.tenant, webhook_id=hook.id))


def test_a_stored_local_target_is_refused_at_the_attempt_with_a_generic_error(world: World) -> None:
    """A webhook registered before the check (or whose name resolves elsewhere now) is judged
    again at every attempt: nothing reaches the address, and the tenant learns nothing about it."""
    receiver = Receiver()
    try:
        hook_id = new_id("whk")
        # Created by the world's user, who may read the events (a delivery acts as its creator).
        world.sql("INSERT INTO webhooks (id, tenant_id, url, secret, created_by) VALUES (%s, %s, %s, %s, %s)",
                  (hook_id, world.tenant, receiver.url, SECRET, world.user_id))
        hook = epb.Webhook(id=hook_id)
        reserve(world)
        d = eventually(lambda: next((d for d in deliveries(world, hook).values() if d.state == "dead"), None))
        assert (d.attempts, d.last_error, d.HasField("last_status")) == (3, sender.NOT_ALLOWED, False)
        assert receiver.of() == []
    finally:
        receiver.close()


class Peer:
    """A TCP receiver on 127.0.0.1 that reads one HTTP request per connection, answers `reply`,
    one byte every `gap` seconds when `gap` is set (a trickle), and then waits for the client
    to go. It counts connections open at once."""

    def __init__(self, reply: bytes, gap: float = 0.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.reply, self.gap = reply, gap
        self.lock = threading.Lock()
        self.open = self.max_open = self.accepted = 0
        self.requests: list[bytes] = []
        self.cut_short: list[float] = []  # connection lifetimes the client ended before the reply did
        self.conns: list[socket.socket] = []
        self.closing = False
        self.sock = socket.create_server((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}/hook"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.open += 1
                self.accepted += 1
                self.max_open = max(self.max_open, self.open)
                self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        started = time.monotonic()
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += self._recv(conn)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                body += self._recv(conn)
            with self.lock:
                self.requests.append(head + b"\r\n\r\n" + body)
            if not self.gap:
                conn.sendall(self.reply)
            else:
                for i in range(len(self.reply)):
                    conn.sendall(self.reply[i:i + 1])
                    time.sleep(self.gap)
            conn.settimeout(300)
            conn.recv(1)  # until the client goes
        except OSError:
            if not self.closing:
                with self.lock:
                    self.cut_short.append(time.monotonic() - started)
        finally:
            conn.close()
            with self.lock:
                self.open -= 1

    @staticmethod
    def _recv(conn: socket.socket) -> bytes:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionResetError("the client went before the end of its request")
        return chunk

    def close(self) -> None:
        self.closing = True
        self.sock.close()
        with self.lock:
            for conn in self.conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


TRICKLE = b"HTTP/1.1 200 " + b"K" * 5000  # a status line that takes ten minutes at 0.1 s a byte


@pytest.fixture(scope="module")
def short(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Loopback allowed; a one-second deadline per attempt."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=1)


@pytest.fixture(scope="module")
def capped(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """Loopback allowed; a deadline longer than any test; 3 attempts per process, 2 per tenant,
    3 webhooks per tenant."""
    yield from module_stack(pg_uri, webhook_allow=LOOPBACK, webhook_attempt_seconds=600, webhook_concurrency=3,
                            webhook_tenant_concurrency=2, webhooks_per_tenant=3)


def new_world(stack: tuple[ServerThread, Client]) -> World:
    server, root = stack
    return make_world(server.endpoint, root, server.conninfo)


def first_outcome(world: World, hook: epb.Webhook) -> epb.Delivery:
    return eventually(lambda: next((d for d in deliveries(world, hook).values() if d.last_error), None))


def test_an_attempt_has_one_total_deadline(short: tuple[ServerThread, Client]) -> None:
    world = new_world(short)
    slow = Peer(TRICKLE, gap=0.1)
    try:
        hook = create_hook(world, slow.url)
        reserve(world)
        d = first_outcome(world, hook)
        assert (d.last_error, d.HasField("last_status")) == (sender.TIMED_OUT, False)
        # The control plane hung up while the receiver was still trickling, after the deadline.
        cut = eventually(lambda: slow.cut_short)
        assert cut[0] >= 0.5  # (the deadline is 1 s from before the connection)
    finally:
        slow.close()


def test_tenants_see_fixed_error_texts_never_a_receivers_bytes(short: tuple[ServerThread, Client]) -> None:
    world = new_world(short)
    banner = Peer(b"SSH-2.0-OpenSSH_9.6 secret-banner\r\n")
    status = Peer(b"HTTP/1.1 503 secret-banner\r\nServer: secret-banner\r\nContent-Length: 0\r\n\r\n")
    closed = socket.create_server(("127.0.0.1", 0))
    closed_url = f"http://127.0.0.1:{closed.getsockname()[1]}/hook"
    closed.close()  # nothing listens there now
    try:
        by_hook = {create_hook(world, url).id: expected for url, expected in (
            (banner.url, (sender.BAD_ANSWER, None)), (status.url, ("HTTP 503", 503)),
            (closed_url, (sender.CONNECT_FAILED, None)))}
        reserve(world)
        for hook_id, expected in by_hook.items():
            d = first_outcome(world, epb.Webhook(id=hook_id))
            assert (d.last_error, d.last_status if d.HasField("last_status") else None) == expected
    finally:
        banner.close()
        status.close()


def test_a_slow_receiver_does_not_delay_another_tenants_delivery(capped: tuple[ServerThread, Client]) -> None:
    a, b = new_world(capped), new_world(capped)
    slow, quick = Peer(TRICKLE, gap=0.1), Receiver()
    try:
        slow_hook = create_hook(a, slow.url)
        start = a.later()
        for _ in range(5):  # five subjects: five attempts A could run at once
            a.create(start=start)
        eventually(lambda: slow.open == 2)  # A holds its two slots; the process has one left
        create_hook(b, quick.url)
        subject = reserve(b)
        eventually(lambda: quick.of(subject))
        # B was delivered while A's attempts were still trickling, and A never had more than two.
        assert (slow.open, slow.max_open, slow.accepted) == (2, 2, 2)
        assert slow.cut_short == []
    finally:
        hooks(a.user, "Delete", epb.DeleteWebhookRequest(tenant_id=a.tenant, webhook_id=slow_hook.id))
        slow.close()
        quick.close()


def test_the_per_tenant_cap_holds_across_processes(capped: tuple[ServerThread, Client]) -> None:
    server, _ = capped
    replica = ServerThread(server.conninfo, server.settings)  # a second control plane and delivery worker
    a, b = new_world(capped), new_world(capped)
    slow, quick = Peer(TRICKLE, gap=0.1), Receiver()
    try:
        slow_hook = create_hook(a, slow.url)
        start = a.later()
        for _ in range(6):  # six attempts A could run at once: the two processes have six slots
            a.create(start=start)
        eventually(lambda: slow.open == 2)
        for _ in range(2):  # claims in both processes after A's deliveries were due
            create_hook(b, quick.url)
        subjects = [reserve(b) for _ in range(3)]
        eventually(lambda: all(quick.of(s) for s in subjects) and len(quick.of()) == 6)
        assert (slow.open, slow.max_open, slow.accepted) == (2, 2, 2)
    finally:
        hooks(a.user, "Delete", epb.DeleteWebhookRequest(tenant_id=a.tenant, webhook_id=slow_hook.id))
        slow.close()
        quick.close()
        replica.stop()


def test_concurrent_claims_count_each_others_leases(database: str) -> None:
    """Two processes claiming at once: the second waits for the first to commit, then counts its
    leases (without the claim lock it would skip the first's locked rows and take two more)."""
    from controlplane import db
    from controlplane.config import Settings
    from controlplane.runtime import Runtime

    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO tenants (id, name) VALUES ('ta', 'a')")
        conn.execute("INSERT INTO webhooks (id, tenant_id, url, secret, created_by) VALUES (%s, 'ta', %s, %s, 't')",
                     (new_id("whk"), "http://127.0.0.1:9/", SECRET))
        for i in range(4):
            conn.execute("INSERT INTO events (tenant_id, type, subject, data) VALUES ('ta', 'x.y', %s, '{}')",
                         (f"s/{i}",))
    settings = Settings(database_url=database, webhook_tenant_concurrency=2)
    params = {"limit": 10, "lease_seconds": 60, "tenant_limit": 2}
    first = psycopg.connect(database, row_factory=psycopg.rows.dict_row)
    result: list[Any] = []

    async def second_claim() -> list[Any]:
        pool = await db.open_pool(database, size=1)
        try:
            return await delivery.claim(Runtime(pool, settings), 10)
        finally:
            await pool.close()

    try:
        first.execute(queries.CLAIM_LOCK)
        assert len(first.execute(queries.CLAIM, params).fetchall()) == 2  # not committed yet
        thread = threading.Thread(target=lambda: result.append(asyncio.run(second_claim())))
        thread.start()
        with psycopg.connect(database, autocommit=True) as watcher:
            eventually(lambda: watcher.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'"
                " AND datname = current_database()").fetchall())
        first.commit()
        thread.join(30)
        assert result == [[]]
    finally:
        first.close()


def test_a_tenant_has_a_limited_number_of_webhooks(capped: tuple[ServerThread, Client]) -> None:
    world = new_world(capped)
    made = [create_hook(world, f"http://127.0.0.1:9/{i}") for i in range(3)]
    with pytest.raises(grpc.RpcError) as exc:
        create_hook(world, "http://127.0.0.1:9/3")
    code, reason, details = rpc_error(exc)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
    assert (details["resource"], details["limit"], details["used"]) == ("webhooks", "3", "3")
    hooks(world.user, "Delete", epb.DeleteWebhookRequest(tenant_id=world.tenant, webhook_id=made[0].id))
    create_hook(world, "http://127.0.0.1:9/4")
    other = new_world(capped)  # the count is per tenant
    create_hook(other, "http://127.0.0.1:9/0")


def test_an_attempt_connects_to_the_address_it_checked_not_to_a_second_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: the name answers an allowed address to the check, then an internal one.
    The attempt asks the resolver once and connects to the address it judged."""
    internal = Peer(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    port = int(internal.url.rsplit(":", 1)[1].split("/")[0])
    allowed = Peer(b"HTTP/1.1 204 No Content\r\n\r\n", host="127.0.0.2", port=port)
    answers = iter(["127.0.0.2", "127.0.0.1"])
    asked: list[str] = []
    real = socket.getaddrinfo

    def resolver(host: str, *args: Any, **kw: Any) -> Any:  # the system's resolver, faked
        if host != "rebind.test":
            return real(host, *args, **kw)
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (next(answers), port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolver)

    async def run() -> sender.Outcome:
        return await sender.post(f"http://rebind.test:{port}/hook", b"{}", {"X-BC-Event-Id": "1"}, deadline=10,
                                 allow=(ipaddress.ip_network("127.0.0.2/32"),))

    try:
        outcome = asyncio.run(run())
        assert (outcome.status, outcome.error, asked) == (204, "", ["rebind.test"])
        assert len(allowed.requests) == 1 and internal.accepted == 0
        request = allowed.requests[0].decode()
        assert request.startswith("POST /hook HTTP/1.1\r\n") and f"\r\nHost: rebind.test:{port}\r\n" in request
        assert request.endswith("\r\n\r\n{}")
    finally:
        allowed.close()
        internal.close()


def test_an_attempt_tries_the_next_checked_address_when_one_does_not_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    peer = Peer(b"HTTP/1.1 204 No Content\r\n\r\n", host="127.0.0.2")
    port = int(peer.url.rsplit(":", 1)[1].split("/")[0])

    def resolver(host: str, *args: Any, **kw: Any) -> Any:  # the system's resolver, faked
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, port))
                for a in ("127.0.0.3", "127.0.0.2")]  # nothing listens on the first

    monkeypatch.setattr(socket, "getaddrinfo", resolver)

    async def run() -> sender.Outcome:
        return await sender.post(f"http://two.test:{port}/hook", b"{}", {}, deadline=10,
                                 allow=(ipaddress.ip_network("127.0.0.0/8"),))

    try:
        assert asyncio.run(run()).status == 204 and len(peer.requests) == 1
    finally:
        peer.close()
