"""Where a webhook may post: its URL's host, resolved, must give public addresses only.

Checked when the webhook is registered and again at every attempt; the attempt then connects to
the addresses checked here and never resolves the name a second time (DNS rebinding). Refused:
loopback, private, shared (CGNAT), link-local, multicast, unspecified, reserved, documentation
and benchmarking ranges, in every spelling the resolver accepts: inet_aton's integer, octal, hex
and short dotted forms (2130706433, 0x7f.1, 0177.0.0.1, 127.1) are parsed here as the C library
parses them, an IPv6 address is judged by the IPv4 address it embeds (IPv4-mapped, 6to4, NAT64),
IPv4-compatible and other non-global IPv6 is refused, a zone id (fe80::1%eth0) always, and
`localhost` names unless every address they resolve to is allowlisted. The operator allowlist
(CIDR networks) is the only way to a local address.

Names are looked up on threads of this module's own, never on the event loop's shared executor:
a name whose DNS never answers blocks its thread inside the C library until the resolver's own
timeouts (seconds to minutes), long after the caller's deadline gave up on it. A tenant has at
most LOOKUPS_PER_TENANT lookups running, abandoned ones included (another is refused as timed
out at once), so one tenant's black-hole names cannot hold every lookup thread, and none of the
process's own lookups (a database host) ever waits behind them. A few tenants together cannot
either: names with no recent answer (new or dead ones) hold at most UNPROVEN_LOOKUPS threads in
all, so a delivery to a host that resolved before (at least when its webhook was created) always
finds a thread; and a name whose lookup hung is refused at once for a while instead of taking a
thread at every attempt (docs/decisions.md).

Refusals carry one generic message: what a name resolves to, or whether it resolves at all, is
not told to the tenant (it would be an oracle for internal DNS); the reason goes to the log.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import re
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL = 2048
REFUSED = "must name a host that resolves to public addresses only"

_REFUSED_V4 = tuple((ipaddress.IPv4Network(net), why) for net, why in (
    ("0.0.0.0/8", "unspecified"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "shared address space"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "protocol assignments"),
    ("192.0.2.0/24", "documentation"),
    ("192.88.99.0/24", "6to4 relay"),
    ("192.168.0.0/16", "private"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),  # with 255.255.255.255, broadcast
))
_GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")
_REFUSED_V6 = tuple((ipaddress.IPv6Network(net), why) for net, why in (
    ("2001::/23", "protocol assignments"),  # with Teredo, 2001::/32
    ("2001:db8::/32", "documentation"),
    ("3fff::/20", "documentation"),
))
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: the last 32 bits are IPv4
LOOKUP_THREADS = 32
LOOKUPS_PER_TENANT = 4  # running at once, each until the C library answers or gives up
# Lookups of names with no answer within KNOWN_SECONDS (new names, dead ones) share at most this
# many threads, all tenants together: the others are kept for names known to resolve.
UNPROVEN_LOOKUPS = LOOKUP_THREADS // 2
KNOWN_SECONDS = 3600.0
KNOWN_NAMES = 4096  # the names known to resolve that are remembered (least recently answered leave first)
# A name whose lookup outlived its caller's deadline, or failed after SLOW_SECONDS, is refused at
# once (no thread) while that lookup runs and for STUCK_SECONDS after it ends.
STUCK_SECONDS = 60.0
SLOW_SECONDS = 1.0

_INET_ATON = re.compile(r"^[0-9][0-9a-fx.]*$")
_INET_ATON_PART = re.compile(r"^(?:0x([0-9a-f]+)|0([0-7]+)|([1-9][0-9]*|0))$")


class Refused(Exception):
    """The target is not allowed; the message is for the log, never for the tenant."""


@dataclass(frozen=True)
class Url:
    scheme: str  # http or https
    host: str  # the hostname, lower case, without brackets: for SNI and certificate checks
    port: int
    request_target: str  # path and query
    host_header: str


@dataclass(frozen=True)
class Target:
    url: Url
    addresses: tuple[str, ...]  # the checked addresses to connect to, in the resolver's order


def parse(url: str) -> Url:
    """The parts of a webhook URL; ValueError with a message for the tenant when it is not one."""
    if len(url) > MAX_URL or not url.isascii() or any(c <= " " or c in "\\\x7f" for c in url):
        raise ValueError(f"must be an ASCII URL of at most {MAX_URL} characters without spaces or control"
                         " characters (write international names in punycode)")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError("not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    if "@" in parts.netloc:
        raise ValueError("must not carry user information")
    if "%" in parts.hostname:
        raise ValueError("must not carry an IPv6 zone id")
    if port == 0:
        raise ValueError("must have a port from 1 to 65535")
    host = parts.hostname
    default = 443 if parts.scheme == "https" else 80
    shown = f"[{host}]" if ":" in host else host
    return Url(
        scheme=parts.scheme, host=host, port=port or default,
        request_target=urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
        host_header=shown if port is None else f"{shown}:{port}",
    )


def inet_aton(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address the C library's inet_aton (and so getaddrinfo) reads in `host`: one to
    four parts, each decimal, octal (leading 0) or hex (0x), the last filling the remaining bytes."""
    if not _INET_ATON.match(host):
        return None
    parts = host.split(".")
    if len(parts) > 4:
        return None
    values = []
    for part in parts:
        match = _INET_ATON_PART.match(part)  # not an empty part: "127..1", a trailing dot
        if match is None:
            return None
        hexa, octal, decimal = match.groups()
        values.append(int(hexa, 16) if hexa else int(octal, 8) if octal else int(decimal))
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    value = last
    for i, v in enumerate(head):
        value |= v << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def literal(host: str) -> Address | None:
    """The address `host` spells, if it is an address."""
    if ":" in host:
        return ipaddress.IPv6Address(host)
    return inet_aton(host)


def is_localhost_name(host: str) -> bool:
    name = host.rstrip(".")
    return name == "localhost" or name.endswith(".localhost") or name == "localhost.localdomain"


def refusal(address: Address) -> str | None:
    """Why `address` is not public, or None when it is."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            return "zone id"
        if address.ipv4_mapped is not None:
            return refusal(address.ipv4_mapped)
        if address in _NAT64:
            return refusal(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        if address.sixtofour is not None:
            return refusal(address.sixtofour)
        if address not in _GLOBAL_UNICAST_V6:
            return "not global unicast"  # loopback, unspecified, IPv4-compatible, ULA, link-local, multicast
        return next((why for net, why in _REFUSED_V6 if address in net), None)
    return next((why for net, why in _REFUSED_V4 if address in net), None)


def judge(host: str, addresses: Iterable[Address], allow: Sequence[Network]) -> tuple[str, ...]:
    """The addresses to connect to when every one of `addresses` may be reached; Refused otherwise."""
    chosen: list[Address] = []
    for address in addresses:
        if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
            raise Refused(f"{host}: {address} has a zone id")
        effective = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped \
            else address
        if any(effective in net for net in allow):
            chosen.append(effective)
            continue
        why = "from a localhost name" if is_localhost_name(host) else refusal(effective)
        if why is not None:
            raise Refused(f"{host}: {address} ({why})")
        chosen.append(effective)
    if not chosen:
        raise Refused(f"{host}: no address")
    return tuple(dict.fromkeys(str(a) for a in chosen))


class _Lookups:
    """getaddrinfo on threads of its own: lookups still running counted per tenant and, for names
    not known to resolve, in total; names whose lookup hung refused at once for a while."""

    def __init__(self) -> None:
        self.threads = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="webhook-dns")
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.unproven = 0  # running lookups of names not known to resolve
        self.known: OrderedDict[str, float] = OrderedDict()  # name: its last answer (monotonic)
        self.stuck: dict[str, float] = {}  # name: refused until (inf while its hung lookup runs)

    async def getaddrinfo(self, key: str, host: str, port: int) -> list[Any]:
        """What the system resolver answers; TimeoutError at once, without a thread, when `key`
        (a tenant) already has LOOKUPS_PER_TENANT lookups running, when `host` is not known to
        resolve and UNPROVEN_LOOKUPS such lookups run, or when `host` hung within STUCK_SECONDS."""
        name = host.lower().rstrip(".")
        started = time.monotonic()
        with self.lock:
            until = self.stuck.get(name)
            if until is not None and until > started:
                raise TimeoutError(f"{host}: its last lookup hung (refused for {STUCK_SECONDS:g} s after it ended)")
            self.stuck.pop(name, None)
            if self.running.get(key, 0) >= LOOKUPS_PER_TENANT:
                raise TimeoutError(f"{host}: {LOOKUPS_PER_TENANT} lookups of this tenant still running")
            seen = self.known.get(name)
            proven = seen is not None and started - seen < KNOWN_SECONDS
            if not proven and self.unproven >= UNPROVEN_LOOKUPS:
                raise TimeoutError(f"{host}: {UNPROVEN_LOOKUPS} lookups of names not known to resolve still running")
            self.running[key] = self.running.get(key, 0) + 1
            self.unproven += not proven
        try:
            future = self.threads.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM,
                                         proto=socket.IPPROTO_TCP)
        except BaseException:
            self._release(key, proven)
            raise
        # When the thread returns (or the lookup is dropped before it started), not when the
        # caller stops waiting: a cancelled wait leaves a running lookup running.
        future.add_done_callback(lambda done: self._finished(key, name, proven, started, done))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the caller's deadline: the name is refused while it hangs
            with self.lock:
                if not future.done():
                    self.stuck[name] = math.inf
            raise

    def _release(self, key: str, proven: bool) -> None:
        with self.lock:
            left = self.running[key] - 1
            if left:
                self.running[key] = left
            else:
                del self.running[key]
            self.unproven -= not proven

    def _finished(self, key: str, name: str, proven: bool, started: float, done: Future[Any]) -> None:
        self._release(key, proven)
        now = time.monotonic()
        with self.lock:
            if done.cancelled():  # dropped before it started (its caller gave up): nothing learnt
                if self.stuck.get(name) == math.inf:
                    del self.stuck[name]
                return
            if done.exception() is None:
                self.stuck.pop(name, None)
                self.known[name] = now
                self.known.move_to_end(name)
                while len(self.known) > KNOWN_NAMES:
                    self.known.popitem(last=False)
            elif name in self.stuck or now - started >= SLOW_SECONDS:  # hung, or failed slowly
                self.stuck[name] = now + STUCK_SECONDS
                self.known.pop(name, None)


LOOKUPS = _Lookups()


async def resolve(url: Url, allow: Sequence[Network], key: str = "") -> Target:
    """The checked address of `url`'s host (its literal, or what getaddrinfo gives); Refused when
    any address is not allowed or the name does not resolve. The caller bounds the time; `key`
    (the tenant) counts the lookups still running (see LOOKUPS_PER_TENANT)."""
    try:
        address = literal(url.host)
    except ValueError:
        raise Refused(f"{url.host}: not an address") from None
    if address is not None:
        return Target(url, judge(url.host, [address], allow))
    if is_localhost_name(url.host) and not allow:
        raise Refused(f"{url.host}: a localhost name")  # without asking a resolver
    try:
        infos = await LOOKUPS.getaddrinfo(key, url.host, url.port)
    except TimeoutError:
        raise  # the tenant's earlier lookups still run (an OSError, but not an answer)
    except (OSError, UnicodeError) as exc:
        raise Refused(f"{url.host}: {exc}") from None
    found = dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos
                          if info[0] in (socket.AF_INET, socket.AF_INET6))
    return Target(url, judge(url.host, found, allow))
