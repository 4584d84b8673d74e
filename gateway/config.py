"""Gateway settings, read once from the environment."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from controlplane.config import env_float, env_int

from controlplane.pki.config import PkiSettings


def _hosts() -> tuple[str, ...]:
    raw = os.environ.get("BC_GATEWAY_HOSTS", "127.0.0.1,localhost")
    return tuple(h.strip() for h in raw.split(",") if h.strip())


@dataclass(frozen=True)
class GatewaySettings:
    # Mutual TLS: node sessions and certificate renewal.
    listen: str = field(default_factory=lambda: os.environ.get("BC_GATEWAY_LISTEN", "127.0.0.1:50061"))
    # Server-only TLS: enrolment with a join token (the node has no certificate yet).
    enrol_listen: str = field(default_factory=lambda: os.environ.get("BC_GATEWAY_ENROL_LISTEN", "127.0.0.1:50062"))
    # Names in the gateway's server certificate (what nodes dial).
    hosts: tuple[str, ...] = field(default_factory=_hosts)
    # A node not heard from for this long is unreachable (nodes heartbeat well within it).
    node_grace_seconds: float = field(default_factory=lambda: env_float("BC_NODE_GRACE_SECONDS", 30))
    # A heartbeat writes no row: each sweep stores a node's freshest time only when `last_seen`
    # trails it by more than this fraction of the grace (0: every heartbeat writes).
    node_seen_write_fraction: float = field(
        default_factory=lambda: env_float("BC_NODE_SEEN_WRITE_FRACTION", 0.25))
    # How often the unreachable sweeper looks (and stores what the heartbeats said).
    sweep_seconds: float = field(default_factory=lambda: env_float("BC_NODE_SWEEP_SECONDS", 5))
    db_pool_size: int = field(default_factory=lambda: env_int("BC_GATEWAY_DB_POOL_SIZE", 8))
    # On stop, how long the last heartbeats' store and the sessions' release may wait for the
    # database; past it they are left (each node is then judged by its grace, as after a crash),
    # so a gateway whose database is down still stops.
    stop_db_seconds: float = field(default_factory=lambda: env_float("BC_GATEWAY_STOP_DB_SECONDS", 5))
    # The largest TLS record a session's connection writes, in bytes (gRPC allows 1024-16384).
    # Each connection keeps a buffer of this size for its whole life: node sessions carry small
    # messages, so 4 KiB instead of 16 saves ~7 KiB per session and larger messages still go,
    # in more records.
    tls_frame_bytes: int = field(default_factory=lambda: env_int("BC_GATEWAY_TLS_FRAME_BYTES", 4096))
    # HTTP/2 bandwidth-delay probing: a PING after data received, answered by the node, to grow
    # the flow-control window for bulk transfers. Sessions carry a heartbeat every few seconds,
    # never bulk: the probing doubled the gateway's CPU per heartbeat. Off unless set to 1.
    http2_bdp_probe: bool = field(default_factory=lambda: os.environ.get("BC_GATEWAY_HTTP2_BDP_PROBE", "0") == "1")
    # After each full garbage collection the survivors are frozen (the next one scans only what came
    # since); this often they are unfrozen, so one full collection frees what became garbage
    # meanwhile (controlplane.common.gc_pauses). 0: no freezing.
    gc_unfreeze_seconds: float = field(
        default_factory=lambda: env_float("BC_GATEWAY_GC_UNFREEZE_SECONDS", 600))
    # A node's hellos, inventories and reports taken in per second, and at once (gateway.throttle);
    # past that its session's reader waits. 0: no limit.
    node_messages_per_second: float = field(
        default_factory=lambda: env_float("BC_NODE_MESSAGES_PER_SECOND", 50))
    node_messages_burst: int = field(default_factory=lambda: env_int("BC_NODE_MESSAGES_BURST", 500))
    # A node's messages that cost no transaction (heartbeats that change nothing, messages of no
    # known kind) taken in per second, and at once; past that its session's reader waits. A
    # daemon beats every few seconds: this only stops a node flooding the event loop. 0: no limit.
    node_free_messages_per_second: float = field(
        default_factory=lambda: env_float("BC_NODE_FREE_MESSAGES_PER_SECOND", 5))
    node_free_messages_burst: int = field(default_factory=lambda: env_int("BC_NODE_FREE_MESSAGES_BURST", 50))
    # Report acks a session holds not yet written (the node reads none: its stream's window is
    # full) before its reader waits for them to go; 0: no bound.
    node_unsent_acks: int = field(default_factory=lambda: env_int("BC_NODE_MAX_UNSENT_ACKS", 1000))
    # Reports about one allocation kept not judged yet; past it a node's reports about it are
    # dropped (IGNORED, logged once a minute). The worker judges a live allocation's reports at
    # once; an ended allocation's are never judged, and the retention sweep deletes them.
    node_unjudged_reports: int = field(default_factory=lambda: env_int("BC_NODE_MAX_UNJUDGED_REPORTS", 32))
    # A node's certificate renewals per hour, and at once; past that Renew is QUOTA_EXCEEDED.
    node_renewals_per_hour: float = field(
        default_factory=lambda: env_float("BC_NODE_RENEWALS_PER_HOUR", 60))
    node_renewals_burst: int = field(default_factory=lambda: env_int("BC_NODE_RENEWALS_BURST", 10))
    # Refused enrolments (a wrong, spent or expired join token; a bad CSR) per minute from one
    # address (an IPv4 address, an IPv6 /64), and at once; past that Enrol is QUOTA_EXCEEDED before
    # anything is parsed or read. Enrolments that succeed are not counted. 0: no limit.
    enrol_refusals_per_minute: float = field(
        default_factory=lambda: env_float("BC_ENROL_REFUSALS_PER_MINUTE", 60))
    enrol_refusals_burst: int = field(default_factory=lambda: env_int("BC_ENROL_REFUSALS_BURST", 20))
    # Client certificates refused (unknown, revoked, expired) kept in memory, and for how long: one
    # presented again is refused without a database read (gateway.refusals). 0: none kept.
    refused_certificates: int = field(default_factory=lambda: env_int("BC_NODE_REFUSED_CERTS", 10000))
    refused_certificate_seconds: float = field(
        default_factory=lambda: env_float("BC_NODE_REFUSED_CERT_SECONDS", 600))
    # Names this process in nodes.session_gateway.
    gateway_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    pki: PkiSettings = field(default_factory=PkiSettings)
    # Prometheus metrics at GET /metrics on this host:port (port 0 picks a free one); empty: off.
    metrics_listen: str = field(default_factory=lambda: os.environ.get("BC_GATEWAY_METRICS_LISTEN", ""))
