"""What every domain entry point needs: the connection pool, the settings and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from psycopg_pool import AsyncConnectionPool

from controlplane.common.seen_pools import SeenPools
from controlplane.config import Settings
from controlplane.metrics import Metrics
from controlplane.placement.index_sync import CapacityIndex
from controlplane.placement.lease import LeaseWorker


@dataclass(frozen=True)
class Runtime:
    pool: AsyncConnectionPool
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)  # the process's own registry
    capacity: CapacityIndex | None = None  # the placement engine's index (None: plan with SQL)
    leases: LeaseWorker | None = None  # the pool-lease placer's worker (and the waits it wakes)
    seen_pools: SeenPools = field(default_factory=SeenPools)  # pools as tenants saw them (draft_ahead)
