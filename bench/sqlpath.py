"""The database floor: the write path of a create as three psycopg transactions, nothing else.

Per "create", against scratch tables in a schema of their own (dropped afterwards):
  Tx 1: insert a draft-like row if absent, read it back;
  Tx 2: a read-only transaction that reads the row (where the server asks IAM);
  Tx 3: lock the row, insert one booking per GPU into a table with the same
        EXCLUDE USING gist (atom WITH =, during WITH &&) constraint as `bookings`
        (a conflict rolls back to a savepoint and tries another node), update the row.
The requests come from the same generator as the gRPC creates (GPUs, start, duration).
With `pool_lock`, Tx 3 first takes one advisory lock, as a single-pool placer would.
"""

from __future__ import annotations

import asyncio
import json
import random

import psycopg
from psycopg_pool import AsyncConnectionPool

from bench.creates import Workload, make_request
from bench.load import Call
from controlplane.ids import draft_id, request_hash

SETUP = """
DROP SCHEMA IF EXISTS bench_scratch CASCADE;
CREATE SCHEMA bench_scratch;
CREATE TABLE bench_scratch.drafts (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL,
    idempotency_key text NOT NULL,
    request         jsonb NOT NULL,
    request_hash    text NOT NULL,
    state           text NOT NULL DEFAULT 'draft',
    during          tstzrange,
    version         bigint NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE bench_scratch.bookings (
    atom_id  bigint NOT NULL,
    draft_id text NOT NULL REFERENCES bench_scratch.drafts (id) ON DELETE CASCADE,
    during   tstzrange NOT NULL,
    CONSTRAINT scratch_no_overlap EXCLUDE USING gist (atom_id WITH =, during WITH &&)
);
CREATE INDEX ON bench_scratch.bookings (draft_id);
"""
TEARDOWN = "DROP SCHEMA IF EXISTS bench_scratch CASCADE"

INSERT_DRAFT = """
INSERT INTO bench_scratch.drafts (id, tenant_id, idempotency_key, request, request_hash)
VALUES (%(id)s, %(tenant)s, %(key)s, %(request)s, %(hash)s) ON CONFLICT (id) DO NOTHING
"""
READ_DRAFT = "SELECT state, request_hash, version, request FROM bench_scratch.drafts WHERE id = %(id)s"
LOCK_DRAFT = "SELECT version FROM bench_scratch.drafts WHERE id = %(id)s FOR UPDATE"
INSERT_BOOKINGS = """
INSERT INTO bench_scratch.bookings (atom_id, draft_id, during)
SELECT atom, %(id)s, tstzrange(to_timestamp(%(start)s / 1000.0), to_timestamp(%(end)s / 1000.0))
FROM unnest(%(atoms)s::bigint[]) AS atom
"""
PLACE_DRAFT = """
UPDATE bench_scratch.drafts
SET state = 'placed', version = version + 1, updated_at = clock_timestamp(),
    during = tstzrange(to_timestamp(%(start)s / 1000.0), to_timestamp(%(end)s / 1000.0))
WHERE id = %(id)s AND version = %(version)s
"""
_RETRY = ("40P01", "40001")  # deadlock_detected, serialization_failure: run the transaction again


def setup(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(SETUP)


def teardown(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(TEARDOWN)


async def open_pool(conninfo: str, size: int) -> AsyncConnectionPool:
    pool = AsyncConnectionPool(conninfo, min_size=size, max_size=size, open=False)
    await pool.open(wait=True, timeout=30)
    return pool


def sql_call(pool: AsyncConnectionPool, work: Workload, *, nodes: int, gpus_per_node: int,
             now_ms: int, pool_lock: bool = False) -> Call:
    async def call(number: int) -> str:
        req = make_request(work, number, now_ms)
        gpus = req.devices[0].count
        hours = int(req.duration.rstrip("h"))
        request = {"devices": [{"class": "gpu", "count": gpus, "topology": req.devices[0].topology}],
                   "duration": f"{hours * 3_600_000}ms", "start": req.start, "poolId": work.pool_id}
        args = {"id": draft_id(work.tenant_id, "bench-user", req.idempotency_key),
                "tenant": work.tenant_id, "key": req.idempotency_key,
                "request": json.dumps(request), "hash": request_hash(request),
                "start": req.start, "end": req.start + hours * 3_600_000}

        async with pool.connection() as conn:  # Tx 1
            async with conn.transaction():
                await conn.execute(INSERT_DRAFT, args)
                await (await conn.execute(READ_DRAFT, args)).fetchone()
        async with pool.connection() as conn:  # Tx 2
            async with conn.transaction():
                await conn.execute("SET TRANSACTION READ ONLY")
                await (await conn.execute(READ_DRAFT, args)).fetchone()
        for attempt in range(5):  # Tx 3
            try:
                async with pool.connection() as conn:
                    return await _place(conn, args, number, gpus, nodes, gpus_per_node, pool_lock)
            except psycopg.errors.OperationalError as exc:
                if exc.sqlstate not in _RETRY or attempt == 4:
                    raise
                await asyncio.sleep(0.002 * (attempt + 1))
        raise AssertionError("unreachable")

    return call


async def _place(conn: psycopg.AsyncConnection, args: dict, number: int, gpus: int,
                 nodes: int, gpus_per_node: int, pool_lock: bool) -> str:
    rng = random.Random(number)
    async with conn.transaction():
        if pool_lock:
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('bench-pool'))")
        version = (await (await conn.execute(LOCK_DRAFT, args)).fetchone())[0]
        for _ in range(5):
            node = rng.randrange(nodes)
            first = node * gpus_per_node + rng.randrange(gpus_per_node - gpus + 1)
            try:
                async with conn.transaction():  # a savepoint: a conflict undoes only this node
                    await conn.execute(INSERT_BOOKINGS, {**args, "atoms": list(range(first, first + gpus))})
            except psycopg.errors.ExclusionViolation:
                continue
            await conn.execute(PLACE_DRAFT, {**args, "version": version})
            return "placed"
    return "pending"
