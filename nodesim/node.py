"""One simulated node: enrolment, the mutual-TLS session, heartbeats, convergence, reports, renewal.

Tasks per node: `run` (connect loop), and while connected a reader and a writer.
All writes to the stream go through the writer, in order: Hello, then reports left from a broken
session (oldest first), then a re-report of every hold, then whatever happens next.

A report is left from a session until the gateway acknowledges it (ReportAck): one written to a
stream that broke before the ack came may never have been stored, so it is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import grpc
import structlog

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc
from nodesim import DAEMON_VERSION, LEGACY_DAEMON_VERSION
from nodesim.artefacts import Sandbox
from nodesim.beats import Beats
from nodesim.config import Faults, FleetConfig
from nodesim.converge import Bound, Converger, Event
from nodesim.deviceplugin import DevicePlugins
from nodesim.identity import Identity, IdentityError, IdentityStore, KeyPair, Sequence
from nodesim.inventory import Hardware, build
from nodesim.metal import Metal
from nodesim.reports import Reporter, now_ms

CAPABILITIES = ("devices.limits", "binding.kubernetes", "binding.node")
RPC_TIMEOUT = 30.0
# A join token the operator re-provisioned to the machine (after a whole-machine lease's wipe every
# certificate of the node is revoked: the tenant had root on it). Read from the node's root.
REPROVISIONED_TOKEN = "join-token"
# Renewal happens between 50% and 60% of a certificate's life, spread over the fleet.
RENEW_JITTER = 0.1
RENEW_RETRY = 30.0

_HEARTBEAT = object()  # outbox marker: send a heartbeat now
_WAKE = object()  # outbox marker: look at renewal now
_INVENTORY = object()  # outbox marker: send the inventory (what is on the disk changed)


class NodeError(Exception):
    """A node cannot go on without outside help (no identity and no join token)."""


@dataclass
class Shared:
    """What the fleet gives every node."""

    config: FleetConfig
    enrol: node_pb2_grpc.NodeGatewayStub
    enrol_slots: asyncio.Semaphore
    # Allocation ids held by the fleet's other nodes (for --forge other-node).
    held_elsewhere: Callable[[str], Iterable[str]] = field(default=lambda name: ())


class Backoff:
    def __init__(self, base: float = 0.5, cap: float = 30.0) -> None:
        self.base, self.cap, self.attempt = base, cap, 0

    def next(self) -> float:
        ceiling = min(self.cap, self.base * 2**self.attempt)
        self.attempt += 1
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.attempt = 0


class SimNode:
    def __init__(self, name: str, position: int, shared: Shared, faults: Faults | None = None) -> None:
        config = shared.config
        self.name = name
        self.shared = shared
        self.config = config
        self.faults = faults if faults is not None else config.faults.for_node(name)
        self.root = config.sandbox / name
        self.hardware: Hardware = build(config.inventory, name, position)
        self.store = IdentityStore(self.root)
        self.sandbox = Sandbox(self.root)
        self.converger = Converger(self.sandbox, self.hardware, self.faults, name, config.report_max_chars)
        self.plugin = DevicePlugins(self.root, lambda: self.converger.holds.values(), name, config.kubelet_retry)
        self.metal = Metal(self.root, self.hardware, self.faults, name, reimage_seconds=config.reimage_seconds,
                           wipe_seconds=config.wipe_seconds, changed=self._inventory_changed)
        self.identity: Identity | None = None
        self.reporter = Reporter(
            self._current_identity,
            Sequence(self.store),
            forge=self.faults.forge,
            held_here=lambda: list(self.converger.holds),
            held_elsewhere=lambda: shared.held_elsewhere(name),
        )
        self.applied_generation = 0
        self.connected = False
        self.sessions = 0
        self.state = "starting"
        self.log = structlog.get_logger("nodesim.node").bind(node=name)
        self._renew_jitter = random.Random(name).uniform(0, RENEW_JITTER)
        self._renew_requested = False
        self._renew_not_before = 0.0
        self._outbox: asyncio.Queue[object] | None = None
        # Reports built while no session was up, or sent and never acknowledged: (is a bind
        # report, report), oldest first.
        self._pending: list[tuple[bool, pb.AttestedReport]] = []
        # Reports written to the current session, by sequence, until the gateway acknowledges them.
        self._unacked: dict[int, tuple[bool, pb.AttestedReport]] = {}
        # Bind reports of this process's desired states, by sequence: (allocation id, when the
        # desired state arrived, when the report was queued), until written (logged: "bind sent").
        self._timing: dict[int, tuple[str, float, float]] = {}
        self._channel: grpc.aio.Channel | None = None
        self._channel_key_id = ""
        self._failures_logged = False
        self._connecting: asyncio.Task[None] | None = None
        self._revoked = False  # the gateway said the certificate was revoked
        self._enrolling: tuple[str, KeyPair] | None = None  # a token and the keys sent with it, unanswered

    @property
    def node_id(self) -> str:
        return self.identity.node_id if self.identity else ""

    def _current_identity(self) -> Identity:
        assert self.identity is not None, "reports need an identity"
        return self.identity

    # -- the node's life ---------------------------------------------------------------------

    async def run(self) -> None:
        self.identity = self.store.load()
        self.converger.recover()
        plugin = None
        if self.config.kubelet_retry:
            plugin = asyncio.create_task(self.plugin.run(), name=f"{self.name}-plugin")
        try:
            if self.faults.unreachable_after is None and not self.faults.unreachable_on_signal:
                await self._connect_loop()
                return
            # Until the time passes or go_unreachable() cancels it, whichever comes first.
            self._connecting = asyncio.create_task(self._connect_loop(), name=f"{self.name}-connect")
            try:
                await asyncio.wait({self._connecting}, timeout=self.faults.unreachable_after)
            finally:
                self._connecting.cancel()
                await asyncio.gather(self._connecting, return_exceptions=True)
            self.connected = False
            self.state = "unreachable"
            self.log.info("unreachable (fault injection): no more sessions or heartbeats")
            await self._close_channel()
            await asyncio.Event().wait()  # the process stays, and so do its holds
        finally:
            self.connected = False
            self.metal.stop()
            if plugin is not None:
                plugin.cancel()
                await asyncio.gather(plugin, return_exceptions=True)
            await self._close_channel()

    def go_unreachable(self) -> None:
        """The --unreachable-on-signal fault, now."""
        if self.faults.unreachable_on_signal and self._connecting is not None:
            self._connecting.cancel()

    async def _connect_loop(self) -> None:
        backoff = Backoff()
        while True:
            sessions_before = self.sessions
            try:
                identity = await self._ensure_identity()
                if await self._session(identity):
                    continue  # renewed: reconnect at once with the new certificate
                self._log_failure("session ended by the gateway")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in (exc.details() or ""):
                    self._revoked = True  # enrol again, with a token re-provisioned to the machine
                self._log_failure("gateway call failed", code=exc.code().name, details=exc.details())
            except (IdentityError, NodeError) as exc:
                self._log_failure("no usable identity", error=str(exc))
            except Exception as exc:  # one node's surprise must not end the fleet: log it, retry
                self.log.warning("session failed unexpectedly", error=repr(exc), exc_info=True)
            if self.sessions > sessions_before:
                backoff.reset()
            self.state = "backoff"
            await asyncio.sleep(backoff.next())

    def _log_failure(self, message: str, **kw: object) -> None:
        # One line at info per outage; the retries of a fleet would drown everything else.
        if not self._failures_logged:
            self.log.info(message, **kw)
            self._failures_logged = True
        else:
            self.log.debug(message, **kw)

    # -- identity ----------------------------------------------------------------------------

    async def _ensure_identity(self) -> Identity:
        if self.identity is not None and self.identity.not_after > time.time() and not self._revoked:
            return self.identity
        reprovisioned = self.root / REPROVISIONED_TOKEN
        token = reprovisioned.read_text().strip() if reprovisioned.exists() else None
        if token is None and self._revoked:
            raise NodeError("certificate revoked and no join token re-provisioned to the machine")
        token = token or self.config.join_token(self.name)
        if token is None:
            raise NodeError("not enrolled (or certificate expired) and no join token")
        self.state = "enrolling"
        # The keys of an enrolment whose answer never came are sent again with the same token: the
        # gateway answers such a retry with the certificates it issued them (the token is spent).
        if self._enrolling is None or self._enrolling[0] != token:
            self._enrolling = (token, KeyPair.generate())
        keys = self._enrolling[1]
        request = pb.EnrolRequest(join_token=token, csr_pem=keys.csr_bundle(self.name))
        async with self.shared.enrol_slots:
            response = await self.shared.enrol.Enrol(request, timeout=RPC_TIMEOUT)
        self._enrolling = None
        identity = keys.certify(response.node_id, response.certificate_pem, response.ca_certificate_pem)
        self.store.save(identity)
        self.identity = identity
        self._revoked = False
        reprovisioned.unlink(missing_ok=True)  # one-time: spent
        self.log.debug("enrolled", node_id=identity.node_id)
        return identity

    def _renew_due(self) -> bool:
        assert self.identity is not None
        if time.monotonic() < self._renew_not_before:
            return False
        return self._renew_requested or time.time() >= self.identity.renew_at(self._renew_jitter)

    async def _renew(self, stub: node_pb2_grpc.NodeGatewayStub) -> bool:
        assert self.identity is not None
        keys = KeyPair.generate()
        try:
            response = await stub.Renew(pb.RenewRequest(csr_pem=keys.csr_bundle(self.name)), timeout=RPC_TIMEOUT)
            identity = keys.certify(self.identity.node_id, response.certificate_pem, self.identity.ca_pem)
        except (grpc.aio.AioRpcError, IdentityError) as exc:
            self.log.warning("renewal failed", error=str(exc))
            self._renew_not_before = time.monotonic() + max(RENEW_RETRY, self.config.heartbeat)
            return False
        self.store.save(identity)
        self.identity = identity
        self._renew_requested = False
        self.log.info("certificate renewed", not_after=int(identity.not_after))
        return True

    # -- the session -------------------------------------------------------------------------

    def _channel_for(self, identity: Identity) -> grpc.aio.Channel:
        if self._channel is None or self._channel_key_id != identity.key_id:
            old = self._channel
            if old is not None:
                asyncio.get_running_loop().create_task(old.close(grace=1.0))
            credentials = grpc.ssl_channel_credentials(
                root_certificates=self.config.ca_pem or identity.ca_pem,
                private_key=identity.tls_key_pem,
                certificate_chain=identity.tls_cert_pem,
            )
            options = [("grpc.ssl_target_name_override", self.config.server_name)] if self.config.server_name else []
            self._channel = grpc.aio.secure_channel(self.config.gateway, credentials, options=options)
            self._channel_key_id = identity.key_id
        return self._channel

    async def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close()

    def _hello(self) -> pb.NodeMessage:
        legacy = self.faults.no_capabilities
        return pb.NodeMessage(
            hello=pb.Hello(
                daemon_version=LEGACY_DAEMON_VERSION if legacy else DAEMON_VERSION,
                capabilities=[] if legacy else list(CAPABILITIES),
                inventory=self.metal.inventory(),
            )
        )

    async def _session(self, identity: Identity) -> bool:
        """One session; True when it ended to rotate to a renewed certificate."""
        self.state = "connecting"
        stub = node_pb2_grpc.NodeGatewayStub(self._channel_for(identity))
        call = stub.Session()
        outbox: asyncio.Queue[object] = asyncio.Queue()
        # Oldest first: what a broken session left unsent or unacknowledged, then every hold again
        # (this also re-reports what a restarted daemon recovered from its sandbox).
        for is_bind, report in self._pending:
            if not is_bind:  # binds are re-reported below from the holds themselves
                outbox.put_nowait((False, report))
        self._pending.clear()
        if not self.faults.never_answer:
            for hold in self.converger.holds.values():
                outbox.put_nowait((True, self.reporter.report(Bound(hold))))
        self._outbox = outbox
        reader = asyncio.create_task(self._reader(call), name=f"{self.name}-reader")
        writer = asyncio.create_task(self._writer(call, stub, outbox), name=f"{self.name}-writer")
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            # The reader's outcome carries the call's status; the writer's only says it broke.
            for task in (reader, writer):
                if task in done and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return writer in done and writer.result()
        finally:
            self.connected = False
            self._outbox = None
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            call.cancel()
            left = list(self._unacked.values())  # written before anything still queued
            self._unacked.clear()
            self._timing.clear()  # binds are reported again from the holds, with new sequences
            while not outbox.empty():
                item = outbox.get_nowait()
                if isinstance(item, tuple):
                    left.append(item)
            self._pending[:0] = left


    async def _reader(self, call: grpc.aio.StreamStreamCall) -> None:
        async for message in call:
            kind = message.WhichOneof("msg")
            if kind == "desired_state":
                self._on_desired(message.desired_state)
            elif kind == "report_ack":
                self._unacked.pop(message.report_ack.sequence, None)
            elif kind == "renew_hint" and not self.faults.ignore_renew_hints:
                self._renew_requested = True
                self._renew_not_before = 0.0
                if self._outbox is not None:
                    self._outbox.put_nowait(_WAKE)

    async def _writer(
        self,
        call: grpc.aio.StreamStreamCall,
        stub: node_pb2_grpc.NodeGatewayStub,
        outbox: asyncio.Queue[object],
    ) -> bool:
        await call.write(self._hello())
        self.connected = True
        self.sessions += 1
        self.state = "connected"
        if self._failures_logged:
            self.log.info("connected again")
        self._failures_logged = False
        loop = asyncio.get_running_loop()
        beats = Beats(self.config.heartbeat, loop.time(), self.config.heartbeat_jitter)
        while True:
            if self._renew_due() and await self._renew(stub):
                return True
            item: object = _HEARTBEAT
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, beats.due - loop.time())):
                    item = await outbox.get()
            if item is _WAKE:
                continue
            if item is _INVENTORY:
                message = pb.NodeMessage(inventory=self.metal.inventory())
            elif item is _HEARTBEAT:
                beats.sent(loop.time())
                message = pb.NodeMessage(
                    heartbeat=pb.Heartbeat(time=now_ms(), applied_generation=self.applied_generation)
                )
            else:
                assert isinstance(item, tuple)
                message = pb.NodeMessage(report=item[1])
                sequence = _sequence(item[1])
                if message.ByteSize() > self.config.max_report_bytes:
                    # The gateway would end the session, and the report, kept until acknowledged,
                    # would go first in every session after: nothing after it would ever arrive.
                    self._timing.pop(sequence, None)
                    self.log.error("report too large to send; dropped", sequence=sequence, bind=item[0],
                                   bytes=message.ByteSize(), limit=self.config.max_report_bytes)
                    continue
                # Kept before the write: the ack can come back before write() returns.
                self._unacked[sequence] = item
                timing = self._timing.pop(sequence, None)
                if timing is not None:
                    writing = time.perf_counter()
                    await call.write(message)
                    allocation, arrived, queued = timing
                    self.log.info("bind sent", allocation=allocation, apply_ms=_ms(queued - arrived),
                                  queue_ms=_ms(writing - queued), write_ms=_ms(time.perf_counter() - writing))
                    continue
            await call.write(message)

    # -- convergence and reports -------------------------------------------------------------

    def _on_desired(self, desired: pb.DesiredState) -> None:
        arrived = time.perf_counter()
        if not self.faults.never_answer:
            self._emit(self.converger.apply(desired, now_ms()), arrived)
            self.metal.apply([a for a in desired.assignments if a.binding == pb.BINDING_NODE])
        if desired.generation != self.applied_generation:
            self.applied_generation = desired.generation
            if self._outbox is not None:
                self._outbox.put_nowait(_HEARTBEAT)

    def _inventory_changed(self) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(_INVENTORY)

    def _emit(self, events: list[Event], arrived: float | None = None) -> None:
        self.plugin.changed()  # every change of the holds passes here
        if self.faults.never_answer or not events:
            return
        if self.identity is None:  # holds found on disk without keys: nothing can sign for them
            self.log.warning("no identity to sign reports with", events=len(events))
            return
        for event in events:
            item = (isinstance(event, Bound), self.reporter.report(event))
            if self._outbox is not None:
                if arrived is not None and isinstance(event, Bound):
                    self._timing[_sequence(item[1])] = (event.hold.allocation_id, arrived, time.perf_counter())
                self._outbox.put_nowait(item)
            else:
                self._pending.append(item)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _sequence(report: pb.AttestedReport) -> int:
    return pb.Report.FromString(report.body).sequence


def restarted(faults: Faults) -> Faults:
    """A restart happens once: the next incarnation keeps every other fault."""
    return replace(faults, restart_after=None, restart_on_signal=False)
