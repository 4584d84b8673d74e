-- The pool-lease placer (DESIGN.md section 9): one control-plane process holds a lease-policy
-- pool's lease and places its queued reservations in batches.
--
-- A lease is a row: its holder (one id per process start), a deadline the holder renews, and a
-- fencing epoch that grows by one at every takeover, so a holder that stalled past its deadline
-- and was replaced commits nothing (its batch checks its epoch under the pool lock). Lease times
-- are the database's wall clock (clock_timestamp()), never compute_now(): they measure whether a
-- process is alive, not reservation time.
CREATE TABLE pool_leases (
    pool_id  text PRIMARY KEY REFERENCES pools (id) ON DELETE CASCADE,
    holder   text NOT NULL,
    epoch    bigint NOT NULL CHECK (epoch > 0),
    deadline timestamptz NOT NULL
);

-- The holder drains a pool's queued reservations in arrival order.
CREATE INDEX reservations_queued ON reservations (pool_id, created_at) WHERE state = 'queued';

-- Whether this holder still holds the pool's lease at this epoch (the fencing check).
CREATE FUNCTION lease_current(p_pool_id text, p_holder text, p_epoch bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM pool_leases
        WHERE pool_id = p_pool_id AND holder = p_holder AND epoch = p_epoch AND deadline > clock_timestamp())
$$;
