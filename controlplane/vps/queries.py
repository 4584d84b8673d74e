"""The SQL of the vps package, the one writer of its tables: projects, provider_accounts,
provider_reservations, reservation_grants, instances, instance_segments, usage_records and
metering_progress. Times leave as epoch ms (epoch_ms) and arrive through from_epoch_ms."""

# --- projects ---------------------------------------------------------------------------------

INSERT_PROJECT = """
INSERT INTO projects (id, tenant_id, name) VALUES (%(id)s, %(tenant_id)s, %(name)s)
ON CONFLICT (tenant_id, name) DO NOTHING
"""
_PROJECT_COLUMNS = "id, tenant_id, name, epoch_ms(created_at) AS created_ms"
PROJECT_BY_NAME = f"SELECT {_PROJECT_COLUMNS} FROM projects WHERE tenant_id = %(tenant_id)s AND name = %(name)s"
PROJECTS = f"SELECT {_PROJECT_COLUMNS} FROM projects WHERE tenant_id = %(tenant_id)s ORDER BY name LIMIT %(limit)s"
PROJECT_TENANT = "SELECT tenant_id FROM projects WHERE id = %(id)s"
# Held by a project create for its transaction: the tenant's projects are counted one create at a time.
TENANT_PROJECTS_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('projects:' || %(tenant_id)s, 0))"
PROJECT_COUNT = "SELECT count(*)::int AS n FROM projects WHERE tenant_id = %(tenant_id)s"

# --- accounts -----------------------------------------------------------------------------------

_ACCOUNT_COLUMNS = "id, name, provider, endpoint, external_account, epoch_ms(created_at) AS created_ms"
INSERT_ACCOUNT = """
INSERT INTO provider_accounts (id, name, provider, endpoint, external_account)
VALUES (%(id)s, %(name)s, %(provider)s, %(endpoint)s, %(external_account)s)
"""
ACCOUNT = f"SELECT {_ACCOUNT_COLUMNS} FROM provider_accounts WHERE id = %(id)s"
# One row per account at the provider: its reservations, registered under two rows, would be
# granted twice over (each row's grants fit its own copy of the total).
EXTERNAL_ACCOUNT_LOCK = """
SELECT pg_advisory_xact_lock(hashtextextended(
    'provider-account:' || %(provider)s || ':' || %(endpoint)s || ':' || %(external_account)s, 0))
"""
ACCOUNT_AT_PROVIDER = """
SELECT id FROM provider_accounts
WHERE provider = %(provider)s AND endpoint = %(endpoint)s AND external_account = %(external_account)s
ORDER BY id LIMIT 1
"""
ACCOUNT_FOR_UPDATE = f"SELECT {_ACCOUNT_COLUMNS} FROM provider_accounts WHERE id = %(id)s FOR UPDATE"
ACCOUNTS = f"SELECT {_ACCOUNT_COLUMNS} FROM provider_accounts ORDER BY created_at, id"
DELETE_ACCOUNT = "DELETE FROM provider_accounts WHERE id = %(id)s"

# Grants that keep an account (or a reservation) from going: scheduled or active ones, and ended
# ones whose committed slot-hours are not all metered yet.
ACCOUNT_BLOCKING_GRANTS = """
SELECT id FROM reservation_grants
WHERE account_id = %(account_id)s
  AND (state IN ('scheduled', 'active')
       OR (state = 'ended' AND coalesce(metered_until, starts_at) < ends_at))
ORDER BY id
"""
# The account's instances not deleted (running, or stopped and kept at the provider), oldest
# first, and how many: an account that goes leaves them at the provider, unbilled and unmanaged.
ACCOUNT_LIVE_INSTANCES = """
SELECT id, count(*) OVER ()::int AS live FROM instances
WHERE account_id = %(account_id)s AND state <> 'deleted'
ORDER BY created_at, id LIMIT 1
"""
LIVE_GRANTS_ON = """
SELECT id FROM reservation_grants
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s AND state IN ('scheduled', 'active')
ORDER BY id
"""

# --- provider reservations --------------------------------------------------------------------

_RESERVATION_COLUMNS = """account_id, reservation_id, flavor, region, total, state, pool_id, short_total,
    epoch_ms(seen_at) AS seen_ms"""
RESERVATION = f"""
SELECT {_RESERVATION_COLUMNS} FROM provider_reservations
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s
"""
RESERVATION_FOR_UPDATE = RESERVATION + " FOR UPDATE"
RESERVATIONS_OF_ACCOUNT = f"""
SELECT {_RESERVATION_COLUMNS} FROM provider_reservations WHERE account_id = %(account_id)s
ORDER BY reservation_id
"""
RESERVATIONS_OF_ACCOUNT_FOR_UPDATE = RESERVATIONS_OF_ACCOUNT + " FOR UPDATE"
UPSERT_RESERVATION = """
INSERT INTO provider_reservations (account_id, reservation_id, flavor, region, total, state)
VALUES (%(account_id)s, %(reservation_id)s, %(flavor)s, %(region)s, %(total)s, %(state)s)
ON CONFLICT (account_id, reservation_id) DO UPDATE
SET flavor = EXCLUDED.flavor, region = EXCLUDED.region, total = EXCLUDED.total, state = EXCLUDED.state,
    seen_at = compute_now(), gone_at = NULL
"""
MARK_GONE = """
UPDATE provider_reservations SET state = 'gone', gone_at = compute_now()
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s
"""
SET_SHORT_TOTAL = """
UPDATE provider_reservations SET short_total = %(short_total)s
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s
"""
BIND = """
UPDATE provider_reservations SET pool_id = %(pool_id)s
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s
"""
POOL_EXISTS = "SELECT 1 FROM pools WHERE id = %(pool_id)s"
# The pool is the grantee's own or offered to it (read; the operator's module writes these).
POOL_OFFERED = """
SELECT 1 FROM pools p
WHERE p.id = %(pool_id)s AND (p.owner_tenant_id = %(tenant_id)s
      OR EXISTS (SELECT 1 FROM pool_offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant_id)s))
"""
# The grantee's offer row held until the grant commits, read before POOL_OFFERED: a withdrawal
# (Admin.WithdrawPoolOffer locks the row, then looks for live grants) either went first, and the
# offer is gone, or waits for the grant and sees it.
LOCK_OFFER = """
SELECT 1 FROM pool_offers WHERE pool_id = %(pool_id)s AND tenant_id = %(tenant_id)s FOR KEY SHARE
"""
TENANT_EXISTS = "SELECT 1 FROM tenants WHERE id = %(tenant_id)s"

# The peak, over time, of the slots of the live grants that have not ended yet: the sum at the
# start of each (or now), the most of those.
PEAK_LIVE_SLOTS = """
WITH live AS (
    SELECT id, slots, starts_at, ends_at FROM reservation_grants
    WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s
      AND state IN ('scheduled', 'active') AND ends_at > compute_now()
), points AS (
    SELECT greatest(starts_at, compute_now()) AS at FROM live
)
SELECT coalesce(max(s.slots), 0) AS peak,
       coalesce((SELECT array_agg(id ORDER BY id) FROM live), '{}') AS grant_ids
FROM points p
CROSS JOIN LATERAL (SELECT sum(l.slots) AS slots FROM live l WHERE l.starts_at <= p.at AND p.at < l.ends_at) s
"""

# --- grants -------------------------------------------------------------------------------------

_GRANT_COLUMNS = """id, account_id, reservation_id, pool_id, tenant_id, project_id, slots,
    epoch_ms(starts_at) AS starts_ms, epoch_ms(ends_at) AS ends_ms, state, reason, region, flavor, provider,
    issuer_tenant_id, request_hash, epoch_ms(created_at) AS created_ms,
    epoch_ms(metered_until) AS metered_ms"""
GRANT = f"SELECT {_GRANT_COLUMNS} FROM reservation_grants WHERE id = %(id)s"
GRANT_FOR_UPDATE = GRANT + " FOR UPDATE"
# The issuer's key, one create at a time: two creates under one key may name different
# reservations (different row locks), and both would find no grant and insert.
GRANT_KEY_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('grant-key:' || %(issuer)s || ':' || %(key)s, 0))"
GRANT_BY_KEY = f"""
SELECT {_GRANT_COLUMNS} FROM reservation_grants
WHERE issuer_tenant_id = %(issuer)s AND idempotency_key = %(key)s
"""
INSERT_GRANT = f"""
INSERT INTO reservation_grants (id, account_id, reservation_id, pool_id, tenant_id, project_id, slots,
    starts_at, ends_at, state, region, flavor, provider, issuer_tenant_id, idempotency_key, request_hash,
    created_by)
VALUES (%(id)s, %(account_id)s, %(reservation_id)s, %(pool_id)s, %(tenant_id)s, %(project_id)s, %(slots)s,
    from_epoch_ms(%(starts_ms)s), from_epoch_ms(%(ends_ms)s), 'scheduled', %(region)s, %(flavor)s,
    %(provider)s, %(issuer)s, %(key)s, %(request_hash)s, %(created_by)s)
RETURNING {_GRANT_COLUMNS}
"""
# Every grant but cancelled ones whose term overlaps [starts, ends).
GRANTED_OVERLAPPING = """
SELECT coalesce(sum(slots), 0)::int AS granted FROM reservation_grants
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s AND state <> 'cancelled'
  AND starts_at < from_epoch_ms(%(ends_ms)s) AND ends_at > from_epoch_ms(%(starts_ms)s)
"""
SCHEDULE_GRANT = "SELECT schedule_work('grant', %(id)s, from_epoch_ms(%(at_ms)s))"
GRANTS_OF_TENANT = f"""
SELECT {_GRANT_COLUMNS} FROM reservation_grants WHERE tenant_id = %(tenant_id)s
ORDER BY created_at DESC, id DESC LIMIT %(limit)s
"""
ALL_GRANTS = f"SELECT {_GRANT_COLUMNS} FROM reservation_grants ORDER BY created_at DESC, id DESC LIMIT %(limit)s"
SET_GRANT_STATE = f"""
UPDATE reservation_grants SET state = %(state)s, reason = coalesce(%(reason)s, reason),
    ends_at = least(ends_at, coalesce(from_epoch_ms(%(ends_ms)s), ends_at))
WHERE id = %(id)s
RETURNING {_GRANT_COLUMNS}
"""
GRANTS_ON_RESERVATION_FOR_UPDATE = f"""
SELECT {_GRANT_COLUMNS} FROM reservation_grants
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s AND state IN ('scheduled', 'active')
ORDER BY starts_at, id FOR UPDATE
"""
LIVE_GRANTS_OF_TENANT = f"""
SELECT {_GRANT_COLUMNS} FROM reservation_grants
WHERE tenant_id = %(tenant_id)s AND state IN ('scheduled', 'active') ORDER BY id
"""
# The tenant's other live grants on the reservation whose term runs past `at_ms` (a grant's end),
# oldest start first: those live at `at_ms` (renewals) and those that start after it.
NEXT_GRANTS = f"""
SELECT {_GRANT_COLUMNS} FROM reservation_grants
WHERE tenant_id = %(tenant_id)s AND account_id = %(account_id)s AND reservation_id = %(reservation_id)s
  AND id <> %(id)s AND state IN ('scheduled', 'active') AND ends_at > from_epoch_ms(%(at_ms)s)
ORDER BY starts_at, id FOR UPDATE
"""
# The grant is in its term now (by time, as below).
GRANT_IN_TERM = """
SELECT 1 FROM reservation_grants
WHERE id = %(id)s AND state IN ('scheduled', 'active') AND starts_at <= compute_now() AND ends_at > compute_now()
"""
# Grants of the reservation in their term now (by time: a start the worker has not handled yet counts).
GRANTS_IN_TERM = f"""
SELECT {_GRANT_COLUMNS},
    (SELECT count(*) FROM instances i WHERE i.grant_id = g.id AND i.state <> 'deleted')::int AS used
FROM reservation_grants g
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s AND state IN ('scheduled', 'active')
  AND starts_at <= compute_now() AND ends_at > compute_now()
ORDER BY starts_at, id
"""

# --- instances ----------------------------------------------------------------------------------

_INSTANCE_COLUMNS = """id, tenant_id, project_id, pool_id, account_id, reservation_id, flavor, name, state,
    grant_id, placement, billing, request_hash, epoch_ms(created_at) AS created_ms"""
INSTANCE = f"SELECT {_INSTANCE_COLUMNS} FROM instances WHERE id = %(id)s"
INSTANCE_IN_TENANT = f"SELECT {_INSTANCE_COLUMNS} FROM instances WHERE id = %(id)s AND tenant_id = %(tenant_id)s"
INSTANCE_FOR_UPDATE = INSTANCE + " FOR UPDATE"
# Held by an instance create for its transaction: the tenant's creates are decided one at a time,
# so neither two creates under one key nor the instances-per-tenant count race (taken first).
TENANT_INSTANCES_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('instances:' || %(tenant_id)s, 0))"
INSTANCE_BY_KEY = f"""
SELECT {_INSTANCE_COLUMNS} FROM instances WHERE tenant_id = %(tenant_id)s AND idempotency_key = %(key)s
"""
INSTANCES_OF_TENANT = f"""
SELECT {_INSTANCE_COLUMNS} FROM instances WHERE tenant_id = %(tenant_id)s AND state <> 'deleted'
ORDER BY created_at, id
"""
INSERT_INSTANCE = f"""
INSERT INTO instances (id, tenant_id, project_id, pool_id, account_id, reservation_id, flavor, name, state,
    grant_id, placement, billing, idempotency_key, request_hash)
VALUES (%(id)s, %(tenant_id)s, %(project_id)s, %(pool_id)s, %(account_id)s, %(reservation_id)s, %(flavor)s,
    %(name)s, 'running', %(grant_id)s, %(placement)s, %(billing)s, %(key)s, %(request_hash)s)
RETURNING {_INSTANCE_COLUMNS}
"""
# A create the provider refused, unless a retry under its key had the provider's answer since.
DELETE_INSTANCE_ROW = "DELETE FROM instances WHERE id = %(id)s AND confirmed_at IS NULL RETURNING id"
# A create the provider did not answer: deleted, its key free for a retry to decide anew; unless a
# retry under its key had the provider's answer since (then it stands).
GIVE_UP_INSTANCE = """
UPDATE instances SET state = 'deleted', deleted_at = compute_now(), idempotency_key = 'given-up:' || id
WHERE id = %(id)s AND confirmed_at IS NULL
RETURNING id
"""
# The provider answered the create: from now on it is never given up. Not once it was given up
# (or deleted): then nothing is confirmed.
CONFIRM_INSTANCE = f"""
UPDATE instances SET confirmed_at = coalesce(confirmed_at, compute_now())
WHERE id = %(id)s AND state <> 'deleted'
RETURNING {_INSTANCE_COLUMNS}
"""
# The rows of instances a provider account reports (the drift check's read).
INSTANCE_STATES = "SELECT id, state FROM instances WHERE id = ANY(%(ids)s)"
# A pool's reservation of a flavor that instances may use: bound to the pool, ready first, then one
# where the tenant has a grant in its term with a slot its instances do not hold (serving the
# instance's project, for a billed instance) and that is not physically full, so its instance goes
# into its grant.
# Every reservation of the flavor bound to the pool, locked in one order (any two creates lock
# them alike), each with whether the caller has a grant on it in its term with a slot to spare
# (`own_grant`): the create tries them in order of preference (instances.create).
POOL_RESERVATIONS_FOR_UPDATE = f"""
SELECT {_RESERVATION_COLUMNS},
    EXISTS (SELECT 1 FROM reservation_grants g
            WHERE g.account_id = r.account_id AND g.reservation_id = r.reservation_id
              AND g.tenant_id = %(tenant_id)s AND %(billing)s = 'standard'
              AND (g.project_id IS NULL OR g.project_id = %(project_id)s)
              AND g.state IN ('scheduled', 'active') AND g.starts_at <= compute_now() AND g.ends_at > compute_now()
              AND g.slots > (SELECT count(*) FROM instances i WHERE i.grant_id = g.id AND i.state <> 'deleted')
              AND r.total > (SELECT count(*) FROM instances i
                             WHERE i.account_id = r.account_id AND i.reservation_id = r.reservation_id
                               AND i.placement <> 'on-demand'
                               AND (i.state = 'running' OR (i.state = 'stopped' AND i.grant_id IS NOT NULL)))) AS own_grant
FROM provider_reservations r
WHERE pool_id = %(pool_id)s AND flavor = %(flavor)s
ORDER BY account_id, reservation_id
FOR UPDATE
"""
ACCOUNT_OF_RESERVATION = "SELECT provider, endpoint, external_account FROM provider_accounts WHERE id = %(id)s"
# Slots held on the reservation: running instances, and stopped ones a grant keeps the slot for.
HELD = """
SELECT count(*) FILTER (WHERE grant_id IS NULL)::int AS outside, count(*)::int AS held
FROM instances
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s AND placement <> 'on-demand'
  AND (state = 'running' OR (state = 'stopped' AND grant_id IS NOT NULL)) AND id <> %(except)s
"""
SET_INSTANCE = f"""
UPDATE instances SET state = %(state)s, grant_id = %(grant_id)s, placement = %(placement)s,
    deleted_at = CASE WHEN %(state)s = 'deleted' THEN compute_now() END
WHERE id = %(id)s
RETURNING {_INSTANCE_COLUMNS}
"""
# The tenant's instances on the reservation (billed, of the grant's project if it names one) that
# ran at the reservation rate after `at_ms` (a grant's start): running so now, or stopped, deleted
# or started again since (a start in the past, or a late worker), oldest first.
RESERVED_SINCE = f"""
SELECT {_INSTANCE_COLUMNS} FROM instances i
WHERE tenant_id = %(tenant_id)s AND account_id = %(account_id)s AND reservation_id = %(reservation_id)s
  AND billing = 'standard' AND (%(project_id)s::text IS NULL OR project_id = %(project_id)s)
  AND EXISTS (SELECT 1 FROM instance_segments s
              WHERE s.instance_id = i.id AND s.class = 'reserved'
                AND coalesce(s.ended_at, 'infinity') > greatest(s.started_at, from_epoch_ms(%(at_ms)s)))
ORDER BY created_at, id FOR UPDATE
"""
# The grant's instances, and those that ran in it after `at_ms` (its end) though they are no longer
# in it (stopped or deleted since), oldest first; `ran_since`: it ran in the grant after `at_ms`.
GRANT_INSTANCES_SINCE = f"""
SELECT {_INSTANCE_COLUMNS}, ran.since AS ran_since FROM instances i
CROSS JOIN LATERAL (
    SELECT EXISTS (SELECT 1 FROM instance_segments s
                   WHERE s.instance_id = i.id AND s.class = 'grant' AND s.grant_id = %(grant_id)s
                     AND coalesce(s.ended_at, 'infinity') > greatest(s.started_at, from_epoch_ms(%(at_ms)s)))
           AS since) ran
WHERE tenant_id = %(tenant_id)s AND account_id = %(account_id)s AND reservation_id = %(reservation_id)s
  AND ((grant_id = %(grant_id)s AND state <> 'deleted') OR ran.since)
ORDER BY created_at, id FOR UPDATE OF i
"""
GRANT_USED = "SELECT count(*)::int AS used FROM instances WHERE grant_id = %(grant_id)s AND state <> 'deleted'"
ON_RESERVATION = f"""
SELECT {_INSTANCE_COLUMNS} FROM instances
WHERE account_id = %(account_id)s AND reservation_id = %(reservation_id)s AND state <> 'deleted'
ORDER BY created_at, id FOR UPDATE
"""

# Re-classing an instance's minutes from `at_ms` on: its billing segments of class `was` (in
# grant `was_grant`; NULL: in none) that start then or later become of `class` (in grant
# `grant_id`), and one that spans `at_ms` (closed, or still open) ends there, its rest of `class`.
# A grant start or end applied late (a start in the past, a late worker) re-classes this way
# whatever ran since, so every minute is billed once, at the rate of its moment.
RECLASS_SEGMENTS = """
UPDATE instance_segments SET class = %(class)s, grant_id = %(grant_id)s
WHERE instance_id = %(instance_id)s AND class = %(was)s AND grant_id IS NOT DISTINCT FROM %(was_grant)s
  AND started_at >= from_epoch_ms(%(at_ms)s)
"""
SPLIT_SEGMENT = """
WITH cut AS (
    UPDATE instance_segments s SET ended_at = from_epoch_ms(%(at_ms)s)
    FROM (SELECT id, ended_at FROM instance_segments
          WHERE instance_id = %(instance_id)s AND class = %(was)s AND grant_id IS NOT DISTINCT FROM %(was_grant)s
            AND started_at < from_epoch_ms(%(at_ms)s)
            AND coalesce(ended_at, 'infinity') > from_epoch_ms(%(at_ms)s)) old
    WHERE s.id = old.id
    RETURNING s.instance_id, s.tenant_id, s.pool_id, s.region, s.provider, old.ended_at
)
INSERT INTO instance_segments (instance_id, tenant_id, class, grant_id, pool_id, region, provider, started_at,
                               ended_at)
SELECT instance_id, tenant_id, %(class)s, %(grant_id)s, pool_id, region, provider, from_epoch_ms(%(at_ms)s),
       ended_at
FROM cut
"""

# Billing segments: close the open one at `at` (never before it started), open one from there,
# never before the instance's last segment ended: compute_now() is its transaction's start, and a
# call that waited for the reservation's lock started before the one that went first, so its
# time alone could overlap the segment that call closed (and bill the overlap twice).
CLOSE_SEGMENT = """
UPDATE instance_segments SET ended_at = greatest(started_at, coalesce(from_epoch_ms(%(at_ms)s), compute_now()))
WHERE instance_id = %(instance_id)s AND ended_at IS NULL
RETURNING epoch_ms(ended_at) AS ended_ms
"""
OPEN_SEGMENT = """
INSERT INTO instance_segments (instance_id, tenant_id, class, grant_id, pool_id, region, provider, started_at)
VALUES (%(instance_id)s, %(tenant_id)s, %(class)s, %(grant_id)s, %(pool_id)s, %(region)s, %(provider)s,
        greatest(coalesce(from_epoch_ms(%(at_ms)s), compute_now()),
                 (SELECT max(ended_at) FROM instance_segments WHERE instance_id = %(instance_id)s)))
"""

# --- metering -----------------------------------------------------------------------------------


# vm.grant.slot.hours: every committed slot of every hour of the term that has ended (more than
# `settle` seconds ago), whether used or not; fractions at a term's ends.
METER_GRANTS = """
WITH due AS (
    SELECT g.id, g.tenant_id, g.pool_id, g.region, g.provider, g.slots, g.starts_at, g.ends_at, h.hour
    FROM reservation_grants g
    CROSS JOIN LATERAL generate_series(
        date_trunc('hour', coalesce(g.metered_until, g.starts_at)),
        least(date_trunc('hour', g.ends_at - interval '1 microsecond'),
              date_trunc('hour', compute_now() - make_interval(secs => %(settle)s)) - interval '1 hour'),
        interval '1 hour') AS h(hour)
    WHERE g.state <> 'cancelled' AND coalesce(g.metered_until, g.starts_at) < g.ends_at
      AND g.starts_at < date_trunc('hour', compute_now() - make_interval(secs => %(settle)s))
), rows AS (
    INSERT INTO usage_records (tenant_id, meter, subject, hour, quantity, region, pool_id, provider)
    SELECT tenant_id, 'vm.grant.slot.hours', 'grant/' || id, hour,
           slots * extract(epoch FROM least(hour + interval '1 hour', ends_at) - greatest(hour, starts_at)) / 3600,
           region, pool_id, provider
    FROM due
    WHERE least(hour + interval '1 hour', ends_at) > greatest(hour, starts_at)
    ON CONFLICT DO NOTHING
    RETURNING 1
)
UPDATE reservation_grants g
SET metered_until = greatest(coalesce(g.metered_until, g.starts_at),
                             least(g.ends_at, date_trunc('hour', compute_now() - make_interval(secs => %(settle)s))))
WHERE g.id IN (SELECT id FROM due)
RETURNING g.id, (SELECT count(*) FROM rows) AS written
"""

PROGRESS_FOR_UPDATE = "SELECT metered_until FROM metering_progress WHERE source = %(source)s FOR UPDATE"
INSERT_PROGRESS = """
INSERT INTO metering_progress (source, metered_until) VALUES (%(source)s, %(at)s) ON CONFLICT DO NOTHING
"""
SET_PROGRESS = "UPDATE metering_progress SET metered_until = %(at)s WHERE source = %(source)s"
FIRST_SEGMENT_HOUR = "SELECT date_trunc('hour', min(started_at)) AS hour FROM instance_segments"
# The last hour start that may be metered now (its hour ended `settle` seconds ago or more).
LAST_METERABLE_HOUR = """
SELECT date_trunc('hour', compute_now() - make_interval(secs => %(settle)s)) - interval '1 hour' AS hour
"""
# The last hour the instance meter may write: also before the hour of any grant start or end that
# is due but not applied yet (a late worker dates it back, moving instances' segments from then).
INSTANCES_METERABLE_HOUR = """
SELECT least(date_trunc('hour', compute_now() - make_interval(secs => %(settle)s)) - interval '1 hour',
             (SELECT date_trunc('hour', min(CASE state WHEN 'scheduled' THEN starts_at ELSE ends_at END))
                     - interval '1 hour'
              FROM reservation_grants
              WHERE (state = 'scheduled' AND starts_at <= compute_now())
                 OR (state = 'active' AND ends_at <= compute_now()))) AS hour
"""
# vm.grant.usage.hours (informational), vm.reserved.instance.hours, vm.ondemand.instance.hours:
# what each instance ran as during the hour.
METER_INSTANCES_HOUR = """
INSERT INTO usage_records (tenant_id, meter, subject, hour, quantity, region, pool_id, provider)
SELECT s.tenant_id,
       CASE s.class WHEN 'grant' THEN 'vm.grant.usage.hours' WHEN 'reserved' THEN 'vm.reserved.instance.hours'
                    ELSE 'vm.ondemand.instance.hours' END,
       'instance/' || s.instance_id, %(hour)s,
       sum(extract(epoch FROM least(coalesce(s.ended_at, 'infinity'), %(hour)s + interval '1 hour')
                              - greatest(s.started_at, %(hour)s))) / 3600,
       s.region, s.pool_id, s.provider
FROM instance_segments s
WHERE s.started_at < %(hour)s + interval '1 hour' AND coalesce(s.ended_at, 'infinity') > %(hour)s
GROUP BY s.tenant_id, s.class, s.instance_id, s.region, s.pool_id, s.provider
HAVING sum(extract(epoch FROM least(coalesce(s.ended_at, 'infinity'), %(hour)s + interval '1 hour')
                              - greatest(s.started_at, %(hour)s))) > 0
ON CONFLICT DO NOTHING
"""
# The window's sum and row count ride on every row (window functions run before the LIMIT), so
# the total counts the rows beyond the limit too, read in the same snapshot as the rows.
USAGE = """
SELECT meter, subject, epoch_ms(hour) AS hour_ms, quantity::float8 AS quantity, region, pool_id, provider,
       (sum(quantity) OVER ())::float8 AS window_total, count(*) OVER () AS window_rows
FROM usage_records
WHERE tenant_id = %(tenant_id)s
  AND (%(meter)s = '' OR meter = %(meter)s OR (right(%(meter)s, 1) = '.' AND starts_with(meter, %(meter)s)))
  AND (%(pool_id)s = '' OR pool_id = %(pool_id)s)
  AND hour >= from_epoch_ms(%(from_ms)s) AND hour < from_epoch_ms(%(to_ms)s)
ORDER BY hour, meter, subject
LIMIT %(limit)s
"""

# The GPU-hours one reservation held in [from, to) (a stretch of it, active, within one hour), from
# its bookings: each physical GPU (a MIG instance or a slot is its parent GPU's) for the time any
# of its atoms was booked, at 1 while the whole GPU was, else at the share booked (at most 1). So a
# GPU that joined a node lease later counts from its booking, not from the stretch's start, and a
# GPU booked whole beside its MIG instances counts once.
GPU_HOURS_HELD = """
WITH held AS (
    SELECT DISTINCT a.id AS atom, coalesce(a.parent_id, a.id) AS gpu, a.parent_id IS NULL AS whole,
           a.gpu_equivalent AS share, b.during * tstzrange(%(from)s, %(to)s) AS during
    FROM bookings b
    JOIN allocations al ON al.id = b.allocation_id
    JOIN atoms a ON a.id = b.atom_id
    WHERE al.reservation_id = %(id)s AND b.during && tstzrange(%(from)s, %(to)s)
), points AS (
    SELECT gpu, lower(during) AS at FROM held UNION SELECT gpu, upper(during) FROM held
), pieces AS (
    SELECT gpu, at AS since, lead(at) OVER (PARTITION BY gpu ORDER BY at) AS until FROM points
)
SELECT coalesce(sum(extract(epoch FROM p.until - p.since) / 3600 * w.share), 0)::float8 AS gpu_hours
FROM pieces p
CROSS JOIN LATERAL (
    SELECT CASE WHEN bool_or(h.whole) THEN 1 ELSE least(1, sum(h.share)) END AS share
    FROM (SELECT DISTINCT atom, whole, share FROM held h
          WHERE h.gpu = p.gpu AND h.during @> p.since) h
) w
WHERE p.until IS NOT NULL
"""
# gpu.hours of one reservation for one hour (from controlplane.reservations.usage's stretches).
INSERT_USAGE = """
INSERT INTO usage_records (tenant_id, meter, subject, hour, quantity, region, pool_id, provider)
VALUES (%(tenant_id)s, %(meter)s, %(subject)s, %(hour)s, %(quantity)s, %(region)s, %(pool_id)s, %(provider)s)
ON CONFLICT DO NOTHING
"""
