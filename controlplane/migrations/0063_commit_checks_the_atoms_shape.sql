-- The commit decides what the index proposed, the atoms' shape included (hostile review, fifth
-- round): every commit re-read node state, connectivity, labels, health and bookable under its
-- locks, but not the atoms' kind, model, MIG profile, NVLink domain or NUMA node, which an
-- inventory changes in place on the same atom (nodes/queries.py UPSERT_GPU, UPSERT_CHILDREN). An
-- index that had not yet heard of a regrouped NVLink fabric placed an nvlink-all request across two
-- domains; one that had not heard of a MIG repartition booked a 3g.40gb request on a 4g.40gb
-- instance. atoms_as_asked is the request's device shape checked on the atoms as they are; a
-- commit that finds them otherwise has lost a race (the caller re-reads the node and plans again).

-- Whether the atoms are what a device request asks (`p_device`: a stored request's devices[0], or
-- the same keys from an Ask): all of its class (default gpu), of its model and MIG profile when it
-- names them, and for topology nvlink-all all in one NVLink domain (none outside any), for numa
-- all on one NUMA node. False when an atom is missing.
CREATE FUNCTION atoms_as_asked(p_atom_ids text[], p_device jsonb) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT count(*) = cardinality(p_atom_ids)
       AND coalesce(bool_and(
               a.kind = coalesce(nullif(p_device->>'class', ''), 'gpu')
               AND (coalesce(p_device->>'model', '') = '' OR a.model = p_device->>'model')
               AND (coalesce(p_device->>'profile', '') = '' OR coalesce(a.profile, '') = p_device->>'profile')), true)
       AND CASE p_device->>'topology'
               WHEN 'nvlink-all' THEN count(DISTINCT a.nvlink_domain) <= 1
                                      AND coalesce(bool_and(coalesce(a.nvlink_domain, '') <> ''), true)
               WHEN 'numa' THEN count(DISTINCT a.numa_node) <= 1
               ELSE true END
    FROM atoms a WHERE a.id = ANY(p_atom_ids)
$$;

-- place_inline as in migration 0059, with that check before anything is written.
CREATE OR REPLACE FUNCTION place_inline(
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
    lock_now bigint;  -- the product clock read under the locks (clock_ms_fresh's value)
    txn_now timestamptz;  -- compute_now()'s value: the transaction's start plus the offset
    shift bigint;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended(p_lock_key, 0)),
            pg_advisory_xact_lock(hashtextextended(node_lock_key(p_node_id), 0));
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
    SELECT epoch_ms(clock_timestamp() + c.offset_ms * interval '1 millisecond'),
           now() + c.offset_ms * interval '1 millisecond'
    INTO lock_now, txn_now FROM clock c;
    shift := greatest(0, greatest(coalesce((r.request->>'start')::bigint, lock_now), lock_now) - p_start);
    IF shift > 0 THEN
        p_start := p_start + shift;
        p_end := p_end + shift;
        p_moments := ARRAY(SELECT m + shift FROM unnest(p_moments) AS m);
        p_event_data := p_event_data || jsonb_build_object('start', p_start, 'end', p_end);
    END IF;
    -- The atoms still as the request asks (the index planned on what it knew of them: an inventory
    -- may have changed a GPU's NVLink domain or NUMA node, or a MIG instance's profile, in place).
    IF NOT atoms_as_asked(p_atom_ids, r.request->'devices'->0) THEN
        RAISE EXCEPTION USING ERRCODE = 'BCP01', MESSAGE = 'placement race lost',
            DETAIL = json_build_object('node_id', p_node_id, 'reason', 'atoms-changed')::text;
    END IF;
    UPDATE authz_projection SET decision = p_decision, decided_at = txn_now WHERE reservation_id = p_id;

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

    -- leaseSeconds from now as read under the locks (compute_now() is the statement's start, which
    -- may be before a wait for them); never earlier than the caller's deadline.
    IF p_lease_deadline IS NOT NULL THEN
        lease_until := greatest(p_lease_deadline, lock_now + (r.request->>'leaseSeconds')::bigint * 1000);
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
        SELECT DISTINCT greatest(from_epoch_ms(m), txn_now)
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
    -- Last: the tenant's quota rows stay locked from here to the commit only (the answer is read
    -- above). A refusal raises and undoes everything above (the statement is its transaction).
    PERFORM charge_all(r.tenant_id, p_id, p_resources, p_amounts, p_pers, p_lenient, p_unnamed_models);
END $$;
