"""The pool leases (migration 0017): this module's table, `pool_leases`."""

# One statement per tick: renew the leases this holder still holds, take every lease-policy pool
# whose lease lapsed (or that has none), and answer every lease the holder now holds with its
# epoch. A takeover (another holder's lapsed lease, or this holder's own after it lapsed) bumps
# the epoch; a renewal keeps it. Two replicas taking the same lapsed lease at once: the row lock
# of ON CONFLICT serialises them and the second sees the first's fresh deadline and skips it.
# A pool that still has queued reservations counts as a lease pool whatever its policy says now
# (an operator's UPDATE of pools.policy; no API changes a placer): nothing else places queued
# rows, and they would wait for ever. One probe of the reservations_queued index per other pool.
TAKE_AND_RENEW = """
INSERT INTO pool_leases (pool_id, holder, epoch, deadline)
SELECT p.id, %(holder)s, 1, clock_timestamp() + %(seconds)s * interval '1 second'
FROM pools p
WHERE p.policy->>'placer' = 'lease'
   OR EXISTS (SELECT 1 FROM reservations r WHERE r.pool_id = p.id AND r.state = 'queued')
ON CONFLICT (pool_id) DO UPDATE
SET epoch = CASE WHEN pool_leases.holder = EXCLUDED.holder AND pool_leases.deadline > clock_timestamp()
                 THEN pool_leases.epoch ELSE pool_leases.epoch + 1 END,
    holder = EXCLUDED.holder,
    deadline = EXCLUDED.deadline
WHERE pool_leases.holder = EXCLUDED.holder OR pool_leases.deadline <= clock_timestamp()
RETURNING pool_id, epoch
"""

# Shutdown: this holder's leases lapse at once (the epoch stays, so the next holder's takeover
# bumps it), and the other replicas are told to take them now.
DROP = """
WITH dropped AS (
    UPDATE pool_leases SET deadline = clock_timestamp() - interval '1 millisecond'
    WHERE holder = %(holder)s
    RETURNING pool_id
)
SELECT count(pg_notify('bc_pool_leases', pool_id)) AS dropped FROM dropped
"""

# A new lease-policy pool: the lease workers take it now, not at their next tick.
ANNOUNCE = "SELECT pg_notify('bc_pool_leases', %(pool_id)s)"
