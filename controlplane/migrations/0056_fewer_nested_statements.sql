-- Fewer nested statements per placement (issue 9: PostgreSQL's CPU per create). A create ran
-- about 85 statements inside PostgreSQL (pg_stat_statements.track = all), 19 of them calls of
-- epoch_ms and 6 of them the work queue's per-moment insert and wake-up; each is an executor
-- start-up of its own.
--
-- epoch_ms was declared IMMUTABLE but its body is not (extract(epoch FROM timestamptz) is STABLE),
-- so PostgreSQL never inlined it: every call ran as a function of its own. The same milliseconds
-- from the difference to the epoch (timestamptz - timestamptz and extract from an interval are
-- immutable): inlined into the statements that use it. Same values, to the rounding (a test
-- compares them over a range of instants, before 1970 included). booking_delta_op likewise: its
-- `text || bigint` resolves to a STABLE operator; with explicit ::text casts (the same text) it is
-- immutable and inlined.
--
-- schedule_moments inserts a subject's moments in one statement and wakes
-- the queue once, for the earliest of them: a runner keeps one timer for the earliest item and a
-- later item only moved it earlier (controlplane/workers/queue.py), so the later wake-ups said
-- nothing. place_inline (0046) uses it, and so do the create path's statements in
-- controlplane/reservations/queries.py.
--
-- place_inline also books the allocation's host resources (p_host, p_limits: book_host_resources,
-- migration 0018), so a create in a pool with a host share (every GPU books its vCPUs and memory)
-- is one statement too. It took the general path, which holds the pool lock across five round
-- trips to the control plane: with the control plane busy, every create of the pool queued
-- behind them (bench.fleet: the lock's statement waited 160 ms on average, 22 creates/s).

CREATE OR REPLACE FUNCTION epoch_ms(t timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT (extract(epoch FROM (t - timestamptz 'epoch')) * 1000)::bigint $$;

CREATE OR REPLACE FUNCTION booking_delta_op(p_op text, p_atom_id text, p_during tstzrange) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_op || p_atom_id || ',' || epoch_ms(lower(p_during))::text || ','
           || coalesce(epoch_ms(upper(p_during)), 9223372036854775807)::text
$$;

-- One subject's items, one per moment given (NULLs skipped), and one wake-up for the earliest;
-- nothing for none.
CREATE FUNCTION schedule_moments(p_kind text, p_subject text, p_run_ats timestamptz[]) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO work_items (kind, subject, run_at)
    SELECT p_kind, p_subject, t FROM unnest(p_run_ats) AS t WHERE t IS NOT NULL;
    SELECT work_wake(p_kind, min(t)) FROM unnest(p_run_ats) AS t HAVING min(t) IS NOT NULL;
$$;

DROP FUNCTION place_inline(
    text, bigint, text, text[], text, text[], bigint[], bigint[], boolean[], text[],
    text, text, text, text[], text[], jsonb, bigint, bigint, bigint, bigint[], text[], jsonb);

CREATE FUNCTION place_inline(
    p_id text, p_version bigint, p_decision text, p_undecided text[], p_lock_key text,
    p_resources text[], p_amounts bigint[], p_pers bigint[], p_lenient boolean[], p_unnamed_models text[],
    p_allocation_id text, p_node_id text, p_pool_id text, p_device_ids text[], p_atom_ids text[],
    p_selector jsonb, p_start bigint, p_end bigint, p_lease_deadline bigint, p_moments bigint[],
    p_from_states text[], p_event_data jsonb, p_host jsonb, p_limits jsonb,
    OUT outcome text, OUT reservation reservations, OUT allocations jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    r reservations;
    was text;
    booked integer;
    lease_until bigint;
    lock_now bigint;
    shift bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_key, 0));
    SELECT * INTO r FROM reservations WHERE id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        outcome := 'missing';
        RETURN;
    END IF;
    IF NOT (r.state = ANY(p_undecided)) OR r.version <> p_version THEN
        outcome := 'decided';
        RETURN;
    END IF;
    was := r.state;
    -- The window at the clock under the lock (ask_for's rule): a start still ahead is kept,
    -- otherwise the window begins now with the full duration. The caller planned it at
    -- transaction 1's clock; the window, its moments and its event move later by the difference.
    lock_now := clock_ms_fresh();
    shift := greatest(0, greatest(coalesce((r.request->>'start')::bigint, lock_now), lock_now) - p_start);
    IF shift > 0 THEN
        p_start := p_start + shift;
        p_end := p_end + shift;
        p_moments := ARRAY(SELECT m + shift FROM unnest(p_moments) AS m);
        p_event_data := p_event_data || jsonb_build_object('start', p_start, 'end', p_end);
    END IF;
    UPDATE authz_projection SET decision = p_decision, decided_at = compute_now() WHERE reservation_id = p_id;
    PERFORM charge_all(r.tenant_id, p_id, p_resources, p_amounts, p_pers, p_lenient, p_unnamed_models);

    INSERT INTO allocations (id, reservation_id, node_id, device_ids, state)
    VALUES (p_allocation_id, p_id, p_node_id, p_device_ids, 'placed');
    INSERT INTO bookings (atom_id, allocation_id, during)
    SELECT a.id, p_allocation_id, tstzrange(from_epoch_ms(p_start), from_epoch_ms(p_end), '[)')
    FROM atoms a JOIN nodes n ON n.id = a.node_id
    WHERE a.id = ANY(p_atom_ids)
      AND n.id = p_node_id
      AND n.pool_id = p_pool_id
      AND n.state = 'ready'
      AND n.connectivity <> 'unreachable'
      AND n.labels @> p_selector
      AND a.health = 'healthy' AND a.bookable
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS booked = ROW_COUNT;
    IF booked <> cardinality(p_atom_ids) THEN
        RAISE EXCEPTION USING ERRCODE = 'BCP01', MESSAGE = 'placement race lost',
            DETAIL = json_build_object('node_id', p_node_id, 'booked', booked,
                                       'wanted', cardinality(p_atom_ids))::text;
    END IF;
    -- The allocation's host resources for the same window, and its limits (migration 0018's
    -- guard decides, as in the general path's BOOK_HOST): a node that cannot give them is a lost
    -- race like a booked atom (the caller re-reads the node and plans again).
    IF p_host IS NOT NULL AND p_host <> '{}' AND NOT book_host_resources(
            p_allocation_id, p_node_id, tstzrange(from_epoch_ms(p_start), from_epoch_ms(p_end), '[)'), p_host, p_limits) THEN
        RAISE EXCEPTION USING ERRCODE = 'BCP01', MESSAGE = 'placement race lost',
            DETAIL = json_build_object('node_id', p_node_id, 'host', p_host)::text;
    END IF;

    -- leaseSeconds from now, read after the lock (compute_now() is the statement's start, which
    -- may be before a wait for it); never earlier than the caller's deadline.
    IF p_lease_deadline IS NOT NULL THEN
        lease_until := greatest(p_lease_deadline, clock_ms_fresh() + (r.request->>'leaseSeconds')::bigint * 1000);
    END IF;
    UPDATE reservations
    SET state = 'placed', operation_state = 'succeeded', conditions = '[]',
        during = tstzrange(from_epoch_ms(p_start), from_epoch_ms(p_end), '[)'),
        lease_deadline = CASE WHEN lease_until IS NULL THEN lease_deadline ELSE from_epoch_ms(lease_until) END,
        attempts = attempts + 1, version = version + 1, updated_at = clock_timestamp()
    WHERE id = p_id AND state = ANY(p_from_states)
    RETURNING * INTO r;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'a % reservation cannot become placed', was;
    END IF;
    PERFORM schedule_moments('reservation', p_id, ARRAY(
        SELECT DISTINCT greatest(from_epoch_ms(m), compute_now())
        FROM unnest(p_moments || lease_until) AS m WHERE m IS NOT NULL));
    INSERT INTO events (tenant_id, type, subject, data)
    VALUES (r.tenant_id, 'reservation.placed', 'reservation/' || p_id, p_event_data);
    PERFORM pg_notify('bc_events', r.tenant_id);

    outcome := 'placed';
    reservation := r;
    allocations := coalesce((
        SELECT jsonb_agg(jsonb_build_object('id', a.id, 'node_id', a.node_id, 'device_ids', a.device_ids,
                                            'state', a.state, 'binding', a.binding, 'limits', a.limits)
                         ORDER BY a.created_at, a.id)
        FROM allocations a WHERE a.reservation_id = p_id), '[]');
END $$;
