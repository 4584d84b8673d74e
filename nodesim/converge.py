"""Convergence: from the gateway's desired state to holds on disk, and the events to report.

The node never drops a hold on its own (the CDI spec is the hold itself): a hold ends only when
its assignment leaves the desired state, never because the node's clock passed its `until` (the
control plane ends the reservation and takes the assignment out). A new assignment is admitted against the node's devices and memory
(beside its other holds) before anything is written.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import structlog

from bettercompute.node.v1 import node_pb2 as pb
from nodesim.artefacts import GIB, Hold, Limits, Sandbox, check_cpuset, check_limits, check_names
from nodesim.config import REPORT_MAX_CHARS, Faults
from nodesim.inventory import Hardware

REASON_EXHAUSTED = "resources-exhausted"
REASON_MISSING = "device-missing"
REASON_INVALID = "invalid-assignment"
RELEASE_UNASSIGNED = "unassigned"


@dataclass(frozen=True)
class Bound:
    hold: Hold


@dataclass(frozen=True)
class Failed:
    allocation_id: str
    reason: str
    message: str


@dataclass(frozen=True)
class Released:
    allocation_id: str
    reason: str


Event = Bound | Failed | Released


def _conflicts(a: str, b: str) -> bool:
    """Device ids clash when equal, or when one is a whole GPU and the other that GPU or a part of
    it (slots of one GPU are shared by design; MIG instances are distinct ids)."""
    if a == b:
        return True
    ga, _, pa = a.partition(":")
    gb, _, pb_ = b.partition(":")
    return ga == gb and (not pa or not pb_)


def shown(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and "…[<length> chars]": a hostile gateway's string
    repeated whole made a report too big to send."""
    return text if len(text) <= limit else f"{text[:limit]}…[{len(text)} chars]"


def _canonical(part: str) -> bool:
    """An instance or slot number as the node names it: "1", never "01" (another id, the same one).
    No node has 10**18 of them (and int() refuses over 4300 digits)."""
    return part.isdigit() and len(part) <= 18 and part == str(int(part))


class Converger:
    def __init__(self, sandbox: Sandbox, hardware: Hardware, faults: Faults, node_name: str,
                 text_chars: int = REPORT_MAX_CHARS) -> None:
        self.sandbox = sandbox
        self.hardware = hardware
        self.faults = faults
        self.node_name = node_name
        self.text_chars = text_chars
        # An older daemon (no capabilities) drops limits and BINDING_KUBERNETES: plain holds.
        self.legacy = faults.no_capabilities
        self.holds: dict[str, Hold] = {}
        # allocation id -> the assignment bytes that failed; not retried until the assignment changes.
        self._failed: dict[str, bytes] = {}
        self.log = structlog.get_logger("nodesim.converge").bind(node=node_name)

    # -- inputs ------------------------------------------------------------------------------

    def recover(self) -> None:
        """Adopt the holds on disk, whatever their `until`: the next desired state decides."""
        for hold in self.sandbox.recover():
            self.holds[hold.allocation_id] = hold
        if self.holds:
            self.log.info("recovered holds", count=len(self.holds))

    def apply(self, desired: pb.DesiredState, now_ms: int) -> list[Event]:
        events: list[Event] = []
        # A whole-machine lease (BINDING_NODE) is no hold: nodesim.metal deploys it.
        holds = [a for a in desired.assignments if a.binding != pb.BINDING_NODE]
        wanted = {a.allocation_id: a for a in holds}
        for alloc in [a for a in self.holds if a not in wanted]:
            events.append(self._release(alloc, RELEASE_UNASSIGNED))
        self._failed = {k: v for k, v in self._failed.items() if k in wanted}
        # Assignments of one allocation id would write the same files: none of them is bound.
        repeated = {k for k, n in Counter(a.allocation_id for a in holds).items() if n > 1}
        for alloc in repeated:
            fingerprint = b"".join(a.SerializeToString(deterministic=True) for a in holds if a.allocation_id == alloc)
            if self._failed.get(alloc) != fingerprint:
                self._failed[alloc] = fingerprint
                events.append(self._failure(alloc, REASON_INVALID, "allocation id repeated in the desired state"))
        for assignment in holds:
            if assignment.allocation_id in repeated:
                continue
            event = self._converge_one(assignment, now_ms)
            if event is not None:
                events.append(event)
        return events

    # -- one assignment ----------------------------------------------------------------------

    def _normalise(self, a: pb.DeviceAssignment) -> Hold:
        limits = None if self.legacy or not a.HasField("limits") else Limits.from_proto(a.limits)
        return Hold(
            allocation_id=a.allocation_id,
            device_class=a.device_class or "gpu",
            device_ids=tuple(a.device_ids),
            until=a.until,
            kubernetes=a.binding == pb.BINDING_KUBERNETES and not self.legacy,
            limits=limits,
        )

    def _converge_one(self, a: pb.DeviceAssignment, now_ms: int) -> Event | None:
        fingerprint = a.SerializeToString(deterministic=True)
        if self._failed.get(a.allocation_id) == fingerprint:
            return None
        hold = self._normalise(a)
        held = self.holds.get(a.allocation_id)
        if held == hold:
            return None
        if hold.until <= now_ms:
            self.log.debug("assignment already past its end; not bound", allocation=a.allocation_id)
            return None
        inv = self.hardware.inventory
        problem = (check_names(a.allocation_id, hold.device_class, list(a.device_ids)) or check_limits(hold.limits)
                   or check_cpuset(hold.limits, inv.vcpus, len(inv.numa_nodes)))
        reason = REASON_INVALID
        if problem is None:
            reason, problem = self._admit(hold)
        if problem is not None:
            self._failed[a.allocation_id] = fingerprint
            return self._failure(a.allocation_id, reason, problem)
        self.sandbox.write(hold, self.hardware.gpu_index)
        self.holds[hold.allocation_id] = hold
        self.log.debug("bound", allocation=hold.allocation_id, devices=list(hold.device_ids))
        return Bound(hold)

    def _failure(self, allocation_id: str, reason: str, message: str) -> Failed:
        """A failed assignment, and the end of what an earlier version of it holds: the workload
        must not keep devices (or a slice) the desired state no longer gives it."""
        if allocation_id in self.holds:
            self.sandbox.remove(allocation_id)
            del self.holds[allocation_id]
            self.log.info("hold removed: its new assignment failed", allocation=allocation_id)
        failed = Failed(shown(allocation_id, self.text_chars), reason, shown(message, self.text_chars))
        self.log.info("bind failed", allocation=failed.allocation_id, reason=reason, message=failed.message)
        return failed

    def _admit(self, hold: Hold) -> tuple[str, str | None]:
        missing = self._missing_devices(hold)
        if missing:
            return REASON_MISSING, missing
        if self._fault_fails(hold.allocation_id):
            return REASON_EXHAUSTED, "injected fault: bind refused"
        others = [h for h in self.holds.values() if h.allocation_id != hold.allocation_id]
        for other in others:
            for mine in hold.device_ids:
                clash = next((d for d in other.device_ids if _conflicts(mine, d)), None)
                if clash is not None:
                    return REASON_EXHAUSTED, f"device {mine} is held by {other.allocation_id} ({clash})"
        limits = [h.limits for h in [*others, hold] if h.limits is not None]
        inv = self.hardware.inventory
        hugepages = sum(lim.hugepages_1gi for lim in limits)
        if hugepages > inv.hugepages_1gi:
            return REASON_EXHAUSTED, f"1 GiB huge pages: {hugepages} asked of {inv.hugepages_1gi}"
        memory = sum(lim.memory_bytes + lim.hugepages_1gi * GIB for lim in limits)
        if memory > inv.memory_bytes:
            return REASON_EXHAUSTED, f"memory: {memory} bytes asked of {inv.memory_bytes}"
        return "", None

    def _missing_devices(self, hold: Hold) -> str | None:
        gpus = self.hardware.gpu_index
        mig = self.hardware.mig_instances
        for device in hold.device_ids:
            uuid, sep, part = device.partition(":")
            if uuid not in gpus:
                return f"no GPU {uuid}"
            if hold.device_class == "gpu" and (sep or uuid in mig):
                return f"{device} is not a whole GPU on this node"
            if hold.device_class == "gpu.mig" and (not _canonical(part) or int(part) not in mig.get(uuid, ())):
                return f"no MIG instance {device}"
            if hold.device_class == "gpu.slot" and (not _canonical(part) or uuid in mig):
                return f"no slot {device}"
        return None

    def _fault_fails(self, allocation_id: str) -> bool:
        if allocation_id in self.faults.fail_allocations:
            return True
        if self.faults.fail_binds <= 0:
            return False
        # Deterministic per allocation, so a repeated desired state gets the same answer.
        digest = hashlib.sha256(f"{self.node_name}/{allocation_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.faults.fail_binds

    def _release(self, allocation_id: str, reason: str) -> Released:
        self.sandbox.remove(allocation_id)
        del self.holds[allocation_id]
        self.log.debug("released", allocation=allocation_id, reason=reason)
        return Released(allocation_id, reason)
