"""The machine's disk under a whole-machine lease (BINDING_NODE): the FakeDaemon simulates metal's
reimage when a deploy arrives, and the wipe once the lease's assignment leaves the desired state.

What is on the disk is reported in the node's inventory (`Inventory.deployed`): `deploying`, then
`deployed` (with the checksum of what was written) or `failed`; after the lease `wiping`, then
`wiped`. The control plane verifies the deploy; the node never decides that a lease is bound.

On disk, under the node's root (kept across a restart, which resumes an unfinished reimage or wipe):
- `var/lib/bcd/metal/deployed.json`: the DeployedProfile fields;
- `var/lib/bcd/metal/root.img`: the simulated root file system (the image and checksum written).

Faults: `--reimage-fail-rate` fails that share of deploys (deterministic per allocation);
`--metal-lie unasked` reports another profile than the one asked for, `bad-checksum` the asked
profile with a checksum that is not the image's (a hostile node).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from bettercompute.node.v1 import node_pb2 as pb
from nodesim.config import Faults
from nodesim.files import remove, write_atomic
from nodesim.inventory import Hardware

STATE_FILE = Path("var/lib/bcd/metal/deployed.json")
IMAGE_FILE = Path("var/lib/bcd/metal/root.img")
LIES = ("unasked", "bad-checksum")
ROGUE_PROFILE = "rogue"
# What the control plane takes from an operator (controlplane.metal.profiles): one line each.
IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=%~?&#-]{0,511}$")
CHECKSUM = re.compile(r"^sha256:[0-9a-f]{64}$")


class Metal:
    def __init__(self, root: Path, hardware: Hardware, faults: Faults, name: str, *,
                 reimage_seconds: float, wipe_seconds: float, changed: Callable[[], None]) -> None:
        self.state_path, self.image_path = root / STATE_FILE, root / IMAGE_FILE
        self.hardware, self.faults, self.name = hardware, faults, name
        self.reimage_seconds, self.wipe_seconds = reimage_seconds, wipe_seconds
        self.changed = changed
        self.generation = hardware.inventory.generation
        self.record: dict[str, Any] | None = self._load()
        self._task: asyncio.Task[None] | None = None
        self.log = structlog.get_logger("nodesim.metal").bind(node=name)

    def _load(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None

    def inventory(self) -> pb.Inventory:
        """The hardware's inventory with what is on the disk, under the current generation."""
        out = pb.Inventory()
        out.CopyFrom(self.hardware.inventory)
        out.generation = self.generation
        if self.record is not None:
            out.deployed.CopyFrom(pb.DeployedProfile(**self.record))
        return out

    # -- the desired state -------------------------------------------------------------------

    def apply(self, assignments: list[pb.DeviceAssignment]) -> None:
        """The node's BINDING_NODE assignments (one machine: at most one lease at a time)."""
        wanted = next((a for a in assignments if a.deploy.profile_id), None)
        record = self.record
        running = self._task is not None and not self._task.done()
        if wanted is not None:
            if record is not None and record.get("allocation_id") == wanted.allocation_id:
                if record.get("state") == "deploying" and not running:  # restarted mid-reimage
                    self._start(self._reimage(wanted))
                return
            self._start(self._reimage(wanted))
        elif record is not None and record.get("state") != "wiped":
            if record.get("state") == "wiping" and running:
                return
            self._start(self._wipe())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _start(self, work: Any) -> None:
        self.stop()
        self._task = asyncio.get_running_loop().create_task(work, name=f"{self.name}-metal")

    # -- reimage and wipe --------------------------------------------------------------------

    async def _reimage(self, a: pb.DeviceAssignment) -> None:
        d = a.deploy
        self.log.info("reimage started", allocation=a.allocation_id, profile=d.profile_id, version=d.version)
        self._set(allocation_id=a.allocation_id, profile_id=d.profile_id, version=d.version, image=d.image,
                  checksum="", state="deploying", message="")
        await asyncio.sleep(self.reimage_seconds)
        problem = _check_deploy(d)
        if problem is not None:
            self.log.info("reimage refused", allocation=a.allocation_id, message=problem)
            self._set(**{**(self.record or {}), "state": "failed", "message": problem})
            return
        if self._fails(a.allocation_id):
            self.log.info("reimage failed (fault injection)", allocation=a.allocation_id)
            self._set(**{**(self.record or {}), "state": "failed", "message": "injected fault: reimage failed"})
            return
        profile_id, version, checksum = d.profile_id, d.version, d.checksum
        if self.faults.metal_lie == "unasked":
            profile_id = ROGUE_PROFILE
        elif self.faults.metal_lie == "bad-checksum":
            checksum = "sha256:" + hashlib.sha256(b"tampered " + d.image.encode()).hexdigest()
        write_atomic(self.image_path, f"image {d.image}\nchecksum {checksum}\nallocation {a.allocation_id}\n")
        self._set(allocation_id=a.allocation_id, profile_id=profile_id, version=version, image=d.image,
                  checksum=checksum, state="deployed", message="")
        self.log.info("reimage done", allocation=a.allocation_id, profile=profile_id, version=version)

    async def _wipe(self) -> None:
        allocation = (self.record or {}).get("allocation_id", "")
        self._set(**{**(self.record or {}), "state": "wiping"})
        await asyncio.sleep(self.wipe_seconds)
        remove(self.image_path)
        self._set(allocation_id=allocation, profile_id="", version=0, image="", checksum="", state="wiped", message="")
        self.log.info("machine wiped", allocation=allocation)

    def _set(self, **record: Any) -> None:
        self.record = record
        write_atomic(self.state_path, json.dumps(record, sort_keys=True))
        self.generation += 1
        with contextlib.suppress(Exception):
            self.changed()

    def _fails(self, allocation_id: str) -> bool:
        rate = self.faults.reimage_fail
        if rate <= 0:
            return False
        digest = hashlib.sha256(f"{self.name}/reimage/{allocation_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < rate


def _check_deploy(d: pb.Deploy) -> str | None:
    """Why a deploy cannot be written onto the disk, or None."""
    if not IMAGE.fullmatch(d.image):
        return "invalid deploy: the image is not an OCI reference or URL"
    if not CHECKSUM.fullmatch(d.checksum):
        return "invalid deploy: the checksum is not sha256:<64 hex>"
    return None
