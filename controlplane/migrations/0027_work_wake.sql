-- The work queue's wake-up says when the new item is due, so a runner arms a timer instead of
-- querying for an item days ahead. Payload: '<kind> <seconds>', the seconds from compute_now()
-- (the database's clock, at the sender's transaction start) to run_at, rounded up to the
-- millisecond so a timer never fires before the item is due; 0 or less: due now. A payload
-- without seconds ('clock' when the clock moved, a bare kind, an empty NOTIFY bc_work) means
-- "re-read the queue now" (controlplane/workers/queue.py).

CREATE FUNCTION work_wake(p_kind text, p_run_at timestamptz) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('bc_work', p_kind || ' '
        || (ceil(extract(epoch FROM p_run_at - compute_now()) * 1000) / 1000)::float8::text);
$$;

CREATE OR REPLACE FUNCTION schedule_work(p_kind text, p_subject text, p_run_at timestamptz) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO work_items (kind, subject, run_at) VALUES (p_kind, p_subject, p_run_at);
    SELECT work_wake(p_kind, p_run_at);
$$;

-- Unchanged but for the wake-up: every item it inserts is due now.
CREATE OR REPLACE FUNCTION wake_node_reservations(p_node_id text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO work_items (kind, subject, run_at)
    SELECT 'reservation', r.id, compute_now()
    FROM reservations r
    WHERE r.state IN ('placed', 'binding', 'active')
      AND EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = r.id AND a.node_id = p_node_id
                    AND a.state IN ('placed', 'binding', 'bound'));
    SELECT work_wake('reservation', compute_now());
$$;
