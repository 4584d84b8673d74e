-- Admission's locked part in one statement each (issue 9: round trips are most of a create's cost).

-- Charge every resource of a reservation or none, in one call. First, a per-model resource the
-- request could land on but does not name (a pool of several models) that the tenant limits
-- refuses it: SQLSTATE BCQ02, DETAIL {"resource", "limit"}. Then charge_quota (0020) per resource
-- in the given (sorted) order; the first that does not fit raises SQLSTATE BCQ01, DETAIL
-- {"resource", "limit", "used"}, which undoes the whole statement (and the transaction around
-- it): nothing is charged. controlplane/quota.py maps both to QUOTA_EXCEEDED.
CREATE FUNCTION charge_all(
    p_tenant_id text, p_reservation_id text, p_resources text[], p_amounts bigint[], p_pers bigint[],
    p_lenient boolean[], p_unnamed_models text[]
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    limited record;
    c record;
BEGIN
    IF cardinality(p_unnamed_models) > 0 THEN
        SELECT q.resource, q."limit" INTO limited FROM quotas q
        WHERE q.tenant_id = p_tenant_id AND q.resource = ANY(p_unnamed_models)
        ORDER BY q.resource LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'quota limits % and the request names no model', limited.resource
                USING ERRCODE = 'BCQ02',
                      DETAIL = jsonb_build_object('resource', limited.resource, 'limit', limited."limit")::text;
        END IF;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_resources), 0) LOOP
        SELECT * INTO c FROM charge_quota(p_tenant_id, p_resources[i], p_reservation_id, p_amounts[i],
                                          p_pers[i], p_lenient[i]);
        IF NOT c.charged THEN
            RAISE EXCEPTION 'quota for % exceeded', p_resources[i]
                USING ERRCODE = 'BCQ01',
                      DETAIL = jsonb_build_object('resource', p_resources[i], 'limit', c.quota_limit,
                                                  'used', c.used::text)::text;
        END IF;
    END LOOP;
END $$;

-- Transaction 2 of a create in a lease-policy pool, as one statement run in autocommit: lock the
-- reservation; unless it is still the undecided version transaction 1 read, answer what it is
-- ('missing': deleted by the draft sweeper; 'decided': a concurrent twin got there first);
-- otherwise record the allowed decision, move it to queued with its operation running, emit
-- reservation.queued, wake watchers and the pool's lease holder, and charge quota (all or none:
-- charge_all raises, and the statement undoes everything). No pool lock: the holder places it.
CREATE FUNCTION admit_queued(
    p_id text, p_version bigint, p_decision text, p_undecided text[], p_from_states text[],
    p_resources text[], p_amounts bigint[], p_pers bigint[], p_lenient boolean[], p_unnamed_models text[]
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    SELECT id, tenant_id, pool_id, state, version INTO r FROM reservations WHERE id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'missing';
    END IF;
    IF NOT (r.state = ANY(p_undecided)) OR r.version <> p_version THEN
        RETURN 'decided';
    END IF;
    UPDATE authz_projection SET decision = p_decision, decided_at = compute_now() WHERE reservation_id = p_id;
    UPDATE reservations
    SET state = 'queued', operation_state = 'running', conditions = '[]',
        version = version + 1, updated_at = clock_timestamp()
    WHERE id = p_id AND state = ANY(p_from_states);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'a % reservation cannot become queued', r.state;
    END IF;
    INSERT INTO events (tenant_id, type, subject, data)
    VALUES (r.tenant_id, 'reservation.queued', 'reservation/' || p_id,
            jsonb_build_object('state', 'queued', 'poolId', r.pool_id));
    PERFORM pg_notify('bc_events', r.tenant_id);
    PERFORM pg_notify('bc_queued', r.pool_id);
    -- Last, so the tenant's quota rows are locked only for the charge and the commit.
    PERFORM charge_all(r.tenant_id, p_id, p_resources, p_amounts, p_pers, p_lenient, p_unnamed_models);
    RETURN 'queued';
END $$;
