"""SQL of the pool-lease placer's side of the reservation lifecycle (controlplane/reservations/queued.py)
and of a lease-policy pool's admission: the queued admit, a batch's locked read and its one-statement
outcome. The reservation columns and views are the reservations queries' own."""

from controlplane.reservations.queries import ALLOCATIONS_JSON, CLOCK_NOW, COLUMNS

# Transaction 2 of an allowed create in a lease-policy pool, one statement (migration 0028):
# 'queued', or 'missing' / 'decided' when the row is no longer the undecided draft it was.
ADMIT_QUEUED = """
SELECT admit_queued(%(id)s, %(version)s, %(decision)s, %(undecided)s, %(from_states)s,
                    %(resources)s::text[], %(amounts)s::bigint[], %(pers)s::bigint[], %(lenient)s::boolean[],
                    %(unnamed)s::text[]) AS outcome
"""

# A batch: the pool lock, the fencing check (this holder's lease at this epoch) and the clock read
# once the lock is held (migration 0045: compute_now() would be the transaction's start, before
# any wait for the lock), then the oldest queued reservations of the pool, locked; rows a cancel
# or release holds are skipped (the next batch sees what is left of them). No row when the lease
# is no longer this holder's.
QUEUED_BATCH = """
WITH pool_lock AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended(%(lock_key)s, 0))),
fence AS MATERIALIZED (SELECT lease_current(%(pool_id)s, %(holder)s, %(epoch)s) AS current,
                              epoch_ms(compute_now_fresh()) AS now_ms
                       FROM pool_lock)
SELECT r.id, r.tenant_id, r.pool_id, r.state, r.request, r.conditions, fence.now_ms
FROM fence, reservations r
WHERE fence.current AND r.pool_id = %(pool_id)s AND r.state = 'queued'
ORDER BY r.created_at, r.id
LIMIT %(limit)s
FOR UPDATE OF r SKIP LOCKED
"""

# A batch's outcome in one statement: every member moved from queued (placed with its window and
# lease deadline, or pending with its Unschedulable condition), the placed ones' wake-ups (the
# lease deadline's among them: leaseSeconds counted here, as _PLACED_LEASE does, the batch's own
# reckoning a floor), one
# event each in the batch's order, watchers woken, and the waiting creates told (bc_placed, ids
# in chunks well under the 8000-byte payload limit). The fencing check again, at the end: a holder
# whose lease was taken over meanwhile moves nothing, and the caller rolls the batch back.
# One row per member moved: the reservation as moved, with its allocations (the batch's own
# inserts included), as VIEW_BY_ID reads it, and the statement's counts (MOVE_BATCH_COUNTS, the
# same on every row; they also make the wake-ups and notifications run).
MOVE_BATCH_COUNTS = ("batch_woken", "batch_notified", "batch_told")
MOVE_BATCH = f"""
WITH input AS (
    SELECT * FROM unnest(%(ids)s::text[], %(states)s::text[], %(conditions)s::jsonb[], %(starts)s::bigint[],
                         %(ends)s::bigint[], %(leases)s::bigint[], %(types)s::text[], %(data)s::jsonb[])
        WITH ORDINALITY AS i(id, state, conditions, start_ms, end_ms, lease_ms, event_type, data, ord)
),
moved AS (
    UPDATE reservations r
    SET state = i.state,
        operation_state = 'succeeded',
        conditions = i.conditions,
        during = CASE WHEN i.start_ms IS NULL THEN r.during
                      ELSE tstzrange(from_epoch_ms(i.start_ms), from_epoch_ms(i.end_ms), '[)') END,
        lease_deadline = CASE WHEN i.lease_ms IS NULL THEN r.lease_deadline
                              ELSE greatest(from_epoch_ms(i.lease_ms),
                                            {CLOCK_NOW} + (r.request->>'leaseSeconds')::bigint * interval '1 second')
                         END,
        attempts = r.attempts + 1,
        version = r.version + 1,
        updated_at = clock_timestamp()
    FROM input i
    WHERE r.id = i.id AND r.state = 'queued' AND lease_current(%(pool_id)s, %(holder)s, %(epoch)s)
    RETURNING {COLUMNS}
),
woken AS (
    SELECT schedule_work('reservation', due.id, due.at)
    FROM (SELECT DISTINCT w.id, greatest(from_epoch_ms(w.m), compute_now()) AS at
          FROM (SELECT * FROM unnest(%(wake_ids)s::text[], %(wake_at)s::bigint[])
                UNION ALL
                SELECT m.id, m.lease_deadline_ms FROM moved m JOIN input i ON i.id = m.id
                WHERE i.lease_ms IS NOT NULL) AS w(id, m)
          WHERE w.id IN (SELECT id FROM moved)) due
),
emitted AS (
    INSERT INTO events (tenant_id, type, subject, data)
    SELECT m.tenant_id, i.event_type, 'reservation/' || i.id, i.data
    FROM moved m JOIN input i ON i.id = m.id
    ORDER BY i.ord
    RETURNING tenant_id
),
told AS (
    SELECT pg_notify('bc_placed', string_agg(c.id, ','))
    FROM (SELECT id, (row_number() OVER ()) / 100 AS chunk FROM moved) c
    GROUP BY c.chunk
)
SELECT m.*, {ALLOCATIONS_JSON.format(ref="m.id").strip()} AS allocations,
       (SELECT count(*) FROM woken) AS batch_woken,
       (SELECT count(pg_notify('bc_events', t.tenant_id)) FROM (SELECT DISTINCT tenant_id FROM emitted) t)
           AS batch_notified,
       (SELECT count(*) FROM told) AS batch_told
FROM moved m
"""
