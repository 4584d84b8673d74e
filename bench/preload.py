"""`--bookings N`: a pool that is already busy. N bookings over the calendar horizon, written in a
few set-based statements instead of N creates, and consistent with everything a create writes.

How: a second tenant (`bench-preload`, offered the pool, its own quota and policy) makes four real
reservations through the API, of 1, 2, 4 and 8 GPUs, placed beyond the horizon. Every preloaded
reservation is a copy of one of them (`jsonb_populate_record` keeps every column, also columns a
later migration adds, and overrides the ids, the window and the node): its reservation row, IAM
projection, quota charge, allocation, bookings, `reservation.placed` event and work items. The ids
are the ones the server would derive (`draft_id`, `new_id`). Only the bookings are generated from
the atoms. The quota charges are the preload tenant's, so the benchmark tenant's quota sum stays
what it was (`--bookings-tenant bench` charges the benchmark tenant instead).

Layout: the horizon of each node is cut into S equal slots, S = N / (8 x nodes) rounded up; each
slot books all 8 GPUs for its first `fill` share (as one 8-GPU reservation, or 4+4, 4+2+2 or
4+2+1+1, in turn), and the slots of node i are shifted by i/nodes of a slot so that no window is
busy on every node at once. With 1,000 nodes and 1,000,000 bookings that is 125 slots of 11.5 h
per node, each booked for 2.9 h (fill 0.25). Windows start 70 minutes out, so no reconciler
deadline falls inside a run.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass

import grpc
import psycopg

from bench.seed import MODEL, QUOTA, bearer
from bettercompute.v1 import admin_pb2 as a
from bettercompute.v1 import admin_pb2_grpc
from bettercompute.v1 import reservations_pb2 as r
from bettercompute.v1 import reservations_pb2_grpc
from controlplane.ids import draft_id, new_id

TENANT = "bench-preload"
IDENTITY = "bench-preload-user"
GPUS_PER_NODE = 8
FIRST_START_MS = 70 * 60_000
# Ways one slot's 8 GPUs are split into reservations: (first GPU on the node, count).
PATTERNS = (((0, 8),), ((0, 4), (4, 4)), ((0, 4), (4, 2), (6, 2)), ((0, 4), (4, 2), (6, 1), (7, 1)))
WAIT_MS = 30_000
QUOTA_LIMIT = 10**9  # far above any preload (a GPU per booking), and within a 32-bit integer


@dataclass
class Preloaded:
    bookings: int
    reservations: int
    tenant_id: str
    seconds: float
    slot_hours: float
    booked_hours: float


@dataclass(frozen=True)
class Layout:
    slots: int
    slot_ms: int
    duration_ms: int


def layout(bookings: int, nodes: int, horizon_ms: int, fill: float) -> Layout:
    slots = max(1, math.ceil(bookings / (GPUS_PER_NODE * nodes)))
    slot_ms = horizon_ms // slots
    duration_ms = max(60_000, int(slot_ms * fill) // 60_000 * 60_000)
    return Layout(slots, slot_ms, min(duration_ms, slot_ms))


def plan_rows(bookings: int, node_ids: list[str], tenant: str, identity: str, now_ms: int,
              lay: Layout, run_id: str):
    """(reservation id, key, allocation id, node id, first GPU, count, start ms) per reservation,
    slot by slot over all nodes, until `bookings` bookings (the last slot may stop short)."""
    written = 0
    nodes = len(node_ids)
    number = 0
    for k in range(lay.slots):
        for i, node_id in enumerate(node_ids):
            start = now_ms + FIRST_START_MS + (i * lay.slot_ms) // nodes + k * lay.slot_ms
            for first, count in PATTERNS[k % len(PATTERNS)]:
                if written >= bookings:
                    return
                key = f"{run_id}-{number:08d}"
                yield (draft_id(tenant, identity, key), key, new_id("alloc"), node_id, first, count, start)
                written += count
                number += 1


async def make_templates(channel: grpc.aio.Channel, root_token: str, pool_id: str, *, charge_tenant: str,
                         start_ms: int, duration_ms: int, placer: str) -> tuple[str, str, dict[int, str]]:
    """The preload tenant (or the benchmark tenant) and one placed reservation per GPU count."""
    admin = admin_pb2_grpc.AdminStub(channel)
    md = bearer(root_token)
    tenant, identity = charge_tenant, IDENTITY
    if tenant == TENANT:
        await admin.CreateTenant(a.CreateTenantRequest(id=TENANT, name="Benchmark preload"), metadata=md)
        await admin.CreateIdentity(a.CreateIdentityRequest(id=IDENTITY, kind="user", name="Preload user",
                                                           tenant_ids=[TENANT]), metadata=md)
        await admin.OfferPool(a.OfferPoolRequest(pool_id=pool_id, tenant_id=TENANT), metadata=md)
        for resource in QUOTA:
            await admin.SetQuota(a.SetQuotaRequest(tenant_id=TENANT, resource=resource, limit=QUOTA_LIMIT),
                                 metadata=md)
        await admin.PutPolicy(a.PutPolicyRequest(tenant_id=TENANT, cedar="permit(principal, action, resource);"),
                              metadata=md)
    else:
        await admin.CreateIdentity(a.CreateIdentityRequest(id=IDENTITY, kind="user", name="Preload user",
                                                           tenant_ids=[tenant]), metadata=md)
    token = (await admin.CreateToken(a.CreateTokenRequest(identity_id=IDENTITY), metadata=md)).secret
    stub = reservations_pb2_grpc.ReservationsStub(channel)
    templates = {}
    for count in sorted({c for pattern in PATTERNS for _, c in pattern}):
        reply = await stub.Create(r.CreateReservationRequest(
            tenant_id=tenant, pool_id=pool_id, duration_ms=duration_ms, start=start_ms,
            devices=[r.DeviceRequest(device_class="gpu", count=count, model=MODEL)],
            idempotency_key=f"preload-template-{count}",
            wait=r.Wait(timeout_ms=WAIT_MS) if placer == "lease" else None,
        ), metadata=bearer(token), timeout=60)
        if reply.state != "placed":
            raise RuntimeError(f"preload template of {count} GPUs is {reply.state!r}, not placed")
        templates[count] = reply.id
    return tenant, identity, templates


PLAN_TABLE = """
CREATE TEMP TABLE preload_plan (
    rid text, key text, alloc_id text, node_id text, first int, count int, start_ms bigint
) ON COMMIT DROP
"""

# The window as a range, and each node's GPUs numbered 0-7 in NUMA order.
PREPARE = """
CREATE TEMP TABLE preload_rows ON COMMIT DROP AS
SELECT p.*, t.id AS template,
       tstzrange(from_epoch_ms(p.start_ms), from_epoch_ms(p.start_ms + %(duration)s), '[)') AS during,
       (p.start_ms - epoch_ms(lower(t.during))) * interval '1 millisecond' AS shift
FROM preload_plan p JOIN reservations t ON t.id = (%(templates)s::jsonb ->> p.count::text);
CREATE TEMP TABLE preload_atoms ON COMMIT DROP AS
SELECT a.id, a.node_id, a.device_uuid,
       row_number() OVER (PARTITION BY a.node_id ORDER BY a.numa_node, a.device_uuid, a.id)::int - 1 AS gpu
FROM atoms a JOIN nodes n ON n.id = a.node_id
WHERE n.pool_id = %(pool)s AND a.kind = 'gpu';
CREATE INDEX ON preload_atoms (node_id, gpu);
ANALYZE preload_rows;
ANALYZE preload_atoms;
"""

COPY_STATEMENTS = (
    # The reservation: the template's row with its own id, key, window and request start.
    """
    INSERT INTO reservations
    SELECT (jsonb_populate_record(t, jsonb_build_object(
        'id', p.rid, 'idempotency_key', p.key, 'during', p.during::text,
        'request', t.request || jsonb_build_object('start', p.start_ms),
        'request_hash', md5(p.key)))).*
    FROM preload_rows p JOIN reservations t ON t.id = p.template
    """,
    """
    INSERT INTO authz_projection
    SELECT (jsonb_populate_record(t, jsonb_build_object(
        'reservation_id', p.rid, 'attributes', t.attributes || jsonb_build_object('start', p.start_ms)))).*
    FROM preload_rows p JOIN authz_projection t ON t.reservation_id = p.template
    """,
    """
    INSERT INTO quota_charges
    SELECT (jsonb_populate_record(t, jsonb_build_object('reservation_id', p.rid))).*
    FROM preload_rows p JOIN quota_charges t ON t.reservation_id = p.template
    """,
    """
    INSERT INTO allocations
    SELECT (jsonb_populate_record(t, jsonb_build_object(
        'id', p.alloc_id, 'reservation_id', p.rid, 'node_id', p.node_id,
        'device_ids', (SELECT array_agg(pa.device_uuid ORDER BY pa.gpu) FROM preload_atoms pa
                       WHERE pa.node_id = p.node_id AND pa.gpu >= p.first AND pa.gpu < p.first + p.count)))).*
    FROM preload_rows p JOIN allocations t ON t.reservation_id = p.template
    """,
    """
    INSERT INTO bookings (atom_id, allocation_id, during)
    SELECT pa.id, p.alloc_id, p.during
    FROM preload_rows p JOIN preload_atoms pa
      ON pa.node_id = p.node_id AND pa.gpu >= p.first AND pa.gpu < p.first + p.count
    """,
    """
    INSERT INTO events (tenant_id, type, subject, data, time)
    SELECT t.tenant_id, t.type, 'reservation/' || p.rid,
           t.data || jsonb_build_object('start', p.start_ms, 'end', epoch_ms(upper(p.during)),
                                        'nodeIds', jsonb_build_array(p.node_id)),
           t.time
    FROM preload_rows p JOIN events t ON t.subject = 'reservation/' || p.template
    ORDER BY p.start_ms, t.id
    """,
    """
    INSERT INTO work_items (kind, subject, run_at)
    SELECT t.kind, p.rid, t.run_at + p.shift
    FROM preload_rows p JOIN work_items t ON t.kind = 'reservation' AND t.subject = p.template
    """,
)


def write(conninfo: str, rows, *, pool_id: str, templates: dict[int, str], duration_ms: int) -> int:
    """COPY the plan, then one INSERT ... SELECT per table, in one transaction."""
    import json

    buf = io.StringIO()
    count = 0
    for row in rows:
        buf.write("\t".join(str(v) for v in row) + "\n")
        count += 1
    with psycopg.connect(conninfo) as conn:
        conn.execute("SET LOCAL synchronous_commit = off")
        conn.execute(PLAN_TABLE)
        with conn.cursor().copy("COPY preload_plan FROM STDIN") as copy:
            copy.write(buf.getvalue())
        params = {"duration": duration_ms, "templates": json.dumps({str(k): v for k, v in templates.items()}),
                  "pool": pool_id}
        for statement in PREPARE.strip().split(";\n"):
            conn.execute(statement, params if "%(" in statement else None)
        for statement in COPY_STATEMENTS:
            conn.execute(statement)
        conn.commit()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("ANALYZE reservations, authz_projection, quota_charges, allocations, bookings, events, work_items")
    return count


@dataclass
class Prepared:
    """What the SQL step needs, made through the API while a control plane runs."""

    pool_id: str
    bookings: int
    node_ids: list[str]
    tenant: str
    identity: str
    templates: dict[int, str]
    now_ms: int
    layout: Layout
    started: float


async def prepare(channel: grpc.aio.Channel, conninfo: str, root_token: str, *, pool_id: str, bookings: int,
                  horizon_days: float, fill: float, charge_tenant: str, placer: str) -> Prepared:
    started = time.perf_counter()
    now_ms = int(time.time() * 1000)
    horizon_ms = int(horizon_days * 86_400_000)
    node_ids = [row[0] for row in _rows(conninfo, "SELECT id FROM nodes WHERE pool_id = %s ORDER BY name",
                                        (pool_id,))]
    lay = layout(bookings, len(node_ids), horizon_ms, fill)
    tenant, identity, templates = await make_templates(
        channel, root_token, pool_id, charge_tenant=charge_tenant, placer=placer,
        start_ms=now_ms + FIRST_START_MS + horizon_ms + 2 * 86_400_000, duration_ms=lay.duration_ms)
    return Prepared(pool_id, bookings, node_ids, tenant, identity, templates, now_ms, lay, started)


def preload(conninfo: str, prep: Prepared) -> Preloaded:
    """The bulk write; run it with no control plane up, so no capacity index re-reads nodes while
    it commits (the measured control planes build theirs from the rows when they start)."""
    lay = prep.layout
    rows = plan_rows(prep.bookings, prep.node_ids, prep.tenant, prep.identity, prep.now_ms, lay,
                     run_id=f"preload-{prep.now_ms}")
    reservations = write(conninfo, rows, pool_id=prep.pool_id, templates=prep.templates,
                         duration_ms=lay.duration_ms)
    written = _rows(conninfo, "SELECT count(*) FROM bookings b JOIN allocations a ON a.id = b.allocation_id "
                              "JOIN reservations r ON r.id = a.reservation_id WHERE r.tenant_id = %s",
                    (prep.tenant,))[0][0]
    return Preloaded(written, reservations, prep.tenant, time.perf_counter() - prep.started,
                     lay.slot_ms / 3_600_000, lay.duration_ms / 3_600_000)


def _rows(conninfo: str, sql: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(conninfo) as conn:
        return list(conn.execute(sql, params).fetchall())
