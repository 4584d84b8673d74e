-- A host booking that only grows later (extend: same node, resource and start, an amount no
-- larger, a later end) is checked over the time it adds, [old end, new end), not over its whole
-- window: the time it already holds is its own, even when the capacity.hosts reconciler has since
-- lowered the host's rows (a re-inventory). Checked over the whole window, an extension into an
-- hour any new reservation of the same size could book was refused for a peak long before it.
-- Otherwise as in migration 0018.
CREATE OR REPLACE FUNCTION host_bookings_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    checked tstzrange := NEW.during;
    peak numeric;
    capacity numeric;
BEGIN
    IF NEW.amount = 0 OR (TG_OP = 'UPDATE' AND NEW.node_id = OLD.node_id AND NEW.resource = OLD.resource
                          AND NEW.amount <= OLD.amount AND NEW.during <@ OLD.during) THEN
        RETURN NULL;  -- nothing booked, or a booking that only shrank
    END IF;
    IF TG_OP = 'UPDATE' AND NEW.node_id = OLD.node_id AND NEW.resource = OLD.resource
       AND NEW.amount <= OLD.amount AND lower(NEW.during) >= lower(OLD.during)
       AND lower(NEW.during) <= upper(OLD.during) AND upper(NEW.during) > upper(OLD.during) THEN
        checked := tstzrange(upper(OLD.during), upper(NEW.during), '[)');  -- only the added time
    END IF;
    PERFORM 1 FROM host_resources WHERE node_id = NEW.node_id AND resource = NEW.resource FOR UPDATE;
    peak := host_peak_load(NEW.node_id, NEW.resource, checked, NEW.allocation_id);
    capacity := host_capacity(NEW.node_id, NEW.resource);
    IF peak + NEW.amount > capacity THEN
        RAISE EXCEPTION 'host resource % of node % is full: % booked, % asked, % can be given',
                        NEW.resource, NEW.node_id, peak, NEW.amount, capacity
            USING ERRCODE = 'exclusion_violation', CONSTRAINT = 'host_bookings_within_allocatable',
                  TABLE = 'host_bookings';
    END IF;
    RETURN NULL;
END $$;
