"""PKI settings, read once from the environment; every default runs on a laptop."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from controlplane.config import env_float, env_int
from datetime import timedelta

from controlplane.pki import NODE_ROLES

DEFAULT_CLOCK_SKEW_SECONDS = 300.0


def _roles() -> frozenset[str]:
    raw = os.environ.get("BC_ATTEST_ROLES", "")
    return frozenset(r.strip() for r in raw.split(",") if r.strip()) or NODE_ROLES


@dataclass(frozen=True)
class PkiSettings:
    # Node certificates are short-lived; nodes renew over their session past half the life.
    node_cert_hours: float = field(default_factory=lambda: env_float("BC_NODE_CERT_HOURS", 24))
    # A gateway's server certificate; the gateway renews it in place past half its life.
    gateway_cert_hours: float = field(
        default_factory=lambda: env_float("BC_GATEWAY_CERT_HOURS", 24)
    )
    ca_years: int = 10
    # Certificate pairs one node may be issued by renewal in an hour, across every gateway (each
    # gateway paces renewals in memory too, per process); past it Renew is QUOTA_EXCEEDED. 0: none.
    node_renewals_per_hour: int = field(default_factory=lambda: env_int("BC_NODE_CERTS_PER_HOUR", 60))
    # A report signed by a certificate that expired at most this long ago still counts (a node
    # that was offline sends what it signed before its certificate ran out).
    offline_grace_seconds: float = field(
        default_factory=lambda: env_float("BC_ATTEST_OFFLINE_GRACE_SECONDS", 3600)
    )
    # How far a report's signing time may be ahead of the control plane's clock, or before its
    # signing certificate was issued, and still count.
    report_clock_skew_seconds: float = field(
        default_factory=lambda: env_float("BC_REPORT_CLOCK_SKEW_SECONDS", DEFAULT_CLOCK_SKEW_SECONDS)
    )
    # The certificate roles whose nodes run workloads, so whose reports can bind an allocation.
    workload_roles: frozenset[str] = field(default_factory=_roles)
    # When set, the CA key is stored encrypted with it (it must then be set for every process).
    ca_passphrase: str = field(default_factory=lambda: os.environ.get("BC_CA_KEY_PASSPHRASE", ""),
                               repr=False)  # a secret: never in a printed PkiSettings

    @property
    def offline_grace(self) -> timedelta:
        return timedelta(seconds=self.offline_grace_seconds)

    @property
    def report_clock_skew(self) -> timedelta:
        return timedelta(seconds=self.report_clock_skew_seconds)
