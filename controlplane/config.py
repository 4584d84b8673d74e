"""Settings, read once from the environment. Every knob has a default that runs on a laptop."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        return default if raw is None else int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return default if raw is None else float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {raw!r}") from None


def _bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    return default if raw is None else raw.strip().lower() in {"1", "true", "yes", "on"}


def _networks(name: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """A comma-separated list of CIDR networks (a bare address is a /32 or /128)."""
    raw = os.environ.get(name, "")
    try:
        return tuple(ipaddress.ip_network(n.strip()) for n in raw.split(",") if n.strip())
    except ValueError as exc:
        raise ValueError(f"{name} must list CIDR networks: {exc}") from None


def tcp_port(address: str) -> int | None:
    """The port of a `host:port` written in ASCII digits (None: no such port, or a unix: socket).
    gRPC reads a port beyond 65535 modulo 65536, so both ends check it."""
    if address.startswith("unix:"):
        return None
    port = address.rpartition(":")[2]
    return int(port) if port.isascii() and port.isdigit() else None


def check_listen(option: str, address: str) -> str:
    """`address` (host:port) unless its port is a number beyond 65535, which gRPC would bind modulo
    65536 (127.0.0.1:99999 served on 34463); ValueError naming `option` otherwise."""
    port = tcp_port(address)
    if port is not None and port > 65535:
        raise ValueError(f"{option} {address}: the port must be 0 (a free one) to 65535")
    return address


def data_dir_from_env() -> str:
    """BC_DATA_DIR alone: what the client reads, so a malformed server variable never breaks it."""
    return os.environ.get("BC_DATA_DIR", ".dev")


@dataclass(frozen=True)
class Settings:
    # An external PostgreSQL; when empty the process starts the embedded one under data_dir.
    database_url: str = field(default_factory=lambda: os.environ.get("DATABASE_URL", ""),
                              repr=False)  # may carry a password: never in a printed Settings
    data_dir: str = field(default_factory=data_dir_from_env)
    listen: str = field(default_factory=lambda: os.environ.get("BC_LISTEN", "127.0.0.1:50051"))
    log_format: str = field(default_factory=lambda: os.environ.get("BC_LOG_FORMAT", "console"))
    # Random pick among the best topN candidate nodes, so concurrent creates spread out.
    placement_top_n: int = field(default_factory=lambda: env_int("BC_PLACEMENT_TOP_N", 3))
    # The SQL shortlist: how many nodes are planned in Python per attempt.
    placement_shortlist: int = field(
        default_factory=lambda: env_int("BC_PLACEMENT_SHORTLIST", 24)
    )
    placement_max_attempts: int = 5
    # Preemption: the most victim sets tried per node when a regular reservation looks for the
    # fewest spot reservations to preempt there (sets of one victim first, then two, ...); past it
    # the node's victims are found greedily.
    preempt_max_sets_per_node: int = field(default_factory=lambda: env_int("BC_PREEMPT_MAX_SETS_PER_NODE", 256))
    # A pool's policy.spotNoticeSeconds, at most this (INVALID_INPUT policy.spotNoticeSeconds beyond).
    max_spot_notice_seconds: int = field(default_factory=lambda: env_int("BC_MAX_SPOT_NOTICE_SECONDS", 86_400))
    # The most nodes one gang reservation may ask for (the spec's range is 2 to 64).
    max_gang_size: int = field(default_factory=lambda: env_int("BC_MAX_GANG_SIZE", 64))
    # Parsed Cedar policy sets kept per process (one per tenant and policy version).
    policy_cache_entries: int = field(
        default_factory=lambda: env_int("BC_POLICY_CACHE_ENTRIES", 1024)
    )
    # The in-memory capacity index plans creates; off: the SQL shortlist plans every one.
    placement_index: bool = field(
        default_factory=lambda: os.environ.get("BC_PLACEMENT_INDEX", "on").lower() not in ("off", "0", "false")
    )
    pending_retry_seconds: float = field(
        default_factory=lambda: env_float("BC_PENDING_RETRY_SECONDS", 30)
    )
    # The shortest time between two wake-up retries of one pool's pending reservations (the
    # wake-ups in between are coalesced into the next, never lost): a node flipping its inventory
    # or capabilities in a loop woke a retry of its whole pool per message. 0: unpaced.
    pending_wake_seconds: float = field(
        default_factory=lambda: env_float("BC_PENDING_WAKE_SECONDS", 1)
    )
    # The longest a create holds its answer for wait.timeoutMs (spec: capped at 30 seconds).
    create_wait_cap_seconds: float = field(
        default_factory=lambda: env_float("BC_CREATE_WAIT_CAP_SECONDS", 30)
    )
    db_pool_size: int = field(default_factory=lambda: env_int("BC_DB_POOL_SIZE", 16))
    # A work item whose handler failed this many times is dead: kept for operators, never retried.
    work_max_attempts: int = field(default_factory=lambda: env_int("BC_WORK_MAX_ATTEMPTS", 20))
    # Work items handled at once per process, each in its own transaction (the passes of one
    # reservation still take turns on its row lock); each holds a pool connection while it runs.
    # As many as the pool's connections: while the worker has a backlog, API calls take turns with
    # its passes for connections, so placed -> active stays bounded under a burst of creates
    # (docs/benchmarks-fleet.md, "Round 4"). No handler takes a second connection of the pool.
    work_concurrency: int = field(default_factory=lambda: env_int("BC_WORK_CONCURRENCY", 16))
    # After each full garbage collection the survivors (the capacity index, caches, imports) are
    # frozen, so the next one scans only what came since; this often they are unfrozen, so one full
    # collection frees what became garbage meanwhile (controlplane.common.gc_pauses). Only a process
    # that is the control plane (serve, the dev stack) does this, never one that embeds it. 0: no freezing.
    gc_unfreeze_seconds: float = field(default_factory=lambda: env_float("BC_GC_UNFREEZE_SECONDS", 600))
    # The work queue's safety poll: each runner re-reads when its next item is due at least this
    # often, though the NOTIFY bc_work that comes with every new item already tells it.
    work_safety_poll_seconds: float = field(
        default_factory=lambda: env_float("BC_WORK_SAFETY_POLL_SECONDS", 30)
    )
    # Attested bindings (spec P14): only node-signed AllocationBound reports count as bound.
    attested_bindings: bool = field(default_factory=lambda: _bool("BC_ATTESTED_BINDINGS", True))
    # Dev and test only: lets the admin API move compute_now() forward.
    clock_control: bool = field(default_factory=lambda: _bool("BC_CLOCK_CONTROL"))
    # Limits on input (README "Limits"). Times: a start at most this far ahead of compute_now(),
    # a reservation (after any extension) at most this long.
    max_start_ahead_days: int = field(default_factory=lambda: env_int("BC_MAX_START_AHEAD_DAYS", 365))
    max_reservation_days: int = field(default_factory=lambda: env_int("BC_MAX_RESERVATION_DAYS", 366))
    # How far ahead an earliest-fit start is searched: the default horizon and the most one may ask.
    earliest_horizon_days: int = field(default_factory=lambda: env_int("BC_EARLIEST_HORIZON_DAYS", 14))
    max_earliest_horizon_days: int = field(default_factory=lambda: env_int("BC_MAX_EARLIEST_HORIZON_DAYS", 60))
    # Node checks one request's earliest-fit search makes at most (a node planned at a start; the
    # index, the rows and the pool without spot work share them); past it the search answers no
    # start, so no request keeps the event loop busy for long.
    earliest_max_checks: int = field(default_factory=lambda: env_int("BC_EARLIEST_MAX_CHECKS", 20000))
    # How long a preview (or a create with start "earliest") waits for the capacity index to hold
    # every change committed before it; past that it plans on the index as it is.
    preview_index_wait_seconds: float = field(
        default_factory=lambda: env_float("BC_PREVIEW_INDEX_WAIT_SECONDS", 5))
    # Every string field of every request, in characters (a policy's Cedar text has its own cap).
    max_string_chars: int = field(default_factory=lambda: env_int("BC_MAX_STRING_CHARS", 4096))
    max_policy_chars: int = field(default_factory=lambda: env_int("BC_MAX_POLICY_CHARS", 65536))
    # Brackets nested in a policy's Cedar text: Cedar's parser recurses per bracket, and a deep
    # nesting overflows the process's stack (a crash, not an error).
    max_policy_nesting: int = field(default_factory=lambda: env_int("BC_MAX_POLICY_NESTING", 64))
    # Every repeated and map field of every request (labels, selectors, event types, GPUs, ...).
    max_list_entries: int = field(default_factory=lambda: env_int("BC_MAX_LIST_ENTRIES", 64))
    # One request message's serialized size: beyond it INVALID_INPUT (reason request-too-large).
    # gRPC itself receives messages up to 16 times this (api.interceptor.server_options), so the
    # refusal carries ErrorInfo, and refuses larger ones with a bare RESOURCE_EXHAUSTED: no request
    # makes the server hold more than that ceiling.
    max_request_bytes: int = field(default_factory=lambda: env_int("BC_MAX_REQUEST_BYTES", 1 << 20))
    # A request's metadata (its headers' names and values, authorization and x-request-id among
    # them), likewise: INVALID_INPUT (reason metadata-too-large) beyond it, grpc's refusal beyond 16 times.
    max_metadata_bytes: int = field(default_factory=lambda: env_int("BC_MAX_METADATA_BYTES", 8192))
    # Drafts (refused or abandoned creates) are deleted after this window; an identity holds at
    # most max_drafts_per_identity live ones (requests awaiting confirmation count too).
    draft_retention_hours: float = field(
        default_factory=lambda: env_float("BC_DRAFT_RETENTION_HOURS", 24)
    )
    max_drafts_per_identity: int = field(default_factory=lambda: env_int("BC_MAX_DRAFTS_PER_IDENTITY", 1000))
    # Slots per GPU a time-slice or mps pool may set (policy.sharing.replicas).
    max_sharing_replicas: int = field(default_factory=lambda: env_int("BC_MAX_SHARING_REPLICAS", 64))
    # Node reports about an allocation that ended (released or failed) are deleted this long after
    # they arrived (they are never judged; the evidence a binding relied on is on the allocation),
    # by a sweep this often.
    report_retention_hours: float = field(
        default_factory=lambda: env_float("BC_REPORT_RETENTION_HOURS", 24)
    )
    report_sweep_seconds: float = field(default_factory=lambda: env_float("BC_REPORT_SWEEP_SECONDS", 300))
    draft_sweep_seconds: float = field(
        default_factory=lambda: env_float("BC_DRAFT_SWEEP_SECONDS", 60)
    )
    # Webhooks. Targets must resolve to public addresses; the allowlist (CIDRs) is the only way to
    # reach a loopback, private, link-local or otherwise local address (tests, a dev receiver).
    webhook_allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(
        default_factory=lambda: _networks("BC_WEBHOOK_ALLOW")
    )
    # The whole attempt: resolving, connecting, TLS, sending and reading the answer's status line.
    webhook_attempt_seconds: float = field(
        default_factory=lambda: env_float("BC_WEBHOOK_ATTEMPT_SECONDS", 10)
    )
    # Attempts in flight per process, and per tenant across all processes.
    webhook_concurrency: int = field(default_factory=lambda: env_int("BC_WEBHOOK_CONCURRENCY", 8))
    webhook_tenant_concurrency: int = field(
        default_factory=lambda: env_int("BC_WEBHOOK_TENANT_CONCURRENCY", 2)
    )
    webhooks_per_tenant: int = field(default_factory=lambda: env_int("BC_WEBHOOKS_PER_TENANT", 20))
    # API tokens: the lifetime of a token minted without an explicit expiry, and the longest
    # lifetime root may ask for.
    token_ttl_seconds: int = field(default_factory=lambda: env_int("BC_TOKEN_TTL_SECONDS", 2592000))
    token_max_ttl_seconds: int = field(
        default_factory=lambda: env_int("BC_TOKEN_MAX_TTL_SECONDS", 31622400)
    )
    # Open Events.Watch streams per identity and per tenant (in each API process).
    watch_streams_per_identity: int = field(
        default_factory=lambda: env_int("BC_WATCH_STREAMS_PER_IDENTITY", 16)
    )
    watch_streams_per_tenant: int = field(
        default_factory=lambda: env_int("BC_WATCH_STREAMS_PER_TENANT", 128)
    )
    # How long one Watch message may wait for a consumer that does not read before the stream ends.
    watch_send_seconds: float = field(
        default_factory=lambda: env_float("BC_WATCH_SEND_SECONDS", 60)
    )
    # TLS for the API listener: PEM certificate chain and key files; both empty means plaintext.
    tls_cert: str = field(default_factory=lambda: os.environ.get("BC_TLS_CERT", ""))
    tls_key: str = field(default_factory=lambda: os.environ.get("BC_TLS_KEY", ""))
    # Prometheus metrics at GET /metrics on this host:port (port 0 picks a free one); empty: off.
    metrics_listen: str = field(default_factory=lambda: os.environ.get("BC_METRICS_LISTEN", ""))
    # The gauges read from the database are refreshed at scrape time, at most this often.
    metrics_refresh_seconds: float = field(
        default_factory=lambda: env_float("BC_METRICS_REFRESH_SECONDS", 5)
    )
    # The placer of a pool created without policy.placer: "inline" or "lease".
    default_placer: str = field(default_factory=lambda: os.environ.get("BC_DEFAULT_PLACER", "inline"))
    # The pool-lease placer: a lease lasts this long and is renewed every third of it, so a killed
    # holder's pools have a new holder within about this time.
    placer_lease_seconds: float = field(
        default_factory=lambda: env_float("BC_PLACER_LEASE_SECONDS", 5)
    )
    # Queued reservations a lease holder plans and commits in one transaction.
    placer_batch: int = field(default_factory=lambda: env_int("BC_PLACER_BATCH", 64))
    # Host resources: the capacity.hosts reconciler's pass (inventory also syncs its host at once),
    # and the most a request's resources may ask per node (README "Limits").
    host_sync_seconds: float = field(default_factory=lambda: env_float("BC_HOST_SYNC_SECONDS", 30))
    max_host_vcpu: int = field(default_factory=lambda: env_int("BC_MAX_HOST_VCPU", 4096))
    max_host_memory_gib: int = field(default_factory=lambda: env_int("BC_MAX_HOST_MEMORY_GIB", 65536))
    # A node's cpulists (its NUMA nodes' CPUs, isolated CPUs) are read within these bounds; a longer
    # list reads as empty, so an oversized one cannot stall the control plane.
    cpulist_max_cpu: int = field(default_factory=lambda: env_int("BC_CPULIST_MAX_CPU", 8191))
    cpulist_max_chars: int = field(default_factory=lambda: env_int("BC_CPULIST_MAX_CHARS", 32 * 1024))
    cpulist_max_parts: int = field(default_factory=lambda: env_int("BC_CPULIST_MAX_PARTS", 4096))
    # Every string field of what a node sends (session messages, enrolment, a report body), in
    # characters; a NUL in any of them is refused too. Above the cpulist bound, so a longer cpulist
    # still reads as empty rather than being refused.
    node_max_string_chars: int = field(default_factory=lambda: env_int("BC_NODE_MAX_STRING_CHARS", 64 * 1024))
    # Every repeated field of what a node sends (GPUs, NUMA nodes, MIG instances, capabilities, ...).
    node_max_entries: int = field(default_factory=lambda: env_int("BC_NODE_MAX_ENTRIES", 256))
    # The most memory a node may report (host, each NUMA node, huge pages); beyond it, or negative,
    # it reads as 0 (as vCPUs beyond the cpulist's CPU ids do), so no host share overflows.
    node_max_memory_bytes: int = field(default_factory=lambda: env_int("BC_NODE_MAX_MEMORY_BYTES", 2**50))
    # Whole-machine leases (binding "node"): how long metal has, from the lease's start, to see the
    # profile deployed and verified on the machine before the reservation fails (no second placement).
    metal_deploy_timeout_seconds: float = field(
        default_factory=lambda: env_float("BC_METAL_DEPLOY_TIMEOUT_SECONDS", 7200)
    )
    # Operator-managed node profiles: how many may exist, and versions per profile.
    node_profiles_max: int = field(default_factory=lambda: env_int("BC_NODE_PROFILES_MAX", 1000))
    node_profile_versions_max: int = field(default_factory=lambda: env_int("BC_NODE_PROFILE_VERSIONS_MAX", 100))
    # Provider reservations, grants, instances, metering (spec 001; README "Limits").
    # Every call to a provider's API has this deadline (a stalled provider fails, it does not hang).
    provider_call_seconds: float = field(
        default_factory=lambda: env_float("BC_PROVIDER_CALL_SECONDS", 10)
    )
    # The vps.reservations scan of every provider account runs this often (and on demand).
    provider_scan_seconds: float = field(
        default_factory=lambda: env_float("BC_PROVIDER_SCAN_SECONDS", 60)
    )
    # A grant's start may be at most this far in the past (spec: 5 minutes), at most
    # grant_start_ahead_days ahead, and its term at most grant_max_days long.
    grant_start_past_seconds: int = field(default_factory=lambda: env_int("BC_GRANT_START_PAST_SECONDS", 300))
    grant_start_ahead_days: int = field(default_factory=lambda: env_int("BC_GRANT_START_AHEAD_DAYS", 365))
    grant_max_days: int = field(default_factory=lambda: env_int("BC_GRANT_MAX_DAYS", 1096))
    # reservationGrants.list answers at most this many (spec: 1000).
    grants_list_max: int = field(default_factory=lambda: env_int("BC_GRANTS_LIST_MAX", 1000))
    # Live (not deleted) instances per tenant; usage rows per query.
    instances_per_tenant: int = field(default_factory=lambda: env_int("BC_INSTANCES_PER_TENANT", 1000))
    # Projects per tenant (there is no project delete): one more is QUOTA_EXCEEDED.
    projects_per_tenant: int = field(default_factory=lambda: env_int("BC_PROJECTS_PER_TENANT", 1000))
    usage_query_max_rows: int = field(default_factory=lambda: env_int("BC_USAGE_QUERY_MAX_ROWS", 10000))
    # The metering reconcilers run this often; an hour is metered once it ended this long ago
    # (so a state change handled late by the work queue is in before its hour is written).
    metering_seconds: float = field(default_factory=lambda: env_float("BC_METERING_SECONDS", 60))
    metering_settle_seconds: int = field(default_factory=lambda: env_int("BC_METERING_SETTLE_SECONDS", 120))
