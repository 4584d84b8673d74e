-- A whole-machine lease books every atom the node offers when it is placed; an atom that becomes
-- bookable later (a GPU back from MIG mode, or new in the inventory) would otherwise be free for
-- the lease's window, and another reservation could book it on a machine the lessee has root on.
-- A booking on a node with a node lease overlapping its window is skipped, as ON CONFLICT DO NOTHING
-- skips one the EXCLUDE constraint refuses: every placement path counts the bookings it inserted
-- and treats a shortfall as a lost race. A booking that grows into such a window (extend) is
-- refused as the EXCLUDE constraint refuses it, which extend answers with extended: false; so is a
-- lease's own booking that grows over another booking of its node.
CREATE FUNCTION bookings_outside_node_leases() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    leasing boolean;  -- whether the row is a node lease's own: then no other booking may be on the node
BEGIN
    SELECT r.request ->> 'binding' = 'node' INTO leasing
    FROM allocations al JOIN reservations r ON r.id = al.reservation_id WHERE al.id = NEW.allocation_id;
    IF EXISTS (
        SELECT 1
        FROM atoms a
        JOIN atoms o ON o.node_id = a.node_id
        JOIN bookings b ON b.atom_id = o.id AND b.during && NEW.during AND b.allocation_id <> NEW.allocation_id
        JOIN allocations al ON al.id = b.allocation_id
        JOIN reservations r ON r.id = al.reservation_id
        WHERE a.id = NEW.atom_id AND (coalesce(leasing, false) OR r.request ->> 'binding' = 'node')
    ) THEN
        IF TG_OP = 'INSERT' THEN
            RETURN NULL;
        END IF;
        RAISE EXCEPTION 'node of atom % is leased whole for an overlapping window', NEW.atom_id
            USING ERRCODE = 'exclusion_violation', CONSTRAINT = 'bookings_no_overlap', TABLE = 'bookings';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER bookings_outside_node_leases BEFORE INSERT ON bookings
FOR EACH ROW EXECUTE FUNCTION bookings_outside_node_leases();

CREATE TRIGGER bookings_grow_outside_node_leases BEFORE UPDATE OF during ON bookings
FOR EACH ROW WHEN (NOT NEW.during <@ OLD.during) EXECUTE FUNCTION bookings_outside_node_leases();
