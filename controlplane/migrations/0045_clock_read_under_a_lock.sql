-- compute_now() as of the call, for a statement that reads the clock after waiting for a lock:
-- compute_now() is the transaction's start (now()) plus the offset in the statement's snapshot,
-- both from before any wait. This one is clock_timestamp() plus the offset as committed when it
-- runs (a VOLATILE function's query takes a snapshot of its own). The pool-lease placer's batch
-- reads it once it holds the pool lock (controlplane/reservations/queries.py, QUEUED_BATCH), so a
-- batch that waited for the lock counts windows and leases from when it places.
CREATE OR REPLACE FUNCTION compute_now_fresh() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN clock_timestamp() + (SELECT offset_ms FROM clock) * interval '1 millisecond';
END $$;
