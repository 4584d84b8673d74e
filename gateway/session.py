"""One node session: register as the node's newest, push the desired state on start and on every
wake-up, take in what the node sends (acknowledging each report once it is dealt with), and close
when the node leaves, a newer session of the node registers (ABORTED), or its certificate is
revoked or runs out (UNAUTHENTICATED)."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import structlog
from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2
from controlplane import db, errors
from controlplane.common.status import failure, to_status
from controlplane.ids import new_id
from controlplane.nodes import connectivity, desired, inventory, reports, sessions
from controlplane.pki import store
from controlplane.pki import enrolment
from controlplane.pki.enrolment import Peer
from gateway.hub import Hub
from gateway.session_state import ACK, CHECK, CLOSED, DESIRED, RENEW, NodeSession
from gateway.throttle import Throttle

log = structlog.get_logger("gateway.session")

# A transaction each: throttled per node (and each open, paced by the servicer before the certificate is
# read; and a heartbeat that writes, see _handle); the rest by the chatter bucket
COSTLY = frozenset({"hello", "inventory", "report"})
UNSENT_ACKS = 1000  # GatewaySettings.node_unsent_acks
TELL_SECONDS = 30.0  # how long a session's end waits for a node that reads nothing to take it


class SessionEnded(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, status: grpc.Status | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


def _ended(error: errors.DomainError) -> SessionEnded:
    """The end of a session the gateway decided, with its spec code in ErrorInfo."""
    status = to_status(error.code, error.message, error.details)
    return SessionEnded(status.code, error.message, status)


def failure_status(exc: Exception, **ids: str) -> grpc.Status:
    """A session's unexpected failure as the node sees it (status.failure: UNAVAILABLE for a
    database fault a new session may not meet, else INTERNAL); `ids` name the session."""
    return failure(exc, "session", **ids)[1]


class SessionRunner:
    def __init__(self, pool: AsyncConnectionPool, hub: Hub, gateway_id: str, liveness: connectivity.Liveness,
                 throttle: Throttle | None = None, unsent_acks: int = UNSENT_ACKS,
                 unjudged_reports: int = reports.MAX_UNJUDGED, chatter: Throttle | None = None) -> None:
        self.pool, self.hub, self.gateway_id, self.liveness = pool, hub, gateway_id, liveness
        self.throttle = throttle or Throttle(0, 1)
        self.chatter = chatter or Throttle(0, 1)  # the messages that cost no transaction
        self.unsent_acks = unsent_acks  # a session's acks not written yet before its reader waits
        self.unjudged_reports = unjudged_reports  # an allocation's unjudged reports before more are dropped
        self.closing = False  # the gateway is shutting down: release_all unregisters every session at once
        self._ending: set[asyncio.Future[None]] = set()  # sessions being unregistered (see run)

    async def run(self, peer: Peer, requests: AsyncIterator[node_pb2.NodeMessage],
                  context: grpc.aio.ServicerContext, arrival: object = None) -> None:
        session = NodeSession(peer, new_id("sess"), arrival=arrival)
        structlog.contextvars.bind_contextvars(node_id=peer.node_id, session_id=session.session_id)
        started = time.perf_counter()
        reader: asyncio.Task | None = None
        outcome = "node closed the stream"
        try:
            # (Opening was paced by the servicer, before the certificate was read.)
            # Listen first, then register: a newer session registering after us always wakes us.
            self.hub.add(session)
            await sessions.open(self.pool, session.node_id, session.session_id, self.gateway_id)
            await enrolment.retire_other_roles(self.pool, peer)  # after a role change (whole-machine leases)
            log.info("session started", serial=peer.serial, role=peer.role, gateway=self.gateway_id)
            self._arm(session)
            reader = asyncio.create_task(self._read(session, requests), name=f"session-{session.session_id}")
            await self._serve_and_watch(session, reader, context)
        except SessionEnded as ended:
            outcome = ended.message
            # Over before the node hears it: a node that reads nothing hears it only once it reads.
            await self._release(session, reader, outcome, started)
            await _tell(context.abort_with_status(ended.status) if ended.status is not None
                        else context.abort(ended.code, ended.message))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            # Never grpc's default, which tells the node the exception's text (a database
            # message included): UNAVAILABLE for a database fault (the node reconnects), else INTERNAL.
            outcome = f"failed: {type(exc).__name__}"
            await self._release(session, reader, outcome, started)
            await _tell(context.abort_with_status(failure_status(exc, sessionId=session.session_id)))
        finally:
            await self._release(session, reader, outcome, started)

    async def _release(self, session: NodeSession, reader: asyncio.Task | None, outcome: str,
                       started: float) -> None:
        """The session's end on this side (once): its reader stops, it leaves the hub and is
        unregistered."""
        if session.released:
            return
        session.released = True
        if reader is not None:
            reader.cancel()
        session.disarm()
        self.hub.remove(session)
        if not self.hub.sessions(session.node_id):
            self.liveness.ended(session.node_id)
        # gRPC cancels this task when the node cancels its call, which may come just after
        # the node closed its side, while the session is being unregistered: the end runs to
        # its end on its own (a session left registered would wait for the sweeper's grace).
        ending = asyncio.ensure_future(self._end(session, outcome, started))
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)
        await asyncio.shield(ending)

    async def _end(self, session: NodeSession, outcome: str, started: float) -> None:
        await self._unregister(session)
        log.info("session ended", outcome=outcome, reports_ignored=session.reports_ignored,
                 reports_replayed=session.reports_replayed, throttled=session.throttled,
                 acks_waited=session.acks_waited, duration_s=round(time.perf_counter() - started, 3))

    async def _serve_and_watch(self, session: NodeSession, reader: asyncio.Task,
                               context: grpc.aio.ServicerContext) -> None:
        """Serve the node (`_serve`) while a watcher re-checks the session on every CHECK. The
        watcher does not wait for the writer: a node that reads nothing keeps every write waiting,
        and its session, superseded, revoked or expired, must still end (its reader with it) rather
        than go on applying what it sends."""
        serving = asyncio.create_task(self._serve(session, reader, context), name=f"serve-{session.session_id}")
        watching = asyncio.create_task(self._watch(session), name=f"watch-{session.session_id}")
        try:
            await asyncio.wait([serving, watching], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (serving, watching):
                if not task.done():
                    task.cancel()
                    # a write cancelled while the node reads nothing: never awaited, never logged
                    task.add_done_callback(_quietly)
        if watching.done() and not watching.cancelled():
            reader.cancel()  # the session ends now: nothing more the node sent is applied
            watching.result()  # raises SessionEnded
        await serving

    async def _watch(self, session: NodeSession) -> None:
        while True:
            await session.next_check()
            await self._check(session)

    async def _serve(self, session: NodeSession, reader: asyncio.Task, context: grpc.aio.ServicerContext) -> None:
        session.signal(DESIRED)
        while True:
            kinds = await session.next_signals()
            if CLOSED in kinds:  # the node closed its side (or reading failed): the session ends
                await asyncio.wait([reader])
                failed = None if reader.cancelled() else reader.exception()
                if isinstance(failed, errors.DomainError):  # the node sent what it may not: say what
                    log.info("session refused a message", code=failed.code, reason=failed.message)
                    raise _ended(failed)
                if failed is not None:
                    raise failed  # its status: see run
                for ack in session.take_acks():  # the node half-closed: its last reports still get theirs
                    await context.write(node_pb2.GatewayMessage(report_ack=ack))
                return
            if DESIRED in kinds:
                woke = time.perf_counter()
                state = await desired.read(self.pool, session.node_id)
                read = time.perf_counter()
                await context.write(node_pb2.GatewayMessage(desired_state=state))
                log.info("desired state sent", generation=state.generation, assignments=len(state.assignments),
                         wait_ms=_ms(woke - session.desired_since), read_ms=_ms(read - woke),
                         write_ms=_ms(time.perf_counter() - read))
            if RENEW in kinds:
                not_after = int(session.peer.not_after.timestamp() * 1000)
                await context.write(node_pb2.GatewayMessage(renew_hint=node_pb2.RenewHint(not_after=not_after)))
            if ACK in kinds:
                for ack in session.take_acks():
                    await context.write(node_pb2.GatewayMessage(report_ack=ack))

    async def _read(self, session: NodeSession, requests: AsyncIterator[node_pb2.NodeMessage]) -> None:
        try:
            async for message in requests:
                await self._handle(session, message)
        finally:
            session.signal(CLOSED)

    async def _handle(self, session: NodeSession, message: node_pb2.NodeMessage) -> None:
        kind = message.WhichOneof("msg")
        node_id = session.node_id
        # A heartbeat is free while its applied generation stays; one that changes it writes a row,
        # so a node flipping the generation in every heartbeat is paced like any message that costs
        # one. What costs no transaction (a heartbeat that stays, a message of no known kind) still
        # costs the event loop a parse: paced by a bucket of its own, far above a daemon's beat.
        if kind in COSTLY or (kind == "heartbeat"
                              and self.liveness.writes(node_id, message.heartbeat.applied_generation)):
            await self._throttled(session, self.throttle)
        else:
            await self._throttled(session, self.chatter)
        if kind == "hello":
            took = await inventory.apply_hello(self.pool, node_id, message.hello, session.session_id)
            self.throttle.charge(node_id, took)
            await self.liveness.hello(node_id)
            self.liveness.arrived(session.arrival)
            log.info("hello", daemon_version=message.hello.daemon_version, took_ms=_ms(took),
                     capabilities=list(message.hello.capabilities), gpus=len(message.hello.inventory.gpus))
        elif kind == "heartbeat":
            await self.liveness.heartbeat(node_id, message.heartbeat.applied_generation)
        elif kind == "inventory":
            took = await inventory.apply_inventory(self.pool, node_id, message.inventory, session.session_id)
            self.throttle.charge(node_id, took)  # the time it held the pool's lock (gateway.throttle)
            await self.liveness.hello(node_id)
            log.info("inventory", gpus=len(message.inventory.gpus), took_ms=_ms(took))
        elif kind == "report":
            # A node that reads none of its acks (its stream's window full, the writer waits) must
            # not grow them without end: its reports wait, and HTTP/2 flow control slows it down.
            if len(session.acks) >= self.unsent_acks and not session.acks_waited:
                log.warning("node reads no report acks", unsent=len(session.acks))
            if await session.room_for_acks(self.unsent_acks):
                session.acks_waited += 1
            started = time.perf_counter()
            ack = await reports.intake(self.pool, node_id, message.report, self.unjudged_reports)
            if ack.outcome == reports.IGNORED:
                session.reports_ignored += 1
            elif ack.outcome == reports.REPLAYED:
                session.reports_replayed += 1
            session.acknowledge(ack)
            log.info("report " + node_pb2.ReportOutcome.Name(ack.outcome).removeprefix("REPORT_").lower(),
                     key_id=ack.key_id, sequence=ack.sequence, intake_ms=_ms(time.perf_counter() - started))

    async def _throttled(self, session: NodeSession, throttle: Throttle) -> None:
        """Wait for the node's turn (gateway.throttle); the first wait of a session is logged."""
        delay = throttle.wait(session.node_id)
        if delay <= 0:
            return
        if not session.throttled:
            log.warning("node throttled", wait_ms=_ms(delay), per_second=throttle.rate, burst=throttle.burst,
                        free=throttle is self.chatter)
        session.throttled += 1
        await asyncio.sleep(delay)

    async def release_all(self) -> None:
        """On shutdown, once the server stopped: the freshest time each node was heard, then every
        session of this gateway, one statement each, before the pool closes."""
        await asyncio.gather(*self._ending, return_exceptions=True)
        try:
            await self.liveness.store_all()
        except Exception:
            log.exception("storing the last heartbeats failed")
        await sessions.close_gateway(self.pool, self.gateway_id)

    async def _unregister(self, session: NodeSession) -> None:
        if self.closing or self.pool.closed:  # shutting down: release_all unregisters them all at once
            return
        try:
            await sessions.close(self.pool, session.node_id, session.session_id)
        except Exception:
            log.exception("session unregister failed")  # a newer session overwrites it anyway

    async def _check(self, session: NodeSession) -> None:
        """Still the node's newest session, with a certificate neither revoked nor expired?"""
        async with db.read_only(self.pool) as conn:
            newest = await sessions.current(conn, session.node_id)
            cert = await store.certificate_by_key_id(conn, session.peer.key_id)
        if newest != session.session_id:
            raise _ended(errors.Conflict("a newer session of this node took over", sessionId=session.session_id))
        if cert is None or cert["revoked_at"] is not None:
            raise _ended(errors.Unauthenticated("certificate revoked", sessionId=session.session_id))
        if cert["now"] >= cert["not_after"]:
            raise _ended(errors.Unauthenticated("certificate expired", sessionId=session.session_id))
        # Good still by the database's clock, which judges it: the next re-check is when that clock
        # says it runs out (a gateway whose clock runs ahead re-checked once, too early, and then
        # never again: the session outlived its certificate).
        session.arm(CHECK, (cert["not_after"] - cert["now"]).total_seconds() + 1)

    def _arm(self, session: NodeSession) -> None:
        """A renewal hint between half and 60 % of the certificate's life (spread, so a fleet
        enrolled together does not renew in one burst); a re-check when it runs out."""
        peer = session.peer
        now = dt.datetime.now(dt.UTC)
        hint_at = peer.not_before + (peer.not_after - peer.not_before) * (0.5 + random.random() * 0.1)
        session.arm(RENEW, (hint_at - now).total_seconds())
        session.arm(CHECK, (peer.not_after - now).total_seconds() + 1)


async def _tell(abort: Coroutine[Any, Any, None]) -> None:
    """End the call (`abort`: grpc's abort with the status). The status goes after the messages
    still unread on the stream: a node that reads none of them is given TELL_SECONDS, then its call
    is dropped (gRPC resets the stream once the handler returns), so it holds no task for ever."""
    try:
        await asyncio.wait_for(abort, TELL_SECONDS)
    except TimeoutError:
        log.info("node did not read its session's end: call dropped")


def _quietly(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
