"""The gateway's TLS: a server certificate from the control-plane CA, renewed in place past half
its life (grpc asks the fetcher before every handshake), and the peer's client certificate."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import urllib.parse

import grpc
import structlog
from psycopg_pool import AsyncConnectionPool

from controlplane.pki import enrolment, store
from controlplane.pki.config import PkiSettings

log = structlog.get_logger("gateway.tls")


class ServerTls:
    """Holds the current server certificate; each listener's credentials pick up a new one."""

    def __init__(self, pool: AsyncConnectionPool, ca: store.Ca, settings: PkiSettings, hosts: tuple[str, ...]) -> None:
        self._pool, self._ca, self._settings, self._hosts = pool, ca, settings, hosts
        self._current: enrolment.ServerCertificate | None = None
        self._version = 0

    async def refresh(self) -> None:
        self._current = await enrolment.gateway_certificate(self._pool, self._ca, self._settings, self._hosts)
        self._version += 1
        log.info("gateway certificate issued", not_after=self._current.not_after.isoformat(), hosts=self._hosts)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        assert self._current is not None, "refresh() first"
        return grpc.ssl_server_certificate_configuration(
            [(self._current.key_pem, self._current.certificate_pem)], root_certificates=self._ca.pem)

    def credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials:
        served = self._version

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            nonlocal served
            if served == self._version:
                return None
            served = self._version
            return self._configuration()

        return grpc.dynamic_ssl_server_credentials(self._configuration(), fetch,
                                                   require_client_authentication=require_client_auth)

    async def keep_fresh(self, stopping: asyncio.Event) -> None:
        """Renew the server certificate at half its life."""
        while not stopping.is_set():
            assert self._current is not None
            half = self._current.not_before + (self._current.not_after - self._current.not_before) / 2
            delay = max(1.0, (half - dt.datetime.now(dt.UTC)).total_seconds())
            try:
                await asyncio.wait_for(stopping.wait(), timeout=delay)
                return
            except TimeoutError:
                pass
            try:
                await self.refresh()
            except Exception:
                log.exception("gateway certificate renewal failed; retrying")
                await asyncio.sleep(5)


def peer_certificate(context: grpc.aio.ServicerContext) -> bytes | None:
    """The PEM of the verified client certificate, if the connection has one."""
    found = (context.auth_context() or {}).get("x509_pem_cert") or []
    return found[0] if found else None


def peer_name(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the verified client certificate (a node certificate's: its node id), if
    any. TLS verified the certificate against the CA, not against revocation: good for pacing the
    node before anything is read about it, not for trusting it."""
    found = (context.auth_context() or {}).get("x509_common_name") or []
    return found[0].decode(errors="replace") if found else None


def peer_address(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, by network address, for pacing what has no certificate (Enrol): the IPv4
    address, the IPv6 /64 (one host is given a whole /64), or gRPC's peer string as it is."""
    peer = urllib.parse.unquote(context.peer() or "")  # gRPC may write ipv6:%5B::1%5D:port
    kind, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)
