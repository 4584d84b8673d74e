"""The SQL of webhooks and their deliveries."""

_WEBHOOK_COLUMNS = "id, tenant_id, url, event_types, created_by, epoch_ms(created_at) AS created_ms"

CREATE = f"""
INSERT INTO webhooks (id, tenant_id, url, secret, event_types, created_by)
VALUES (%(id)s, %(tenant_id)s, %(url)s, %(secret)s, %(event_types)s, %(created_by)s)
RETURNING {_WEBHOOK_COLUMNS}
"""

GET = f"SELECT {_WEBHOOK_COLUMNS} FROM webhooks WHERE id = %(id)s AND tenant_id = %(tenant_id)s"

LIST = f"""
SELECT {_WEBHOOK_COLUMNS} FROM webhooks
WHERE tenant_id = %(tenant_id)s AND (%(cursor)s::text IS NULL OR id > %(cursor)s)
ORDER BY id
LIMIT %(limit)s
"""

DELETE = f"DELETE FROM webhooks WHERE id = %(id)s AND tenant_id = %(tenant_id)s RETURNING {_WEBHOOK_COLUMNS}"

DELIVERIES = """
SELECT d.event_id, e.type AS event_type, d.subject, d.state, d.attempts, d.last_status, d.last_error,
       epoch_ms(d.last_attempt_at) AS last_attempt_ms, epoch_ms(d.next_attempt_at) AS next_attempt_ms,
       epoch_ms(d.created_at) AS created_ms
FROM webhook_deliveries d
JOIN events e ON e.id = d.event_id
WHERE d.webhook_id = %(webhook_id)s AND (%(before)s = 0 OR d.event_id < %(before)s)
ORDER BY d.event_id DESC
LIMIT %(limit)s
"""

# Due deliveries that are the earliest pending one of their webhook and subject (order per
# subject), oldest due first. The claim counts the attempt and leases the row until
# next_attempt_at: if the worker dies, the row is due again then. Two rows of one webhook and
# subject are never claimed together, nor while the earlier one is leased (it stays pending).
CLAIM = """
WITH due AS (
    SELECT d.webhook_id, d.event_id
    FROM webhook_deliveries d
    WHERE d.state = 'pending' AND d.next_attempt_at <= compute_now()
      AND NOT EXISTS (
          SELECT 1 FROM webhook_deliveries p
          WHERE p.webhook_id = d.webhook_id AND p.subject = d.subject AND p.state = 'pending'
            AND p.event_id < d.event_id)
    ORDER BY d.next_attempt_at, d.event_id
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE webhook_deliveries d
SET attempts = d.attempts + 1,
    last_attempt_at = compute_now(),
    next_attempt_at = compute_now() + make_interval(secs => %(lease_seconds)s)
FROM due, webhooks w, events e
WHERE d.webhook_id = due.webhook_id AND d.event_id = due.event_id
  AND w.id = d.webhook_id AND e.id = d.event_id
RETURNING d.webhook_id, d.event_id, d.attempts, w.url, w.secret,
          e.id, e.type, e.subject, e.tenant_id, epoch_ms(e.time) AS time_ms, e.data
"""

# The outcome of an attempt, applied only if the row is still this attempt's (a lease that ran
# out was claimed again, and the newer attempt owns the row).
DELIVERED = """
UPDATE webhook_deliveries
SET state = 'delivered', next_attempt_at = NULL, last_status = %(status)s, last_error = ''
WHERE webhook_id = %(webhook_id)s AND event_id = %(event_id)s
  AND state = 'pending' AND attempts = %(attempt)s
"""

FAILED = """
UPDATE webhook_deliveries
SET state = CASE WHEN %(dead)s THEN 'dead' ELSE 'pending' END,
    next_attempt_at = CASE WHEN %(dead)s THEN NULL
                           ELSE compute_now() + make_interval(secs => %(delay_seconds)s) END,
    last_status = %(status)s, last_error = %(error)s
WHERE webhook_id = %(webhook_id)s AND event_id = %(event_id)s
  AND state = 'pending' AND attempts = %(attempt)s
"""

# Seconds until the next claimable delivery is due (NULL: none pending).
NEXT_DUE = """
SELECT extract(epoch FROM min(d.next_attempt_at) - compute_now())::float8 AS seconds
FROM webhook_deliveries d
WHERE d.state = 'pending'
  AND NOT EXISTS (
      SELECT 1 FROM webhook_deliveries p
      WHERE p.webhook_id = d.webhook_id AND p.subject = d.subject AND p.state = 'pending'
        AND p.event_id < d.event_id)
"""
