-- The live-drafts cap per identity (DESIGN.md 7a), held under concurrency. Transaction 1 counted
-- the identity's unfinished creates (drafts and requests awaiting confirmation) in one statement
-- and inserted its draft in another, with nothing between them, so concurrent creates with
-- distinct keys from one identity each saw room and all inserted, past the cap.
--
-- draft_room runs in the draft's insert statement (autocommit: the statement is its transaction,
-- so its lock is held until the draft commits). Each query of a VOLATILE plpgsql function takes a
-- fresh snapshot, so the count after the lock sees every draft committed before it.
--
-- Far from the cap (the count transaction 1 read, `seen`, plus max_connections is within it) the
-- identity's lock is taken SHARED: creates do not wait for each other. Every create in flight
-- holds a backend from its count to its commit, so at most max_connections of them are uncounted
-- by any one count: the shared count, re-read under the lock, must still leave that much room.
-- Near the cap the lock is EXCLUSIVE (it waits for the shared holders to commit, and they for it),
-- and the exact count under it decides. A shared count that finds the identity near the cap after
-- all raises draft-room-near: the caller runs the insert again as near (seen = cap).
CREATE OR REPLACE FUNCTION draft_room(p_identity text, p_cap integer, p_seen integer) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key bigint := hashtextextended('drafts:' || p_identity, 0);
    backends integer := current_setting('max_connections')::integer;
    live integer;
BEGIN
    IF p_seen + backends <= p_cap THEN
        PERFORM pg_advisory_xact_lock_shared(lock_key);
    ELSE
        PERFORM pg_advisory_xact_lock(lock_key);
    END IF;
    SELECT count(*) INTO live FROM (
        SELECT 1 FROM reservations
        WHERE owner_identity_id = p_identity AND state IN ('draft', 'awaiting-confirmation')
        LIMIT p_cap) d;
    IF p_seen + backends <= p_cap THEN
        IF live + backends > p_cap THEN
            RAISE EXCEPTION 'identity % is near its draft cap', p_identity
                USING ERRCODE = 'check_violation', CONSTRAINT = 'reservations_draft_room_near';
        END IF;
    ELSIF live >= p_cap THEN
        RAISE EXCEPTION 'identity % holds % unfinished creates', p_identity, live
            USING ERRCODE = 'check_violation', CONSTRAINT = 'reservations_draft_room';
    END IF;
    RETURN true;
END $$;


-- The product clock in epoch milliseconds once a lock is held: compute_now_fresh (migration 0045)
-- reads it with a snapshot of its own, so a statement that waited for a lock reads it after the
-- wait, whereas compute_now() (the transaction's start) reads it as before.
CREATE OR REPLACE FUNCTION clock_ms_fresh() RETURNS bigint
LANGUAGE sql VOLATILE AS $$ SELECT epoch_ms(compute_now_fresh()) $$;

-- place_inline (migrations 0032, 0042) with the window placed at the clock under the pool lock:
-- a start that passed between transaction 1 (whose clock the caller planned at) and the lock
-- begins at placement with the full duration (spec "Start"), and a window without a start begins
-- at placement, not at transaction 1. A window that moves may no longer fit its planned
-- bookings: the EXCLUDE constraint skips them and the race is lost, so the caller plans again.
-- Otherwise as in 0042.
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
