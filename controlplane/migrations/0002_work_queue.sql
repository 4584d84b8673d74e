-- The reconciler's durable work queue, node desired-state generations, webhooks.

-- One row per wake-up: (kind, subject) is woken at run_at (database time, compute_now()).
-- A worker claims a due row with FOR UPDATE SKIP LOCKED inside the transaction that handles it
-- and deletes it there, so a handler's effects and the wake-up's removal commit together; a
-- worker killed mid-handler rolls back and the row is claimed again.
CREATE TABLE work_items (
    id         bigserial PRIMARY KEY,
    kind       text NOT NULL CHECK (kind IN ('reservation', 'pool', 'webhook')),
    subject    text NOT NULL,
    run_at     timestamptz NOT NULL,
    attempts   integer NOT NULL DEFAULT 0,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX work_items_due ON work_items (run_at);

-- Schedule a wake-up and nudge the workers. Deliberately no unique key: an ON CONFLICT insert
-- could wait on a worker's uncommitted delete while holding a pool lock the worker wants.
-- Handlers are idempotent, so a duplicate wake-up costs one no-op pass.
CREATE FUNCTION schedule_work(p_kind text, p_subject text, p_run_at timestamptz) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO work_items (kind, subject, run_at) VALUES (p_kind, p_subject, p_run_at);
    SELECT pg_notify('bc_work', p_kind);
$$;

-- Wake a reservation's reconciler now (node reports, node changes).
CREATE FUNCTION wake_reservation(p_reservation_id text) RETURNS void
LANGUAGE sql AS $$ SELECT schedule_work('reservation', p_reservation_id, compute_now()) $$;

-- The node's desired state changes whenever its allocations do; the gateway listens on
-- bc_node_desired (payload: node id) and pushes the new state with this generation.
ALTER TABLE nodes ADD COLUMN desired_generation bigint NOT NULL DEFAULT 0;

CREATE FUNCTION bump_desired(p_node_id text) RETURNS void
LANGUAGE sql AS $$
    UPDATE nodes SET desired_generation = desired_generation + 1 WHERE id = p_node_id;
    SELECT pg_notify('bc_node_desired', p_node_id);
$$;

-- Wake every reservation with a live allocation on a node (cordon, GPU health, connectivity).
CREATE FUNCTION wake_node_reservations(p_node_id text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO work_items (kind, subject, run_at)
    SELECT 'reservation', r.id, compute_now()
    FROM reservations r
    WHERE r.state IN ('placed', 'binding', 'active')
      AND EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = r.id AND a.node_id = p_node_id
                    AND a.state IN ('placed', 'binding', 'bound'));
    SELECT pg_notify('bc_work', 'reservation');
$$;

-- How many times a reservation's binding failed (no report in time, or AllocationFailed).
ALTER TABLE reservations ADD COLUMN bind_failures integer NOT NULL DEFAULT 0;
