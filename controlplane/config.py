"""Settings, read once from the environment. Every knob has a default that runs on a laptop."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    return default if raw is None else raw.strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Settings:
    # An external PostgreSQL; when empty the process starts the embedded one under data_dir.
    database_url: str = field(default_factory=lambda: os.environ.get("DATABASE_URL", ""))
    data_dir: str = field(default_factory=lambda: os.environ.get("BC_DATA_DIR", ".dev"))
    listen: str = field(default_factory=lambda: os.environ.get("BC_LISTEN", "127.0.0.1:50051"))
    log_format: str = field(default_factory=lambda: os.environ.get("BC_LOG_FORMAT", "console"))
    # Random pick among the best topN candidate nodes, so concurrent creates spread out.
    placement_top_n: int = field(default_factory=lambda: int(os.environ.get("BC_PLACEMENT_TOP_N", "3")))
    # The SQL shortlist: how many nodes are planned in Python per attempt.
    placement_shortlist: int = field(
        default_factory=lambda: int(os.environ.get("BC_PLACEMENT_SHORTLIST", "24"))
    )
    placement_max_attempts: int = 5
    pending_retry_seconds: float = field(
        default_factory=lambda: float(os.environ.get("BC_PENDING_RETRY_SECONDS", "30"))
    )
    db_pool_size: int = field(default_factory=lambda: int(os.environ.get("BC_DB_POOL_SIZE", "16")))
    # Attested bindings (spec P14): only node-signed AllocationBound reports count as bound.
    attested_bindings: bool = field(default_factory=lambda: _bool("BC_ATTESTED_BINDINGS", True))
    # Dev and test only: lets the admin API move compute_now() forward.
    clock_control: bool = field(default_factory=lambda: _bool("BC_CLOCK_CONTROL"))
    # API tokens: the lifetime of a token minted without an explicit expiry, and the longest
    # lifetime root may ask for.
    token_ttl_seconds: int = field(default_factory=lambda: int(os.environ.get("BC_TOKEN_TTL_SECONDS", "2592000")))
    token_max_ttl_seconds: int = field(
        default_factory=lambda: int(os.environ.get("BC_TOKEN_MAX_TTL_SECONDS", "31622400"))
    )
    # Open Events.Watch streams per identity and per tenant (in each API process).
    watch_streams_per_identity: int = field(
        default_factory=lambda: int(os.environ.get("BC_WATCH_STREAMS_PER_IDENTITY", "16"))
    )
    watch_streams_per_tenant: int = field(
        default_factory=lambda: int(os.environ.get("BC_WATCH_STREAMS_PER_TENANT", "128"))
    )
    # TLS for the API listener: PEM certificate chain and key files; both empty means plaintext.
    tls_cert: str = field(default_factory=lambda: os.environ.get("BC_TLS_CERT", ""))
    tls_key: str = field(default_factory=lambda: os.environ.get("BC_TLS_KEY", ""))
