"""What every domain entry point needs: the connection pool and the settings."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg_pool import AsyncConnectionPool

from controlplane.config import Settings


@dataclass(frozen=True)
class Runtime:
    pool: AsyncConnectionPool
    settings: Settings
