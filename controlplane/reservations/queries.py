"""Reservation SQL, in one place."""

from controlplane import auth

COLUMNS = """
    r.*,
    epoch_ms(lower(r.during)) AS during_start,
    epoch_ms(upper(r.during)) AS during_end,
    epoch_ms(r.lease_deadline) AS lease_deadline_ms,
    epoch_ms(r.created_at) AS created_ms,
    epoch_ms(r.updated_at) AS updated_ms
"""

BY_ID = f"SELECT {COLUMNS} FROM reservations r WHERE r.id = %(id)s"
# The reservations some events are about, with what a read of them is decided on (reads.resource_attributes).
EVENT_SUBJECTS = """
SELECT id, tenant_id, owner_identity_id, pool_id, state FROM reservations
WHERE tenant_id = %(tenant_id)s AND id = ANY(%(ids)s) AND state <> 'draft'
"""
BY_ID_FOR_UPDATE = BY_ID + " FOR UPDATE"
# BY_ID_FOR_UPDATE with the product clock (as db.now_ms reads it: compute_now() counts from the
# transaction's start) in `now_ms`, for the reconciler's first pass: one round trip.
BY_ID_LOCKED_NOW = f"SELECT {COLUMNS}, epoch_ms(compute_now()) AS now_ms FROM reservations r WHERE r.id = %(id)s FOR UPDATE"
# The pool lock, then the row locked, and, when the row is still the undecided version
# transaction 1 read, the decision recorded and quota charged (charge_all, migration 0028: all or
# none; a refusal is an error that aborts the transaction): one round trip, in the lock order (the
# row is locked above the join, after the materialized lock was taken). FOR UPDATE returns the
# row's newest committed version even though the statement's snapshot predates the wait for the
# pool lock. `charged` is 1 when it charged, 0 when the row was no longer undecided. `lock_now_ms`:
# the product clock once the lock is held (clock_ms_fresh, migration 0046: the statement's
# snapshot would read the clock's offset as it was before the wait), which the window is placed at.
POOL_LOCK_THEN_CHARGE = f"""
WITH pool_lock AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended(%(lock_key)s, 0))),
locked AS MATERIALIZED (SELECT {COLUMNS} FROM pool_lock, reservations r WHERE r.id = %(id)s FOR UPDATE OF r),
undecided AS MATERIALIZED (
    SELECT id, tenant_id FROM locked WHERE locked.state = ANY(%(undecided)s) AND locked.version = %(version)s
),
recorded AS (
    UPDATE authz_projection SET decision = %(decision)s, decided_at = compute_now()
    WHERE reservation_id = %(id)s AND EXISTS (SELECT 1 FROM undecided)
),
charged AS MATERIALIZED (
    SELECT charge_all(u.tenant_id, u.id, %(resources)s::text[], %(amounts)s::bigint[], %(pers)s::bigint[],
                      %(lenient)s::boolean[], %(unnamed)s::text[])
    FROM undecided u
)
SELECT locked.*, (SELECT count(*) FROM charged) AS charged, clock_ms_fresh() AS lock_now_ms FROM locked
"""
BY_ID_IN_TENANT = f"""
SELECT {COLUMNS} FROM reservations r
WHERE r.id = %(id)s AND r.tenant_id = %(tenant_id)s AND r.state <> 'draft'
"""

# The new draft as BY_ID reads it, with its IAM attributes (authz_projection) in the same
# statement; no row when a concurrent twin inserted it first. draft_room (migration 0046) first
# holds the identity's live-drafts cap under its lock: a refusal is its check violation.
# The draft's commit does not wait for its WAL flush (synchronous_commit off for this statement's
# transaction only): no answer of a create rests on the draft alone. Every path that answers after
# it commits again with a flush (the decision, the placement, the refusal), which makes the draft
# durable too (WAL is flushed in order), or answers an error whose retry writes the draft again;
# a crash can lose only drafts no caller was told about (docs/decisions.md).
# The draft and its attributes when `room` (a CTE before them) says ok: `d` is the row inserted.
DRAFT_INSERT_CTES = f"""d AS (
    INSERT INTO reservations AS r
        (id, tenant_id, pool_id, owner_identity_id, idempotency_key, request, request_hash, host_share)
    SELECT %(id)s, %(tenant_id)s, %(pool_id)s, %(identity_id)s, %(key)s, %(request)s, %(request_hash)s, %(host_share)s
    FROM room WHERE room.ok
    ON CONFLICT DO NOTHING
    RETURNING {COLUMNS}
),
a AS (
    INSERT INTO authz_projection (reservation_id, attributes) SELECT d.id, %(attributes)s FROM d
    ON CONFLICT (reservation_id) DO UPDATE SET attributes = EXCLUDED.attributes
)"""
INSERT_DRAFT_WITH_AUTHZ = f"""
WITH room AS MATERIALIZED (SELECT draft_room(%(identity_id)s::text, %(cap)s::integer, %(seen)s::integer) AS ok,
                                  set_config('synchronous_commit', 'off', true) AS unflushed),
{DRAFT_INSERT_CTES}
SELECT * FROM d
"""

# Whether the tenant still sees the pool (its owner, or offered to it): an extend books more time on it.
POOL_OFFERED = """
SELECT 1 FROM pools p
WHERE p.id = %(pool_id)s
  AND (p.owner_tenant_id = %(tenant_id)s
       OR EXISTS (SELECT 1 FROM pool_offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant_id)s))
"""
VISIBLE_POOL = """
SELECT p.id, p.region, p.policy, p.owner_tenant_id,
       (SELECT min(a.model) FROM atoms a JOIN nodes n ON n.id = a.node_id
        WHERE n.pool_id = p.id AND a.kind = 'gpu' AND n.state <> 'leased'
        HAVING count(DISTINCT a.model) = 1) AS single_model
FROM pools p
WHERE p.id = %(pool_id)s
  AND (p.owner_tenant_id = %(tenant_id)s
       OR EXISTS (SELECT 1 FROM pool_offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant_id)s))
"""

# VISIBLE_POOL without the model lookup, for a caller that knows the pool's models (the capacity index).
VISIBLE_POOL_FACTS = """
SELECT p.id, p.region, p.policy, p.owner_tenant_id
FROM pools p
WHERE p.id = %(pool_id)s
  AND (p.owner_tenant_id = %(tenant_id)s
       OR EXISTS (SELECT 1 FROM pool_offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant_id)s))
"""

# The pool's GPU models (whole GPUs, any health), for a caller without the capacity index. A leased
# machine's are left out (with VISIBLE_POOL's): its inventory is its tenant's word.
POOL_MODELS = """
SELECT DISTINCT a.model FROM atoms a JOIN nodes n ON n.id = a.node_id
WHERE n.pool_id = %(pool_id)s AND a.kind = 'gpu' AND n.state <> 'leased'
ORDER BY a.model
"""

# The smallest per-GPU share of vcpu and memoryGiB any GPU host of the pool gives (migration 0018),
# for a draft's host share while the capacity index is not built.
HOST_SHARE_PER_GPU = "SELECT resource, per_gpu FROM pool_host_share_per_gpu(%(pool_id)s)"

UPSERT_AUTHZ = """
INSERT INTO authz_projection (reservation_id, attributes) VALUES (%(id)s, %(attributes)s)
ON CONFLICT (reservation_id) DO UPDATE SET attributes = EXCLUDED.attributes
"""

RECORD_DECISION = """
UPDATE authz_projection SET decision = %(decision)s, decided_at = compute_now()
WHERE reservation_id = %(id)s
"""



# A transition: only from a state the state table allows, bumping the version.
# The body of a transition: only from a state the state table allows, bumping the version.
_TRANSITION_BODY = """
SET state = %(state)s,
    operation_state = %(operation_state)s,
    conditions = %(conditions)s,
    during = CASE WHEN %(start)s::bigint IS NULL THEN during
                  ELSE tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)') END,
    lease_deadline = CASE WHEN %(lease_deadline)s::bigint IS NULL THEN lease_deadline
                          ELSE {lease} END,
    end_reason = coalesce(%(end_reason)s, end_reason),
    attempts = attempts + %(attempt)s,
    version = version + 1,
    updated_at = clock_timestamp()
WHERE id = %(id)s AND state = ANY(%(from_states)s)
"""
TRANSITION = f"UPDATE reservations {_TRANSITION_BODY.format(lease='from_epoch_ms(%(lease_deadline)s)').strip()}\nRETURNING id"
# The product clock (compute_now()) as of the statement that reads it, not the transaction's start:
# a time taken after a wait for a lock.
CLOCK_NOW = "clock_timestamp() + (SELECT offset_ms FROM clock) * interval '1 millisecond'"
# A placement's lease runs leaseSeconds from the clock read here, under the pool lock: the
# caller's deadline (from transaction 1's clock, short by any wait for that lock) is a floor.
_PLACED_LEASE = f"""greatest(from_epoch_ms(%(lease_deadline)s),
                                   {CLOCK_NOW} + (r.request->>'leaseSeconds')::bigint * interval '1 second')"""

# A reservation's allocations as JSON objects of ALLOCATIONS' columns; `{ref}` names its id.
ALLOCATIONS_JSON = """
coalesce((SELECT jsonb_agg(jsonb_build_object('id', a.id, 'node_id', a.node_id, 'device_ids', a.device_ids,
                                              'state', a.state, 'binding', a.binding, 'limits', a.limits)
                           ORDER BY a.created_at, a.id)
          FROM allocations a WHERE a.reservation_id = {ref}), '[]')
"""

# The wake-ups and the event of a row TRANSITION moved, as the CTEs after its `moved`: nothing is
# scheduled or emitted unless the row moved. `{moments}`: the bigint[] of moments (epoch ms) to wake
# it at (WAKE_AT's rule: one past is now; NULLs are none); the event as events.emit writes it.
_WAKE_EMIT = """woken AS (
    SELECT schedule_moments('reservation', moved.id, ARRAY(
        SELECT DISTINCT greatest(from_epoch_ms(m), compute_now()) FROM unnest({moments}) AS m WHERE m IS NOT NULL))
    FROM moved
),
emitted AS (
    INSERT INTO events (tenant_id, type, subject, data)
    SELECT %(tenant_id)s, %(event_type)s, %(subject)s, %(data)s FROM moved
    RETURNING tenant_id
)"""
_WOKEN_NOTIFIED = """(SELECT count(*) FROM woken) AS woken,
       (SELECT count(pg_notify('bc_events', tenant_id)) FROM emitted) AS notified"""

# TRANSITION with its wake-ups (`moments`) and its event in one statement, for the reconciler's
# moves (binding, active); no row: the state table forbids the move.
TRANSITION_EMIT = f"""
WITH moved AS (UPDATE reservations r {_TRANSITION_BODY.format(lease='from_epoch_ms(%(lease_deadline)s)').strip()} RETURNING r.id),
{_WAKE_EMIT.format(moments="%(moments)s::bigint[]")}
SELECT moved.id, {_WOKEN_NOTIFIED}
FROM moved
"""

# The same for the locked part of a placement. Its row is the reservation as moved, with its
# allocations (those this transaction inserted included), as VIEW_BY_ID reads it; no row: the state
# table forbids the move, and the caller raises. The lease deadline is counted here
# (_PLACED_LEASE) and woken at besides `moments`.
TRANSITION_WAKE_EMIT = f"""
WITH moved AS (UPDATE reservations r {_TRANSITION_BODY.format(lease=_PLACED_LEASE).strip()} RETURNING {COLUMNS}),
{_WAKE_EMIT.format(moments="%(moments)s::bigint[] || CASE WHEN %(lease_deadline)s::bigint IS NULL THEN NULL ELSE moved.lease_deadline_ms END")}
SELECT moved.*, {ALLOCATIONS_JSON.format(ref="moved.id").strip()} AS allocations,
       {_WOKEN_NOTIFIED}
FROM moved
"""

# The inline placer's common case in one statement (migrations 0032, 0056, 0057): the pool lock
# shared and the node's lock, the row, the decision, the allocation, its bookings and host
# resources, the move with its wake-ups and event, the charge last.
# `outcome` is 'placed' (the rest is the reservation as moved with its allocations, as VIEW_BY_ID
# reads them), 'decided' or 'missing' (the rest NULL); a lost race raises BCP01.
PLACE_INLINE = f"""
SELECT p.outcome, {COLUMNS}, p.allocations
FROM place_inline(
    p_id => %(id)s, p_version => %(version)s, p_decision => %(decision)s, p_undecided => %(undecided)s,
    p_lock_key => %(lock_key)s, p_resources => %(resources)s::text[], p_amounts => %(amounts)s::bigint[],
    p_pers => %(pers)s::bigint[], p_lenient => %(lenient)s::boolean[], p_unnamed_models => %(unnamed)s::text[],
    p_allocation_id => %(allocation_id)s, p_node_id => %(node_id)s, p_pool_id => %(pool_id)s,
    p_device_ids => %(device_ids)s::text[], p_atom_ids => %(atom_ids)s::text[], p_selector => %(selector)s,
    p_start => %(start)s, p_end => %(end)s, p_lease_deadline => %(lease_deadline)s::bigint,
    p_moments => %(moments)s::bigint[], p_from_states => %(from_states)s::text[], p_event_data => %(data)s,
    p_host => %(host)s, p_limits => %(limits)s
) p
LEFT JOIN LATERAL (SELECT (p.reservation).*) r ON true
"""

ALLOCATIONS = """
SELECT id, node_id, device_ids, state, binding, limits
FROM allocations WHERE reservation_id = %(id)s ORDER BY created_at, id
"""

# A reservation with its allocations (as ALLOCATIONS reads them) in one statement, so one snapshot
# and one round trip: what create and its wait answer.
VIEW_BY_ID = f"""
SELECT {COLUMNS}, {ALLOCATIONS_JSON.format(ref="r.id").strip()} AS allocations
FROM reservations r WHERE r.id = %(id)s
"""

# VIEW_BY_ID for a create's wait, with the state of the caller's token in the same read
# ('live', 'revoked' or 'expired' on the product clock) and whether the caller can still act in
# the tenant (can_act_in, migration 0052): a wait ends with its token, as a Watch stream does,
# and with its caller's membership of the tenant.
_CALLER_STATE = """
       (SELECT CASE WHEN t.revoked_at IS NOT NULL THEN 'revoked'
                    WHEN t.expires_at <= compute_now() THEN 'expired' ELSE 'live' END
        FROM api_tokens t WHERE t.id = %(token_id)s) AS token_state,
       can_act_in(%(identity_id)s, %(tenant_id)s) AS member"""
VIEW_FOR_TOKEN = f"""
SELECT {COLUMNS}, {ALLOCATIONS_JSON.format(ref="r.id").strip()} AS allocations,{_CALLER_STATE}
FROM reservations r WHERE r.id = %(id)s
"""
# The same caller state alone: for a wait handed its answer by a batch of its process, not read.
CALLER_STATE = f"SELECT{_CALLER_STATE}"

# Release: bookings that have not begun are deleted, running ones end now.
# The end of bookings and window: at %(at)s (epoch ms) when given (a lapse the reconciler reaches
# late ends at its deadline), else at compute_now().
_ENDS_AT = "coalesce(from_epoch_ms(%(at)s::bigint), compute_now())"
DELETE_FUTURE_BOOKINGS = f"""
DELETE FROM bookings b USING allocations a
WHERE a.id = b.allocation_id AND a.reservation_id = %(id)s AND lower(b.during) >= {_ENDS_AT}
"""
TRUNCATE_RUNNING_BOOKINGS = f"""
UPDATE bookings b SET during = tstzrange(lower(b.during), {_ENDS_AT}, '[)')
FROM allocations a
WHERE a.id = b.allocation_id AND a.reservation_id = %(id)s AND b.during @> {_ENDS_AT}
"""
END_ALLOCATIONS = """
UPDATE allocations SET state = %(state)s
WHERE reservation_id = %(id)s AND state IN ('placed', 'binding', 'bound')
"""
# A window that has not begun by then keeps its bounds (cut at its start it would be empty).
TRUNCATE_WINDOW = f"""
UPDATE reservations SET during = tstzrange(lower(during), {_ENDS_AT}, '[)')
WHERE id = %(id)s AND during @> {_ENDS_AT} AND lower(during) < {_ENDS_AT}
"""

# Now plus leaseSeconds, now as of this statement (CLOCK_NOW): compute_now() is the transaction's
# start, before the renew's wait for the row (a batch placing it holds it), and counted from there
# a renew that waited gave back less lease than the placement it waited for had just set.
RENEW = f"""
UPDATE reservations
SET lease_deadline = {CLOCK_NOW} + (request->>'leaseSeconds')::bigint * interval '1 second',
    version = version + 1, updated_at = clock_timestamp()
WHERE id = %(id)s
"""

NOTIFY_POOL_FREED = "SELECT pg_notify('bc_pool_freed', %(pool_id)s)"

# The cursor is a reservation of the listing itself (not a draft, and the caller's own for scope
# 'mine'); any other id pages like an unknown one, to nothing, so a cursor cannot tell whether
# another identity's draft (its id derived from a key) or reservation exists.
# One page of a listing, each row with its allocations (as ALLOCATIONS reads them): one statement.
LIST = f"""
SELECT {COLUMNS}, {ALLOCATIONS_JSON.format(ref="r.id").strip()} AS allocations FROM reservations r
WHERE r.tenant_id = %(tenant_id)s
  AND r.state <> 'draft'
  AND (%(owner)s::text IS NULL OR r.owner_identity_id = %(owner)s)
  AND (cardinality(%(states)s::text[]) = 0 OR r.state = ANY(%(states)s))
  AND (%(pool_id)s = '' OR r.pool_id = %(pool_id)s)
  AND (%(cursor)s::text IS NULL OR (r.created_at, r.id) < (
        SELECT c.created_at, c.id FROM reservations c
        WHERE c.id = %(cursor)s AND c.tenant_id = %(tenant_id)s AND c.state <> 'draft'
          AND (%(owner)s::text IS NULL OR c.owner_identity_id = %(owner)s)))
ORDER BY r.created_at DESC, r.id DESC
LIMIT %(limit)s
"""

# One page of the pool's pending reservations, oldest first, after the cursor (NULL: from the first).
PENDING_IN_POOL = """
SELECT r.id, r.created_at FROM reservations r
WHERE r.pool_id = %(pool_id)s AND r.state = 'pending'
  AND (%(after_at)s::timestamptz IS NULL OR (r.created_at, r.id) > (%(after_at)s::timestamptz, %(after_id)s::text))
ORDER BY r.created_at, r.id
LIMIT %(limit)s
"""

POOLS_WITH_PENDING = "SELECT DISTINCT pool_id FROM reservations WHERE state = 'pending'"



# extend ----------------------------------------------------------------------------------------

TAKE_EXTEND_HOLD = """
INSERT INTO extend_holds (reservation_id, hold, taken_at) VALUES (%(id)s, %(hold)s, compute_now())
ON CONFLICT (reservation_id) DO UPDATE SET hold = EXCLUDED.hold, taken_at = EXCLUDED.taken_at
WHERE extend_holds.taken_at < compute_now() - %(ttl)s * interval '1 second'
RETURNING hold
"""

OWNS_EXTEND_HOLD = "SELECT 1 FROM extend_holds WHERE reservation_id = %(id)s AND hold = %(hold)s FOR UPDATE"

DROP_EXTEND_HOLD = "DELETE FROM extend_holds WHERE reservation_id = %(id)s AND hold = %(hold)s"

SET_PENDING_EXTEND = """
UPDATE authz_projection SET pending = %(pending)s WHERE reservation_id = %(id)s
"""

CLEAR_PENDING_EXTEND = "UPDATE authz_projection SET pending = NULL WHERE reservation_id = %(id)s"

AUTHZ_ATTRIBUTES = "SELECT attributes FROM authz_projection WHERE reservation_id = %(id)s"

MOVE_BOOKING_ENDS = """
UPDATE bookings b SET during = tstzrange(lower(b.during), from_epoch_ms(%(to)s), '[)')
FROM allocations a
WHERE a.id = b.allocation_id AND a.reservation_id = %(id)s AND a.state IN ('placed', 'binding', 'bound')
  AND upper(b.during) = from_epoch_ms(%(from)s)
"""

# The earliest other booking on one of our atoms that starts at or after our end, or of a host
# resource we book on our node (where its load may rise past what the node can give).
# Where a refused extension could reach: the first booking on one of its atoms after its end, or
# the first moment after its end when one of its host bookings would no longer fit beside the
# node's others (the load rises only where a booking starts, so those starts and the end itself
# are the candidates; a booking on the node's other GPUs that leaves room is not in the way).
# Its own end when nothing later is found (the host already over its rows at the end, say).
AVAILABLE_UNTIL = """
SELECT epoch_ms(coalesce(least(
    (SELECT min(lower(o.during))
     FROM bookings b
     JOIN allocations a ON a.id = b.allocation_id
     JOIN bookings o ON o.atom_id = b.atom_id AND o.allocation_id <> b.allocation_id
     WHERE a.reservation_id = %(id)s AND a.state IN ('placed', 'binding', 'bound')
       AND upper(b.during) = from_epoch_ms(%(from)s) AND lower(o.during) >= from_epoch_ms(%(from)s)),
    (SELECT min(t.at)
     FROM host_bookings h
     JOIN allocations a ON a.id = h.allocation_id
     CROSS JOIN LATERAL (
         SELECT from_epoch_ms(%(from)s) AS at
         UNION
         SELECT lower(o.during) FROM host_bookings o
         WHERE o.node_id = h.node_id AND o.resource = h.resource AND o.allocation_id <> h.allocation_id
           AND lower(o.during) > from_epoch_ms(%(from)s)) t
     WHERE a.reservation_id = %(id)s AND a.state IN ('placed', 'binding', 'bound')
       AND upper(h.during) = from_epoch_ms(%(from)s) AND h.amount > 0
       AND h.amount + (SELECT coalesce(sum(o.amount), 0) FROM host_bookings o
                       WHERE o.node_id = h.node_id AND o.resource = h.resource
                         AND o.allocation_id <> h.allocation_id AND o.during @> t.at)
           > host_capacity(h.node_id, h.resource))),
    from_epoch_ms(%(from)s))) AS until
"""

SET_WINDOW_END = """
UPDATE reservations SET during = tstzrange(lower(during), from_epoch_ms(%(to)s), '[)'),
       version = version + 1, updated_at = clock_timestamp()
WHERE id = %(id)s
"""


# schedule --------------------------------------------------------------------------------------

# A moment already past is due now, not at its past time: the queue runs due items oldest run_at
# first, so a past run_at would jump ahead of every wake-up already waiting (node reports
# included) and starve them while creates keep coming.
# One statement (it runs inside create's pool-locked commit, where every round trip counts).
WAKE_AT = """
SELECT schedule_moments('reservation', %(id)s, ARRAY(
    SELECT DISTINCT greatest(from_epoch_ms(m), compute_now()) FROM unnest(%(moments)s::bigint[]) AS m))
"""


# binding ---------------------------------------------------------------------------------------

START_BINDING = """
UPDATE allocations SET state = 'binding', bind_deadline = from_epoch_ms(%(deadline)s)
WHERE reservation_id = %(id)s AND state = 'placed'
"""

LIVE_ALLOCATIONS = """
SELECT id, node_id, state, epoch_ms(bind_deadline) AS bind_deadline_ms
FROM allocations WHERE reservation_id = %(id)s AND state IN ('binding', 'bound') ORDER BY id
"""

FAILED_NODES = "SELECT DISTINCT node_id FROM allocations WHERE reservation_id = %(id)s AND state = 'failed'"

# Extend: the first started allocation (binding or bound) on hardware taken out of service, a
# revoked node first, then a cordoned one, then a node with a booked GPU quarantined; none: the
# extension may be decided. Placed allocations are BookingRepair's before their start.
OUT_OF_SERVICE = """
SELECT n.id AS node_id,
       CASE WHEN n.revoked_at IS NOT NULL THEN 'node-revoked'
            WHEN n.state = 'cordoned' THEN 'node-cordoned'
            ELSE 'device-unhealthy' END AS reason,
       (SELECT min(at.device_uuid) FROM bookings b JOIN atoms at ON at.id = b.atom_id
        WHERE b.allocation_id = al.id AND at.health = 'unhealthy') AS device_uuid
FROM allocations al
JOIN nodes n ON n.id = al.node_id
WHERE al.reservation_id = %(id)s AND al.state IN ('binding', 'bound')
  AND (n.revoked_at IS NOT NULL OR n.state = 'cordoned'
       OR EXISTS (SELECT 1 FROM bookings b JOIN atoms at ON at.id = b.atom_id
                  WHERE b.allocation_id = al.id AND at.health = 'unhealthy'))
ORDER BY n.revoked_at IS NULL, n.state <> 'cordoned', n.id
LIMIT 1
"""

# The conditions' facts of a reservation's live (binding or bound) allocations, in one read: the
# names of their unreachable nodes, and their booked atoms an operator quarantined or that their
# node no longer reports (gone: not bookable), each {name, device_uuid, gone}.
NODE_CONDITION_FACTS = """
WITH live AS (
    SELECT id, node_id FROM allocations WHERE reservation_id = %(id)s AND state IN ('binding', 'bound')
)
SELECT array(SELECT n.name FROM nodes n WHERE n.id IN (SELECT node_id FROM live) AND n.connectivity = 'unreachable'
             ORDER BY n.id) AS unreachable,
       array(SELECT DISTINCT jsonb_build_object('name', n.name, 'device_uuid', at.device_uuid, 'gone', NOT at.bookable)
             FROM live JOIN bookings b ON b.allocation_id = live.id JOIN atoms at ON at.id = b.atom_id
             JOIN nodes n ON n.id = at.node_id
             WHERE at.health = 'unhealthy' OR NOT at.bookable) AS sick
"""

# A later wake-up already due within the recheck interval (the one being handled is due now).
RECHECK_PENDING = """
SELECT 1 FROM work_items
WHERE kind = 'reservation' AND subject = %(id)s
  AND run_at > compute_now() AND run_at <= compute_now() + %(within)s * interval '1 millisecond'
LIMIT 1
"""



COUNT_BIND_FAILURE = """
UPDATE reservations SET bind_failures = bind_failures + 1 WHERE id = %(id)s RETURNING bind_failures
"""


# repair ----------------------------------------------------------------------------------------

# Nodes of the reservation's live allocations that are no longer fit to serve them: the node
# (state, connectivity, required capability labels), a booked atom (health, bookable), or what the
# node's inventory changed in place since placement: the booked atoms no longer as the request
# asks (atoms_as_asked, migration 0063: model, MIG profile, one NVLink domain for nvlink-all, one
# NUMA node for numa), or a gang member no longer carrying the label value it was placed under.
BAD_NODES = """
SELECT al.node_id
FROM allocations al
JOIN reservations r ON r.id = al.reservation_id
JOIN nodes n ON n.id = al.node_id
WHERE al.reservation_id = %(id)s AND al.state = 'placed'
  AND (n.state <> 'ready' OR n.connectivity = 'unreachable' OR NOT n.labels @> %(required)s
       OR EXISTS (SELECT 1 FROM bookings b JOIN atoms a ON a.id = b.atom_id
                  WHERE b.allocation_id = al.id AND (a.health <> 'healthy' OR NOT a.bookable))
       OR NOT atoms_as_asked(ARRAY(SELECT b.atom_id FROM bookings b WHERE b.allocation_id = al.id),
                             r.request->'devices'->0)
       OR (coalesce(al.gang_group, '') <> '' AND NOT n.labels @> jsonb_build_object(
               r.request->'gang'->>'topologyKey', jsonb_build_object('value', al.gang_group))))
ORDER BY al.node_id
"""

LIVE_NODES = "SELECT node_id FROM allocations WHERE reservation_id = %(id)s AND state = 'placed' ORDER BY id"

DROP_PLACED_BOOKINGS = """
DELETE FROM bookings b USING allocations al
WHERE al.id = b.allocation_id AND al.reservation_id = %(id)s AND al.state = 'placed'
"""

RELEASE_PLACED_ALLOCATIONS = "UPDATE allocations SET state = 'released' WHERE reservation_id = %(id)s AND state = 'placed'"


BUMP_VERSION = "UPDATE reservations SET version = version + 1, updated_at = clock_timestamp() WHERE id = %(id)s"

# A repair the worker reached after the start: the window begins when it placed again (the end stays).
SET_WINDOW_START = """
UPDATE reservations SET during = tstzrange(from_epoch_ms(%(start)s), upper(during), '[)') WHERE id = %(id)s
"""


# reports ---------------------------------------------------------------------------------------

# `changed`: what `get` answers of the allocation changed (it was not bound, or bound otherwise).
MARK_BOUND = """
WITH before AS (SELECT state, binding FROM allocations WHERE id = %(id)s)
UPDATE allocations a SET state = 'bound', binding = %(binding)s,
       bound_report = %(body)s, bound_sig_kid = %(kid)s, bound_sig = %(sig)s
FROM before WHERE a.id = %(id)s
RETURNING before.state <> 'bound' OR before.binding IS DISTINCT FROM a.binding AS changed
"""

MARK_BINDING_LOST = "UPDATE allocations SET state = 'binding' WHERE id = %(id)s AND state = 'bound'"

ALL_LIVE_BOUND = """
SELECT bool_and(state = 'bound') AS all_bound FROM allocations
WHERE reservation_id = %(id)s AND state IN ('binding', 'bound')
"""

# transitions -----------------------------------------------------------------------------------

SET_CONDITIONS = """
UPDATE reservations SET conditions = %(conditions)s, version = version + 1, updated_at = clock_timestamp()
WHERE id = %(id)s
"""


# admission -------------------------------------------------------------------------------------

# An identity's unfinished creates, counted up to the cap (the partial index
# reservations_unfinished_by_owner): its drafts and its requests awaiting confirmation (which end
# at their confirmation's deadline, at most 30 minutes on, if no retry ended them before); and
# the seconds until the oldest of them ends.
LIVE_DRAFTS = """
SELECT count(*) AS n,
       greatest(0, ceil(extract(epoch FROM min(created_at + CASE WHEN state = 'draft'
                                                                 THEN %(retention_s)s * interval '1 second'
                                                                 ELSE interval '30 minutes' END)
                                        - now())))::bigint AS expires_in_s
FROM (SELECT created_at, state FROM reservations
      WHERE owner_identity_id = %(identity_id)s AND state IN ('draft', 'awaiting-confirmation')
      ORDER BY created_at LIMIT %(cap)s) d
"""

# What a create reads before it decides anything, in one statement: the clock, the pool as the
# tenant sees it (NULL: not visible; `pool_sql` is VISIBLE_POOL or VISIBLE_POOL_FACTS), the
# identity's live drafts (LIVE_DRAFTS), the tenant's policy (the `facts_` columns), and the stored
# reservation of its key as BY_ID reads it (every other column; all NULL when there is none).
DRAFT_FACT_COLUMNS = ("facts_now_ms", "facts_pool", "facts_drafts", "facts_drafts_expire_in_s", "facts_policy")


def fact_columns(pool_sql: str, caller_sql: str = "") -> str:
    """The `facts_` columns (and `caller` with `caller_sql`), selected from LIVE_DRAFTS as `d`."""
    return f"""epoch_ms(compute_now()) AS facts_now_ms, {caller_sql + "," if caller_sql else ""}
       (SELECT to_jsonb(p) FROM ({pool_sql.strip()}) p) AS facts_pool,
       d.n AS facts_drafts, d.expires_in_s AS facts_drafts_expire_in_s,
       (SELECT cedar FROM policies WHERE tenant_id = %(tenant_id)s) AS facts_policy"""


def draft_facts(pool_sql: str, caller_sql: str = "") -> str:
    """`caller_sql`: a column verifying the caller's token in the same read (auth.CALLER_COLUMN)."""
    return f"""
SELECT {fact_columns(pool_sql, caller_sql)},
       stored.*
FROM ({LIVE_DRAFTS.strip()}) d LEFT JOIN LATERAL ({BY_ID}) stored ON true
"""


DRAFT_FACTS = draft_facts(VISIBLE_POOL_FACTS)  # with the capacity index, which knows the pool's models
DRAFT_FACTS_READING_MODELS = draft_facts(VISIBLE_POOL)  # without it
# The same two verifying a known token (auth.Unverified) in the read: its `caller` column
DRAFT_FACTS_VERIFYING = draft_facts(VISIBLE_POOL_FACTS, auth.CALLER_COLUMN)
DRAFT_FACTS_READING_MODELS_VERIFYING = draft_facts(VISIBLE_POOL, auth.CALLER_COLUMN)


# Draft expiry: one batch of drafts past the retention window (wall-clock, like created_at); rows
# a create is deciding right now are locked and skipped.
DELETE_EXPIRED_DRAFTS = """
DELETE FROM reservations WHERE id IN (
    SELECT id FROM reservations
    WHERE state = 'draft' AND created_at < now() - %(retention_s)s * interval '1 second'
    ORDER BY created_at LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
"""

# Offboarding: an identity's reservations, locked; its drafts dropped; one handed to a successor
# (the creator is kept, so its idempotency keys stay its own).
OWNED_BY_FOR_UPDATE = f"""
SELECT {COLUMNS} FROM reservations r
WHERE r.owner_identity_id = ANY(%(ids)s) AND r.state = ANY(%(states)s)
ORDER BY r.id FOR UPDATE
"""

DELETE_DRAFTS_OF = "DELETE FROM reservations WHERE owner_identity_id = ANY(%(ids)s) AND state = 'draft'"

# The same two for one tenant (an identity removed from it: controlplane.memberships).
OWNED_BY_IN_TENANT_FOR_UPDATE = f"""
SELECT {COLUMNS} FROM reservations r
WHERE r.owner_identity_id = ANY(%(ids)s) AND r.tenant_id = %(tenant_id)s AND r.state = ANY(%(states)s)
ORDER BY r.id FOR UPDATE
"""

DELETE_DRAFTS_OF_IN_TENANT = """
DELETE FROM reservations WHERE owner_identity_id = ANY(%(ids)s) AND tenant_id = %(tenant_id)s AND state = 'draft'
"""

# The owner IAM sees (the draft's stored attributes, which extend decides on) moves with it.
REASSIGN_OWNER = """
WITH moved AS (
    UPDATE reservations
    SET creator_identity_id = coalesce(creator_identity_id, owner_identity_id),
        owner_identity_id = %(to)s, version = version + 1, updated_at = clock_timestamp()
    WHERE id = %(id)s
    RETURNING id
)
UPDATE authz_projection
SET attributes = jsonb_set(attributes, '{ownerIdentityId}', to_jsonb(%(to)s::text))
WHERE reservation_id IN (SELECT id FROM moved)
"""


# gangs -----------------------------------------------------------------------------------------

# A placed gang's members, with the label value they were placed under.
PLACED_MEMBERS = """
SELECT id, node_id, gang_group FROM allocations
WHERE reservation_id = %(id)s AND state = 'placed' ORDER BY id
"""

# Some members leave (BookingRepair moved them): their bookings go, the allocations are history.
DROP_BOOKINGS_OF = "DELETE FROM bookings WHERE allocation_id = ANY(%(ids)s)"
RELEASE_ALLOCATIONS_OF = "UPDATE allocations SET state = 'released' WHERE id = ANY(%(ids)s)"

# The members whose node failed to bind, once the whole gang has ended.
MARK_FAILED = "UPDATE allocations SET state = 'failed' WHERE id = ANY(%(ids)s)"
