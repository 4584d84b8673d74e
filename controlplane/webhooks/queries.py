"""The SQL of webhooks and their deliveries."""

from controlplane.reservations.queries import EVENT_RESERVATION_COLUMNS, event_reservation_join

_WEBHOOK_COLUMNS = "id, tenant_id, url, event_types, created_by, epoch_ms(created_at) AS created_ms"

CREATE = f"""
INSERT INTO webhooks (id, tenant_id, url, secret, event_types, created_by)
VALUES (%(id)s, %(tenant_id)s, %(url)s, %(secret)s, %(event_types)s, %(created_by)s)
RETURNING {_WEBHOOK_COLUMNS}
"""

# Webhooks per tenant are capped: creates of one tenant take this lock, then count. Every event
# writer's fan-out, at its commit, takes it shared before reading the tenant's webhooks (migration
# 0064), so an event that commits after a create's webhook is delivered to it.
TENANT_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('webhooks:' || %(tenant_id)s, 0))"
COUNT = "SELECT count(*) AS n FROM webhooks WHERE tenant_id = %(tenant_id)s"

GET = f"SELECT {_WEBHOOK_COLUMNS} FROM webhooks WHERE id = %(id)s AND tenant_id = %(tenant_id)s"

LIST = f"""
SELECT {_WEBHOOK_COLUMNS} FROM webhooks
WHERE tenant_id = %(tenant_id)s AND (%(cursor)s::text IS NULL OR id > %(cursor)s)
ORDER BY id
LIMIT %(limit)s
"""

DELETE = f"DELETE FROM webhooks WHERE id = %(id)s AND tenant_id = %(tenant_id)s RETURNING {_WEBHOOK_COLUMNS}"

DELIVERIES = f"""
SELECT d.event_id, e.type AS event_type, d.subject, d.state, d.attempts, d.last_status, d.last_error,
       epoch_ms(d.last_attempt_at) AS last_attempt_ms, epoch_ms(d.next_attempt_at) AS next_attempt_ms,
       epoch_ms(d.created_at) AS created_ms, {EVENT_RESERVATION_COLUMNS}
FROM webhook_deliveries d
JOIN events e ON e.id = d.event_id{event_reservation_join("d.subject", "d.tenant_id")}
WHERE d.webhook_id = %(webhook_id)s AND (%(before)s = 0 OR d.event_id < %(before)s)
ORDER BY d.event_id DESC
LIMIT %(limit)s
"""

# Claims are serialized across processes by this transaction-scoped lock, so the per-tenant cap
# below counts every lease committed before (claims are one short statement each).
CLAIM_LOCK = "SELECT pg_advisory_xact_lock(7311010)"

# Leases in flight per tenant: attempts claimed and not yet recorded (a lease that ran out, its
# worker gone, no longer counts). Kept apart from the deliveries (migration 0049): an attempt
# whose webhook was deleted runs on to its deadline and still counts.
_BUSY = """
busy AS (
    SELECT tenant_id, count(*) AS leased
    FROM webhook_leases
    WHERE leased_until > compute_now()
    GROUP BY tenant_id
)"""

# Every event id below `final.below` has committed or never will (migration 0050): a delivery goes
# out only then, so no event with a smaller id than one a client was sent commits after it (a
# client resuming Events.Watch after that id misses nothing).
_FINAL = """
final AS MATERIALIZED (SELECT events_final_below() AS below)"""

# Not waiting behind an earlier pending delivery of its webhook and subject (order per subject).
_FIRST_OF_SUBJECT = """NOT EXISTS (
          SELECT 1 FROM webhook_deliveries p
          WHERE p.webhook_id = d.webhook_id AND p.subject = d.subject AND p.state = 'pending'
            AND p.event_id < d.event_id)"""

# What a delivery is decided on (webhooks.authority): the webhook's filter, its creator and whether
# the creator could still authenticate and act in the tenant (not offboarded, a member; an agent's
# person too, as controlplane.auth asks), and the tenant's policy version.
_AUTHORITY = """c.event_types, c.created_by, i.kind AS creator_kind, i.delegator_id AS creator_delegator_id,
       (SELECT pk.kind FROM identities pk WHERE pk.id = i.delegator_id) AS creator_delegator_kind,
       p.version AS policy_version,
       coalesce(i.offboarded_at IS NULL
                AND EXISTS (SELECT 1 FROM memberships m WHERE m.identity_id = i.id AND m.tenant_id = c.tenant_id)
                AND (i.delegator_id IS NULL OR EXISTS (
                    SELECT 1 FROM identities pi JOIN memberships pm ON pm.identity_id = pi.id
                    WHERE pi.id = i.delegator_id AND pi.offboarded_at IS NULL AND pm.tenant_id = c.tenant_id)),
                false) AS creator_active"""

# The tenants with a pending delivery (each queue of a webhook and subject with a pending delivery
# has a head): a skip scan of webhook_deliveries_heads, one index probe per tenant.
_TENANTS = """
tenant_scan(tenant_id) AS (
    (SELECT tenant_id FROM webhook_deliveries WHERE state = 'pending' AND head ORDER BY tenant_id LIMIT 1)
    UNION ALL
    SELECT (SELECT d.tenant_id FROM webhook_deliveries d
            WHERE d.state = 'pending' AND d.head AND d.tenant_id > s.tenant_id
            ORDER BY d.tenant_id LIMIT 1)
    FROM tenant_scan s WHERE s.tenant_id IS NOT NULL
),
tenants AS (
    SELECT tenant_id FROM tenant_scan WHERE tenant_id IS NOT NULL
)"""

# A tenant's due heads, oldest due first: the earliest pending delivery of its webhook and subject
# (`head`, kept by the fan-out trigger and PROMOTE; the NOT EXISTS guards the order should two
# writers of one subject have raced), below every event writer still open (_FINAL).
_DUE_HEADS = f"""
        FROM webhook_deliveries d
        WHERE d.tenant_id = t.tenant_id AND d.state = 'pending' AND d.head
          AND d.next_attempt_at <= compute_now() AND d.event_id < (SELECT below FROM final)
          AND {_FIRST_OF_SUBJECT}
        ORDER BY d.next_attempt_at, d.event_id"""

# Due heads, oldest due first, at most `tenant_limit` leases per tenant counting those already
# held; per tenant with pending deliveries it reads at most its free slots' worth of rows, however
# long its backlog. The claim counts the attempt, leases the row and writes the lease (dropping
# leases that ended): if the worker dies, the row is due again when the lease ends. Two rows of one
# webhook and subject are never claimed together, nor while the earlier one is leased (it stays
# pending, and the head).
CLAIM = f"""
WITH RECURSIVE {_BUSY},{_FINAL},{_TENANTS},
candidates AS (
    SELECT c.webhook_id, c.event_id, c.next_attempt_at
    FROM tenants t
    LEFT JOIN busy b ON b.tenant_id = t.tenant_id
    CROSS JOIN LATERAL (
        SELECT d.webhook_id, d.event_id, d.next_attempt_at{_DUE_HEADS}
        LIMIT greatest(%(tenant_limit)s - coalesce(b.leased, 0), 0)
    ) c
),
due AS (
    SELECT d.webhook_id, d.event_id
    FROM webhook_deliveries d
    JOIN candidates c ON c.webhook_id = d.webhook_id AND c.event_id = d.event_id
    ORDER BY c.next_attempt_at, c.event_id
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
),
claimed AS (
    UPDATE webhook_deliveries d
    SET attempts = d.attempts + 1,
        last_attempt_at = compute_now(),
        leased_until = compute_now() + make_interval(secs => %(lease_seconds)s),
        next_attempt_at = compute_now() + make_interval(secs => %(lease_seconds)s)
    FROM due, webhooks w, events e
    WHERE d.webhook_id = due.webhook_id AND d.event_id = due.event_id
      AND w.id = d.webhook_id AND e.id = d.event_id
    RETURNING d.webhook_id, d.event_id, d.attempts, d.leased_until, w.url, w.secret, w.event_types, w.created_by,
              e.id, e.type, e.subject, e.tenant_id, epoch_ms(e.time) AS time_ms, e.data
),
ended AS (  -- not a row claimed now: one statement must not change a row twice
    DELETE FROM webhook_leases l
    WHERE l.leased_until <= compute_now()
      AND NOT EXISTS (SELECT 1 FROM due WHERE due.webhook_id = l.webhook_id AND due.event_id = l.event_id)
),
leased AS (
    INSERT INTO webhook_leases (webhook_id, event_id, tenant_id, attempt, leased_until)
    SELECT webhook_id, event_id, tenant_id, attempts, leased_until FROM claimed
    ON CONFLICT (webhook_id, event_id) DO UPDATE
    SET attempt = EXCLUDED.attempt, leased_until = EXCLUDED.leased_until, tenant_id = EXCLUDED.tenant_id
)
SELECT c.webhook_id, c.event_id, c.attempts, c.url, c.secret, c.id, c.type, c.subject, c.tenant_id, c.time_ms,
       c.data, {_AUTHORITY}, {EVENT_RESERVATION_COLUMNS}
FROM claimed c
LEFT JOIN identities i ON i.id = c.created_by
LEFT JOIN policies p ON p.tenant_id = c.tenant_id{event_reservation_join("c.subject", "c.tenant_id")}
"""

# The outcome of an attempt, applied only if the row is still this attempt's (a lease that ran
# out was claimed again, and the newer attempt owns the row). The attempt's lease goes either way,
# its webhook deleted or not.
_UNLEASE = """
WITH unleased AS (
    DELETE FROM webhook_leases
    WHERE webhook_id = %(webhook_id)s AND event_id = %(event_id)s AND attempt = %(attempt)s
)"""

DELIVERED = f"""{_UNLEASE}
UPDATE webhook_deliveries
SET state = 'delivered', next_attempt_at = NULL, leased_until = NULL, last_status = %(status)s, last_error = ''
WHERE webhook_id = %(webhook_id)s AND event_id = %(event_id)s
  AND state = 'pending' AND attempts = %(attempt)s
"""

FAILED = f"""{_UNLEASE}
UPDATE webhook_deliveries
SET state = CASE WHEN %(dead)s THEN 'dead' ELSE 'pending' END,
    next_attempt_at = CASE WHEN %(dead)s THEN NULL
                           ELSE compute_now() + make_interval(secs => %(delay_seconds)s) END,
    leased_until = NULL,
    last_status = %(status)s, last_error = %(error)s
WHERE webhook_id = %(webhook_id)s AND event_id = %(event_id)s
  AND state = 'pending' AND attempts = %(attempt)s
"""

# After an outcome, in a statement of its own (so it sees a delivery whose fan-out waited for the
# outcome: see webhook_fan_out, migration 0050): the earliest pending delivery of the webhook and
# subject is the head. Nothing changes when the attempt's row is still pending.
PROMOTE = """
UPDATE webhook_deliveries d SET head = true
WHERE d.webhook_id = %(webhook_id)s AND d.subject = %(subject)s AND d.state = 'pending' AND NOT d.head
  AND d.event_id = (SELECT min(p.event_id) FROM webhook_deliveries p
                    WHERE p.webhook_id = %(webhook_id)s AND p.subject = %(subject)s AND p.state = 'pending')
"""

# Seconds until the next claim may find something (NULL: nothing pending): the earliest due
# delivery of a tenant under its cap, or the end of a lease (a tenant at its cap gets a slot back
# by then at the latest; a finished attempt wakes its own worker sooner). `held`: a pending
# delivery waits for an event writer still open (see _FINAL), whose end notifies nothing here.
NEXT_DUE = f"""
WITH RECURSIVE {_BUSY},{_FINAL},{_TENANTS}
SELECT extract(epoch FROM least(
    (SELECT min(n.next_attempt_at)
     FROM tenants t
     LEFT JOIN busy b ON b.tenant_id = t.tenant_id
     CROSS JOIN LATERAL (
         SELECT d.next_attempt_at
         FROM webhook_deliveries d
         WHERE d.tenant_id = t.tenant_id AND d.state = 'pending' AND d.head
           AND d.event_id < (SELECT below FROM final) AND {_FIRST_OF_SUBJECT}
         ORDER BY d.next_attempt_at, d.event_id
         LIMIT 1) n
     WHERE coalesce(b.leased, 0) < %(tenant_limit)s),
    (SELECT min(leased_until) FROM webhook_leases WHERE leased_until > compute_now())
) - compute_now())::float8 AS seconds,
EXISTS (SELECT 1 FROM webhook_deliveries d
        WHERE d.event_id >= (SELECT below FROM final) AND d.state = 'pending') AS held
"""
