"""One node session's identity and its wake-up signals (coalesced: ten desired-state bumps while
a push is in flight make one more push, not ten), and the report acks waiting to be written
(bounded: a node that reads none of them would otherwise grow them without end)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from bettercompute.node.v1 import node_pb2
from controlplane.pki.enrolment import Peer

DESIRED = "desired"  # push the desired state
CHECK = "check"  # re-check: still the node's newest session, certificate still good? (its own watcher)
RENEW = "renew"  # the certificate is past half its life: hint the node to renew
CLOSED = "closed"  # the node's side of the stream ended
ACK = "ack"  # reports were dealt with: acknowledge them


@dataclass(eq=False)
class NodeSession:
    peer: Peer
    session_id: str
    _pending: set[str] = field(default_factory=set)
    _event: asyncio.Event = field(default_factory=asyncio.Event)
    arrival: object = None  # the Liveness token until the hello is taken in
    reports_ignored: int = 0
    reports_replayed: int = 0
    throttled: int = 0  # messages that waited for the node's turn (gateway.throttle)
    # In the order the reports arrived; only the session's writer sends them.
    acks: list[node_pb2.ReportAck] = field(default_factory=list)
    desired_since: float = 0.0  # time.perf_counter() of the first DESIRED not served yet
    acks_waited: int = 0  # reports that waited for the node to read its acks (see room_for_acks)
    _acks_taken: asyncio.Event = field(default_factory=asyncio.Event)
    # CHECK is not the writer's: a node that reads nothing keeps the writer waiting on the stream,
    # and the re-check (newest session? certificate good?) must not wait behind it.
    _checks: asyncio.Event = field(default_factory=asyncio.Event)
    timers: dict[str, asyncio.TimerHandle] = field(default_factory=dict)  # kind -> pending timer
    released: bool = False  # its end on the gateway's side is done (SessionRunner._release)

    @property
    def node_id(self) -> str:
        return self.peer.node_id

    def signal(self, kind: str) -> None:
        if kind == CHECK:
            self._checks.set()
            return
        if kind == DESIRED and DESIRED not in self._pending:
            self.desired_since = time.perf_counter()
        self._pending.add(kind)
        self._event.set()

    def acknowledge(self, ack: node_pb2.ReportAck) -> None:
        self.acks.append(ack)
        self.signal(ACK)

    def take_acks(self) -> list[node_pb2.ReportAck]:
        acks, self.acks = self.acks, []
        self._acks_taken.set()
        return acks

    async def room_for_acks(self, most: int) -> bool:
        """Wait while `most` acks wait to be written (the writer takes them all at once, so at
        most twice that are held); True when it waited."""
        waited = False
        while most > 0 and len(self.acks) >= most:
            waited = True
            self._acks_taken.clear()
            await self._acks_taken.wait()
        return waited

    async def next_check(self) -> None:
        await self._checks.wait()
        self._checks.clear()

    def arm(self, kind: str, delay: float) -> None:
        """Signal `kind` in `delay` seconds (replacing a timer of that kind still pending)."""
        if (timer := self.timers.pop(kind, None)) is not None:
            timer.cancel()
        self.timers[kind] = asyncio.get_running_loop().call_later(max(0.0, delay), self.signal, kind)

    def disarm(self) -> None:
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()

    async def next_signals(self) -> set[str]:
        await self._event.wait()
        self._event.clear()
        kinds, self._pending = self._pending, set()
        return kinds
