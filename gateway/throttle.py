"""How fast one node's messages are taken in: a token bucket per node.

A node's hellos, inventories and reports each cost the gateway a database transaction (a report
that names one of the node's allocations also a row and a reservation wake-up), so a node that
floods them, compromised or broken, would cost everyone else's sessions. Each node gets `rate`
such messages a second, up to `burst` at once; past that its session's reader waits before taking
the next message in, so HTTP/2 flow control slows the node down and nothing it sent is lost
(a node keeps a report until its ack). Heartbeats are not counted while they cost no transaction;
one whose applied generation differs from the last one written writes a row, and is counted.
Certificate renewals (a signature and rows each) have a bucket of their own per node and do not
queue: a renewal that would wait is refused with QUOTA_EXCEEDED, reason `rate-limited`, and
retryAfterSeconds (a node renews a few times a day, and on a hint after a role change).
The bucket is the node's, not the session's, so reconnecting does not refill it. Opening a
session takes a token too, before the node's certificate is read (the node named by the
certificate TLS verified), and an open that would wait more than gateway.servicer's
OPEN_WAIT_SECONDS is refused like a renewal rather than queued. Enrolment has no certificate to
name a node by: a refused enrolment (a wrong, spent or expired join token, a bad CSR) costs its
peer address a token afterwards, and an address with none left is refused before its CSR is parsed
or anything read, so guessing join tokens, or a broken daemon retrying in a loop, is paced;
enrolments that succeed cost nothing (a fleet behind one NAT address enrols at its own pace).

A hello or an inventory holds the node's pool lock while it rewrites the node's atoms (every
placement in the pool waits), and what that costs grows with what the node claims: 16,640 MIG
instances or slots rewritten took about 2 s (tests/test_hostile_round25a.py). So beyond its token,
such a message is charged for the time it held the lock (`charge`; its wait for the lock is not
counted, so a fleet's hellos queued behind each other cost each node only its own work): the node
then waits (1 / WORK_SHARE - 1) times as long, so it holds its pool at most about WORK_SHARE of the
time, whatever it claims; a message that holds it a few milliseconds costs a few tokens of the burst.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# The share of the time a node's hellos and inventories may keep the database busy (`charge`).
WORK_SHARE = 0.1


class TokenBucket:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, max(1, burst), clock
        self.tokens = float(self.burst)
        self.stamp = clock()

    def take(self, most: float | None = None) -> float:
        """Take one token: how long to wait before the message it pays for (0: at once). Waiting
        callers queue: each one's wait covers the tokens taken before it. With `most`, a wait
        longer than that takes nothing and is returned negated (refused)."""
        if self.rate <= 0:  # off
            return 0.0
        wait = self.due()
        if most is not None and wait > most:
            return -wait
        self.tokens -= 1
        return wait

    def due(self) -> float:
        """How long until a token is there (0: one is), taking nothing."""
        if self.rate <= 0:
            return 0.0
        self._refill()
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    def full(self) -> bool:
        self._refill()
        return self.tokens >= self.burst

    def charge(self, tokens: float) -> None:
        """Take `tokens` more, whatever is left (the bucket may go below zero: the next take waits
        until it is refilled past one)."""
        if self.rate <= 0:
            return
        self._refill()
        self.tokens -= tokens

    def _refill(self) -> None:
        """The tokens earned since the last take or charge, never past the burst."""
        now = self._clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now


class Throttle:
    """One bucket per key (a node id; for enrolments a peer address), made on first use. With
    `keep`, at most that many buckets: past it the full ones go (a full bucket is what a new one
    would be), then the oldest."""

    def __init__(self, rate: float, burst: int, keep: int = 0) -> None:
        self.rate, self.burst, self.keep = rate, burst, keep
        self._buckets: dict[str, TokenBucket] = {}

    def wait(self, node_id: str, most: float | None = None) -> float:
        """The node's wait for its next message (TokenBucket.take)."""
        return self._bucket(node_id).take(most)

    def charge(self, node_id: str, busy_seconds: float) -> None:
        """A message of the node held its pool's lock `busy_seconds`: its next messages wait
        (1 / WORK_SHARE - 1) times as long, less what the message's own token paid for (so an
        ordinary message costs its one token, as before)."""
        beyond = busy_seconds * (1 / WORK_SHARE - 1) * self.rate - 1
        if beyond > 0:
            self._bucket(node_id).charge(beyond)

    def due(self, key: str) -> float:
        """How long until the key's next token is there (0: it is), taking nothing."""
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else bucket.due()

    def debit(self, key: str) -> None:
        """One token taken after the fact (a refused enrolment: gateway.servicer)."""
        self._bucket(key).charge(1)

    def _bucket(self, node_id: str) -> TokenBucket:
        bucket = self._buckets.get(node_id)
        if bucket is None:
            if self.keep and len(self._buckets) >= self.keep:
                self._prune()
            bucket = self._buckets[node_id] = TokenBucket(self.rate, self.burst)
        return bucket

    def _prune(self) -> None:
        for key in [k for k, b in self._buckets.items() if b.full()]:
            del self._buckets[key]
        while len(self._buckets) >= self.keep:
            del self._buckets[next(iter(self._buckets))]
