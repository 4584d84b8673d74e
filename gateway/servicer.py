"""The NodeGateway servicer: Enrol (a join token and a CSR), Renew and Session (mutual TLS: the
node is who its client certificate says, never what a message says)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import grpc
import structlog
from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc as rpc
from controlplane import errors
from controlplane.common.status import to_status
from controlplane.pki import enrolment, store
from controlplane.pki.config import PkiSettings
from gateway import tls
from gateway.refusals import Refusals
from gateway.session import SessionRunner, failure_status
from gateway.throttle import Throttle

log = structlog.get_logger("gateway.session")

Ctx = grpc.aio.ServicerContext
OPEN_WAIT_SECONDS = 10.0  # a session open that would wait longer for the node's turn is refused


def _paced(throttle: Throttle, node_id: str | None, most: float, refusal: str) -> float:
    """The wait before the named node's next call (its bucket's turn); QUOTA_EXCEEDED
    (`rate-limited`, `retryAfterSeconds`) when that is longer than `most`. A certificate without
    a name is paced by identify's refusal, not here."""
    if node_id is None:
        return 0.0
    wait = throttle.wait(node_id, most=most)
    if wait < 0:
        raise _rate_limited(refusal, -wait)
    return wait


def _rate_limited(refusal: str, seconds: float) -> errors.QuotaExceeded:
    """QUOTA_EXCEEDED, reason `rate-limited`, retryAfterSeconds: the caller's turn is `seconds` away."""
    return errors.QuotaExceeded(refusal, reason="rate-limited", retryAfterSeconds=max(1, math.ceil(seconds)))


class NodeGatewayServicer(rpc.NodeGatewayServicer):
    def __init__(self, pool: AsyncConnectionPool, ca: store.Ca, settings: PkiSettings, sessions: SessionRunner,
                 renewals: Throttle | None = None, refusals: Refusals | None = None,
                 enrolments: Throttle | None = None) -> None:
        self.pool, self.ca, self.settings, self.sessions = pool, ca, settings, sessions
        self.renewals = renewals or Throttle(0, 1)
        self.enrolments = enrolments or Throttle(0, 1)  # refused enrolments, by peer address
        self.refusals = refusals if refusals is not None else Refusals(0, 0)

    async def _peer(self, context: Ctx) -> enrolment.Peer:
        """The node of the client certificate; a certificate refused lately is refused again from
        memory (gateway.refusals), without a database read."""
        cert_pem = tls.peer_certificate(context)
        if (refused := self.refusals.refused(cert_pem)) is not None:
            raise refused
        return await self._identify(cert_pem)

    async def _identify(self, cert_pem: bytes | None) -> enrolment.Peer:
        try:
            peer = await enrolment.identify(self.pool, cert_pem)
        except errors.Unauthenticated as exc:
            self.refusals.remember(cert_pem, exc)
            raise
        structlog.contextvars.bind_contextvars(node_id=peer.node_id)
        return peer

    async def Enrol(self, request: pb.EnrolRequest, context: Ctx) -> pb.EnrolResponse:
        # A refused enrolment costs its address a token; one with none left is refused before its
        # CSR is parsed or its token read (gateway.throttle): guessing join tokens is paced.
        address = tls.peer_address(context)
        if (due := self.enrolments.due(address)) > 0:
            raise _rate_limited("enrolments from this address were refused too often", due)
        try:
            issued = await enrolment.enrol(self.pool, self.ca, self.settings, request.join_token, request.csr_pem)
        except errors.DomainError:
            self.enrolments.debit(address)
            raise
        structlog.contextvars.bind_contextvars(node_id=issued.node_id)
        return pb.EnrolResponse(node_id=issued.node_id, certificate_pem=issued.certificate_pem,
                                ca_certificate_pem=self.ca.pem, not_after=issued.not_after_ms)

    async def Renew(self, request: pb.RenewRequest, context: Ctx) -> pb.RenewResponse:
        cert_pem = tls.peer_certificate(context)
        if (refused := self.refusals.refused(cert_pem)) is not None:
            raise refused
        # The node's turn before anything is read about it: a node renewing in a loop is refused,
        # not queued (gateway.throttle), and its refused calls cost no database read.
        _paced(self.renewals, tls.peer_name(context), 0.0, "this node renews too often")
        peer = await self._identify(cert_pem)
        issued = await enrolment.renew(self.pool, self.ca, self.settings, peer, request.csr_pem)
        return pb.RenewResponse(certificate_pem=issued.certificate_pem, not_after=issued.not_after_ms)

    async def Session(self, request_iterator: AsyncIterator[pb.NodeMessage], context: Ctx) -> None:
        if (refused := self.refusals.refused(tls.peer_certificate(context))) is not None:
            # refused lately: refused again at once, holding no sweep
            log.info("session refused", code=refused.code, reason=refused.message, remembered=True)
            await context.abort_with_status(to_status(refused.code, refused.message, refused.details))
            return
        # Opening costs transactions like a hello (the certificate read, registered, other roles
        # retired, the desired state read, unregistered at the end): the node's turn first, before
        # any of them, so opening streams by the hundred costs nothing; one that would wait longer
        # than OPEN_WAIT_SECONDS is refused rather than held in a task (gateway.throttle).
        try:
            wait = _paced(self.sessions.throttle, tls.peer_name(context), OPEN_WAIT_SECONDS,
                          "this node opens sessions too often")
        except errors.QuotaExceeded as exc:
            log.info("session refused", code=exc.code, reason=exc.message)
            await context.abort_with_status(to_status(exc.code, exc.message, exc.details))
            return
        if wait > 0:
            await asyncio.sleep(wait)
        arrival = self.sessions.liveness.arriving()  # the sweeper holds until its hello is in
        try:
            try:
                peer = await self._peer(context)
            except errors.DomainError as exc:
                log.info("session refused", code=exc.code, reason=exc.message)
                await context.abort_with_status(to_status(exc.code, exc.message, exc.details))
                return
            except Exception as exc:  # a database fault while identifying it: no internals to the node
                await context.abort_with_status(failure_status(exc))
                return
            self.sessions.liveness.identified(arrival, peer.node_id)
            await self.sessions.run(peer, request_iterator, context, arrival)
        finally:
            self.sessions.liveness.arrived(arrival)
