-- place_inline (migration 0032) with the lease deadline counted from its placement: leaseSeconds
-- from the clock read once the pool lock is held, not from the caller's clock (transaction 1's,
-- from before any wait for that lock, which shortened the lease by the wait). The caller passes
-- p_lease_deadline (its own reckoning, a floor; NULL: no lease) and leaves the deadline out of
-- p_moments: the wake-up at the deadline is scheduled here. Otherwise as in 0032.

CREATE OR REPLACE FUNCTION place_inline(
    p_id text, p_version bigint, p_decision text, p_undecided text[], p_lock_key text,
    p_resources text[], p_amounts bigint[], p_pers bigint[], p_lenient boolean[], p_unnamed_models text[],
    p_allocation_id text, p_node_id text, p_pool_id text, p_device_ids text[], p_atom_ids text[],
    p_selector jsonb, p_start bigint, p_end bigint, p_lease_deadline bigint, p_moments bigint[],
    p_from_states text[], p_event_data jsonb,
    OUT outcome text, OUT reservation reservations, OUT allocations jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    r reservations;
    was text;
    booked integer;
    lease_until bigint;
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

    -- leaseSeconds from now, read after the lock (compute_now() is the statement's start, which
    -- may be before a wait for it); never earlier than the caller's deadline.
    IF p_lease_deadline IS NOT NULL THEN
        SELECT greatest(p_lease_deadline, epoch_ms(clock_timestamp() + c.offset_ms * interval '1 millisecond')
                                          + (r.request->>'leaseSeconds')::bigint * 1000)
        INTO lease_until FROM clock c;
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
    PERFORM schedule_work('reservation', p_id, due)
    FROM (SELECT DISTINCT greatest(from_epoch_ms(m), compute_now()) AS due
          FROM unnest(p_moments || lease_until) AS m WHERE m IS NOT NULL) moments;
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
