"""Node-signed reports: body = serialized `Report`, signature = Ed25519 over
b"attested-report\\x00" + body, key_id = SHA-256 (hex) of the attestation certificate's DER.

A forging node (`--forge`) replaces each bind report with a forgery the control plane must reject:
- unsigned: the genuine body with no key id and no signature;
- foreign-key: the genuine body signed by a key that is not the node's (the node's key id kept);
- other-allocation: the node's genuine signature over a report binding another allocation it holds,
  or a made-up id when it holds no other;
- other-node: the node's genuine signature over a report binding an allocation of another node.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable

from cryptography.hazmat.primitives.asymmetric import ed25519

from bettercompute.node.v1 import node_pb2 as pb
from nodesim.converge import Bound, Event, Failed, Released
from nodesim.identity import REPORT_PURPOSE, Identity, Sequence

_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


def made_up_allocation_id() -> str:
    return "alloc_" + "".join(secrets.choice(_CROCKFORD) for _ in range(26))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Reporter:
    def __init__(
        self,
        identity: Callable[[], Identity],
        sequence: Sequence,
        forge: str | None = None,
        held_here: Callable[[], Iterable[str]] = tuple,
        held_elsewhere: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self._identity = identity
        self._sequence = sequence
        self._forge = forge
        self._held_here = held_here
        self._held_elsewhere = held_elsewhere
        self._foreign_key: ed25519.Ed25519PrivateKey | None = None

    def report(self, event: Event) -> pb.AttestedReport:
        if isinstance(event, Bound):
            if self._forge is not None:
                return self._forged(event)
            return self._signed(self._bound(event.hold.allocation_id, event))
        if isinstance(event, Failed):
            failed = pb.AllocationFailed(allocation_id=event.allocation_id, reason=event.reason, message=event.message)
            return self._signed(self._envelope(failed=failed))
        assert isinstance(event, Released)
        released = pb.AllocationReleased(allocation_id=event.allocation_id, reason=event.reason)
        return self._signed(self._envelope(released=released))

    def _envelope(self, **event: object) -> pb.Report:
        return pb.Report(
            node_id=self._identity().node_id,
            sequence=self._sequence.take(),
            time=now_ms(),
            **event,  # type: ignore[arg-type]
        )

    def _bound(self, allocation_id: str, event: Bound) -> pb.Report:
        hold = event.hold
        bound = pb.AllocationBound(
            allocation_id=allocation_id,
            cdi_devices=hold.cdi_devices,
            env_file=hold.env_file,
            cgroup_parent=hold.cgroup_parent,
        )
        return self._envelope(bound=bound)

    def _signed(self, report: pb.Report) -> pb.AttestedReport:
        identity = self._identity()
        body = report.SerializeToString()
        return pb.AttestedReport(body=body, key_id=identity.key_id, signature=identity.sign(body))

    def _forged(self, event: Bound) -> pb.AttestedReport:
        own = event.hold.allocation_id
        if self._forge == "unsigned":
            return pb.AttestedReport(body=self._bound(own, event).SerializeToString())
        if self._forge == "foreign-key":
            if self._foreign_key is None:
                self._foreign_key = ed25519.Ed25519PrivateKey.generate()
            body = self._bound(own, event).SerializeToString()
            return pb.AttestedReport(
                body=body, key_id=self._identity().key_id, signature=self._foreign_key.sign(REPORT_PURPOSE + body)
            )
        pool = self._held_here() if self._forge == "other-allocation" else self._held_elsewhere()
        target = next((a for a in pool if a != own), None) or made_up_allocation_id()
        return self._signed(self._bound(target, event))
