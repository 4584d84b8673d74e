-- Host resources (spec "Host resources"): a reservation books vcpu, memoryGiB and hugepages1Gi on
-- its devices' node as intervals, beside the devices.
--
-- The guard: a host booking whose node cannot give it (over any instant of its window, the sum of
-- the node's overlapping bookings of that resource plus this one exceeds allocatable, less the
-- pool's host reserve for vcpu) is refused with an exclusion violation, checked by a trigger on
-- every insert and on every update that grows a booking. The checker locks the node's
-- host_resources row first, so concurrent bookers of one node are decided one at a time and each
-- sees the bookings committed before it (the last word, as the EXCLUDE constraint is for atoms).
--
-- A host booking follows its allocation's device bookings: when they are truncated, extended or
-- deleted (release, cancel, expiry, extend, repair, a bind failure), a trigger on bookings moves
-- or deletes the allocation's host bookings with them, so no path has to remember them.

CREATE INDEX host_bookings_node ON host_bookings USING gist (node_id, resource, during);

-- CPUs of each host that are never booked (policy.hostReserve.vcpu, default 2).
CREATE FUNCTION host_reserve_vcpu(p_policy jsonb) RETURNS numeric
LANGUAGE sql IMMUTABLE AS $$
    SELECT greatest(coalesce((p_policy->'hostReserve'->>'vcpu')::numeric, 2), 0)
$$;

-- What a node can give of a resource: allocatable, less the reserve for vcpu; 0 without a row.
CREATE FUNCTION host_capacity(p_node_id text, p_resource text) RETURNS numeric
LANGUAGE sql STABLE AS $$
    SELECT coalesce((
        SELECT greatest(h.allocatable - CASE WHEN p_resource = 'vcpu' THEN host_reserve_vcpu(p.policy) ELSE 0 END, 0)
        FROM host_resources h JOIN nodes n ON n.id = h.node_id JOIN pools p ON p.id = n.pool_id
        WHERE h.node_id = p_node_id AND h.resource = p_resource), 0)
$$;

-- The most of a resource booked on a node at any instant of a window (bookings of
-- p_except_allocation left out): the load only rises where a booking starts, so it is enough to
-- look at the window's start and at every start inside it.
CREATE FUNCTION host_peak_load(p_node_id text, p_resource text, p_during tstzrange, p_except_allocation text)
RETURNS numeric
LANGUAGE sql STABLE AS $$
    SELECT coalesce(max(load), 0) FROM (
        SELECT (SELECT coalesce(sum(h.amount), 0) FROM host_bookings h
                WHERE h.node_id = p_node_id AND h.resource = p_resource AND h.during @> t.at
                  AND h.allocation_id IS DISTINCT FROM p_except_allocation) AS load
        FROM (SELECT lower(p_during) AS at
              UNION
              SELECT lower(h.during) FROM host_bookings h
              WHERE h.node_id = p_node_id AND h.resource = p_resource AND h.during && p_during
                AND lower(h.during) > lower(p_during)) t
    ) loads
$$;

-- Whether a node can give every amount of p_amounts ({"vcpu": 4, ...}) for the window (the SQL
-- shortlist's filter; the trigger below is the guard).
CREATE FUNCTION host_fits(p_node_id text, p_amounts jsonb, p_during tstzrange) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(bool_and(host_peak_load(p_node_id, a.key, p_during, NULL) + a.value::numeric
                             <= host_capacity(p_node_id, a.key)), true)
    FROM jsonb_each_text(p_amounts) a
    WHERE a.value::numeric > 0
$$;

CREATE FUNCTION host_bookings_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    peak numeric;
    capacity numeric;
BEGIN
    IF NEW.amount = 0 OR (TG_OP = 'UPDATE' AND NEW.node_id = OLD.node_id AND NEW.resource = OLD.resource
                          AND NEW.amount <= OLD.amount AND NEW.during <@ OLD.during) THEN
        RETURN NULL;  -- nothing booked, or a booking that only shrank
    END IF;
    PERFORM 1 FROM host_resources WHERE node_id = NEW.node_id AND resource = NEW.resource FOR UPDATE;
    peak := host_peak_load(NEW.node_id, NEW.resource, NEW.during, NEW.allocation_id);
    capacity := host_capacity(NEW.node_id, NEW.resource);
    IF peak + NEW.amount > capacity THEN
        RAISE EXCEPTION 'host resource % of node % is full: % booked, % asked, % can be given',
                        NEW.resource, NEW.node_id, peak, NEW.amount, capacity
            USING ERRCODE = 'exclusion_violation', CONSTRAINT = 'host_bookings_within_allocatable',
                  TABLE = 'host_bookings';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER host_bookings_guard AFTER INSERT OR UPDATE ON host_bookings
FOR EACH ROW EXECUTE FUNCTION host_bookings_guard();

-- Book p_amounts on the allocation's node for its window and set its limits, all or none: false
-- (nothing booked) when the node cannot give them. The exception block is a savepoint of its own,
-- so a refusal leaves the caller's transaction usable.
CREATE FUNCTION book_host_resources(
    p_allocation_id text, p_node_id text, p_during tstzrange, p_amounts jsonb, p_limits jsonb
) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO host_bookings (allocation_id, node_id, resource, amount, during)
    SELECT p_allocation_id, p_node_id, a.key, a.value::numeric, p_during
    FROM jsonb_each_text(p_amounts) a
    WHERE a.value::numeric > 0
    ORDER BY a.key;
    UPDATE allocations SET limits = p_limits WHERE id = p_allocation_id;
    RETURN true;
EXCEPTION WHEN exclusion_violation THEN
    RETURN false;
END $$;

-- Host bookings follow their allocation's device bookings.
CREATE FUNCTION bookings_move_host_bookings() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM host_bookings WHERE allocation_id = OLD.allocation_id;
    ELSE
        UPDATE host_bookings SET during = NEW.during
        WHERE allocation_id = NEW.allocation_id AND during <> NEW.during;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER bookings_move_host_bookings AFTER UPDATE OF during OR DELETE ON bookings
FOR EACH ROW EXECUTE FUNCTION bookings_move_host_bookings();

-- A host booking changes only what the capacity index holds of the node's bookings.
DROP TRIGGER host_bookings_capacity ON host_bookings;

CREATE FUNCTION host_bookings_capacity_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM capacity_changed(CASE WHEN TG_OP = 'DELETE' THEN OLD.node_id ELSE NEW.node_id END, 'bookings');
    RETURN NULL;
END $$;

CREATE TRIGGER host_bookings_capacity AFTER INSERT OR UPDATE OR DELETE ON host_bookings
FOR EACH ROW EXECUTE FUNCTION host_bookings_capacity_changed();

-- The capacity.hosts reconciler (controlplane.nodes.hosts): what an applied inventory makes
-- bookable. memoryGiB is the memory left beside the huge pages, in whole GiB.
CREATE FUNCTION host_resources_of(p_inventory jsonb) RETURNS TABLE (resource text, allocatable numeric)
LANGUAGE sql IMMUTABLE AS $$
    SELECT w.resource, greatest(w.amount, 0) FROM (VALUES
        ('vcpu', (p_inventory->>'vcpus')::numeric),
        ('memoryGiB', floor(((p_inventory->>'memory_bytes')::numeric
                              - coalesce((p_inventory->>'hugepages_1gi')::numeric, 0) * 1073741824
                              - coalesce((p_inventory->>'hugepages_2mi')::numeric, 0) * 2097152) / 1073741824)),
        ('hugepages2Mi', coalesce((p_inventory->>'hugepages_2mi')::numeric, 0)),
        ('hugepages1Gi', coalesce((p_inventory->>'hugepages_1gi')::numeric, 0))) AS w(resource, amount)
    WHERE p_inventory ? 'vcpus'
$$;

-- One node's rows in step with its applied inventory; a resource that dropped to 0 keeps its row
-- at 0, a node without an applied inventory is left alone. Returns the rows changed.
CREATE FUNCTION sync_host_resources(p_node_id text) RETURNS integer
LANGUAGE sql AS $$
    WITH upserted AS (
        INSERT INTO host_resources AS h (node_id, resource, allocatable)
        SELECT n.id, w.resource, w.allocatable
        FROM nodes n CROSS JOIN LATERAL host_resources_of(n.inventory) w
        LEFT JOIN host_resources o ON o.node_id = n.id AND o.resource = w.resource
        WHERE n.id = p_node_id
          AND ((o.node_id IS NULL AND w.allocatable > 0) OR o.allocatable <> w.allocatable)
        ORDER BY w.resource
        ON CONFLICT (node_id, resource) DO UPDATE SET allocatable = EXCLUDED.allocatable
        RETURNING 1
    )
    SELECT count(*)::integer FROM upserted
$$;

-- Nodes whose rows differ from their applied inventory (the reconciler's periodic pass).
CREATE FUNCTION host_resources_out_of_step() RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    SELECT n.id FROM nodes n
    WHERE EXISTS (
        SELECT 1 FROM host_resources_of(n.inventory) w
        LEFT JOIN host_resources o ON o.node_id = n.id AND o.resource = w.resource
        WHERE (o.node_id IS NULL AND w.allocatable > 0) OR o.allocatable <> w.allocatable)
    ORDER BY n.id
$$;

-- The smallest per-GPU share any GPU host of a pool can give, per resource (vcpu less the host
-- reserve, memoryGiB), counting every physical GPU of the host whether bookable or not; hosts
-- without a row of the resource are left out. For the draft's host share when the capacity index
-- is not built (controlplane.reservations.hostshare).
CREATE FUNCTION pool_host_share_per_gpu(p_pool_id text) RETURNS TABLE (resource text, per_gpu numeric)
LANGUAGE sql STABLE AS $$
    SELECT r.resource, min(host_capacity(n.id, r.resource) / g.gpus)
    FROM nodes n
    CROSS JOIN LATERAL (SELECT count(*) AS gpus FROM atoms a WHERE a.node_id = n.id AND a.kind = 'gpu') g
    CROSS JOIN (VALUES ('vcpu'), ('memoryGiB')) AS r(resource)
    WHERE n.pool_id = p_pool_id AND g.gpus > 0
      AND EXISTS (SELECT 1 FROM host_resources h WHERE h.node_id = n.id AND h.resource = r.resource)
    GROUP BY r.resource
$$;
