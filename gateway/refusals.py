"""Client certificates the gateway refused lately, refused again from memory.

Who a TLS peer is costs a database read (controlplane.pki.enrolment.identify), and a session that
opens holds the unreachable sweep until that read is done; a node whose certificate was revoked,
or a copy of its keys, could reconnect in a loop, each attempt a read taken from the gateway's
small pool, unpaced (the per-node throttle needs the node id the read gives). A certificate once
refused as unknown, revoked or expired never becomes good again (revocations are never lifted, a
certificate's validity never moves, a certificate is recorded before it is handed out), so the
refusal is kept, keyed by the certificate's bytes, and answered again without a read and without
holding the sweep. A readmitted node enrols again and gets new certificates, which nothing here
knows: it serves at once.

Bounded: at most `size` certificates (the oldest refusal goes first), each kept `seconds`.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

from controlplane import errors


class Refusals:
    def __init__(self, size: int, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.seconds, self._clock = size, seconds, clock
        self._kept: OrderedDict[bytes, tuple[float, errors.DomainError]] = OrderedDict()

    @staticmethod
    def _key(cert_pem: bytes | None) -> bytes | None:
        return hashlib.sha256(cert_pem).digest() if cert_pem else None

    def refused(self, cert_pem: bytes | None) -> errors.DomainError | None:
        """The error this certificate was refused with, while it is kept."""
        key = self._key(cert_pem)
        if key is None or (kept := self._kept.get(key)) is None:
            return None
        until, error = kept
        if self._clock() >= until:
            del self._kept[key]
            return None
        return error

    def remember(self, cert_pem: bytes | None, error: errors.DomainError) -> None:
        key = self._key(cert_pem)
        if key is None or self.size <= 0 or self.seconds <= 0:
            return
        self._kept.pop(key, None)
        self._kept[key] = (self._clock() + self.seconds, error)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)
