"""Reservation SQL, in one place."""

from controlplane.reservations import states

COLUMNS = """
    r.*,
    epoch_ms(lower(r.during)) AS during_start,
    epoch_ms(upper(r.during)) AS during_end,
    epoch_ms(r.lease_deadline) AS lease_deadline_ms,
    epoch_ms(r.created_at) AS created_ms,
    epoch_ms(r.updated_at) AS updated_ms
"""

BY_ID = f"SELECT {COLUMNS} FROM reservations r WHERE r.id = %(id)s"
BY_ID_FOR_UPDATE = BY_ID + " FOR UPDATE"
BY_ID_IN_TENANT = f"""
SELECT {COLUMNS} FROM reservations r
WHERE r.id = %(id)s AND r.tenant_id = %(tenant_id)s AND r.state <> 'draft'
"""

INSERT_DRAFT = """
INSERT INTO reservations
    (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request, request_hash)
VALUES (%(id)s, %(tenant_id)s, %(pool_id)s, %(identity_id)s, %(key)s, %(request)s, %(hash)s)
ON CONFLICT DO NOTHING
"""

VISIBLE_POOL = """
SELECT p.id, p.region, p.policy, p.owner_tenant_id,
       (SELECT min(a.model) FROM atoms a JOIN nodes n ON n.id = a.node_id
        WHERE n.pool_id = p.id AND a.kind = 'gpu'
        HAVING count(DISTINCT a.model) = 1) AS single_model
FROM pools p
WHERE p.id = %(pool_id)s
  AND (p.owner_tenant_id = %(tenant_id)s
       OR EXISTS (SELECT 1 FROM pool_offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant_id)s))
"""

# Visibility only (owner or offered), without the model lookup of VISIBLE_POOL.
POOL_IS_VISIBLE = """
SELECT p.id FROM pools p
WHERE p.id = %(pool_id)s
  AND (p.owner_tenant_id = %(tenant_id)s
       OR EXISTS (SELECT 1 FROM pool_offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant_id)s))
"""

UPSERT_AUTHZ = """
INSERT INTO authz_projection (reservation_id, attributes) VALUES (%(id)s, %(attributes)s)
ON CONFLICT (reservation_id) DO UPDATE SET attributes = EXCLUDED.attributes
"""

RECORD_DECISION = """
UPDATE authz_projection SET decision = %(decision)s, decided_at = compute_now()
WHERE reservation_id = %(id)s
"""


NOW_MS = "SELECT epoch_ms(compute_now()) AS now_ms"

# A transition: only from a state the state table allows, bumping the version.
TRANSITION = """
UPDATE reservations
SET state = %(state)s,
    operation_state = %(operation_state)s,
    conditions = %(conditions)s,
    during = CASE WHEN %(start)s::bigint IS NULL THEN during
                  ELSE tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)') END,
    lease_deadline = CASE WHEN %(lease_deadline)s::bigint IS NULL THEN lease_deadline
                          ELSE from_epoch_ms(%(lease_deadline)s) END,
    end_reason = coalesce(%(end_reason)s, end_reason),
    attempts = attempts + %(attempt)s,
    version = version + 1,
    updated_at = clock_timestamp()
WHERE id = %(id)s AND state = ANY(%(from_states)s)
RETURNING id
"""

ALLOCATIONS = """
SELECT id, node_id, device_ids, state, binding
FROM allocations WHERE reservation_id = %(id)s ORDER BY created_at, id
"""

# Release: bookings that have not begun are deleted, running ones end now.
DELETE_FUTURE_BOOKINGS = """
DELETE FROM bookings b USING allocations a
WHERE a.id = b.allocation_id AND a.reservation_id = %(id)s AND lower(b.during) >= compute_now()
"""
TRUNCATE_RUNNING_BOOKINGS = """
UPDATE bookings b SET during = tstzrange(lower(b.during), compute_now(), '[)')
FROM allocations a
WHERE a.id = b.allocation_id AND a.reservation_id = %(id)s AND b.during @> compute_now()
"""
END_ALLOCATIONS = """
UPDATE allocations SET state = %(state)s
WHERE reservation_id = %(id)s AND state IN ('placed', 'binding', 'bound')
"""
TRUNCATE_WINDOW = """
UPDATE reservations SET during = tstzrange(lower(during), compute_now(), '[)')
WHERE id = %(id)s AND during @> compute_now()
"""

RENEW = """
UPDATE reservations
SET lease_deadline = compute_now() + (request->>'leaseSeconds')::bigint * interval '1 second',
    version = version + 1, updated_at = clock_timestamp()
WHERE id = %(id)s
"""

NOTIFY_POOL_FREED = "SELECT pg_notify('bc_pool_freed', %(pool_id)s)"

LIST = f"""
SELECT {COLUMNS} FROM reservations r
WHERE r.tenant_id = %(tenant_id)s
  AND r.state <> 'draft'
  AND (%(owner)s::text IS NULL OR r.owner_identity_id = %(owner)s)
  AND (cardinality(%(states)s::text[]) = 0 OR r.state = ANY(%(states)s))
  AND (%(pool_id)s = '' OR r.pool_id = %(pool_id)s)
  AND (%(cursor)s::text IS NULL OR (r.created_at, r.id) < (
        SELECT c.created_at, c.id FROM reservations c
        WHERE c.id = %(cursor)s AND c.tenant_id = %(tenant_id)s))
ORDER BY r.created_at DESC, r.id DESC
LIMIT %(limit)s
"""

PENDING_IN_POOL = """
SELECT r.id FROM reservations r
WHERE r.pool_id = %(pool_id)s AND r.state = 'pending'
ORDER BY r.created_at
LIMIT %(limit)s
"""

POOLS_WITH_PENDING = "SELECT DISTINCT pool_id FROM reservations WHERE state = 'pending'"

BOOKED_STATES = sorted(states.BOOKED)
