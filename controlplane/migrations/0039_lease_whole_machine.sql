-- A whole-machine lease books every atom the node offers when it is placed; an atom that becomes
-- bookable later (a GPU back from MIG mode, or new in the inventory) would otherwise be free for
-- the lease's window, and another reservation could book it on a machine the lessee has root on.
-- A booking on a node with a node lease overlapping its window is skipped, as ON CONFLICT DO NOTHING
-- skips one the EXCLUDE constraint refuses: every placement path counts the bookings it inserted
-- and treats a shortfall as a lost race.
CREATE FUNCTION bookings_outside_node_leases() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (
        SELECT 1
        FROM atoms a
        JOIN atoms o ON o.node_id = a.node_id
        JOIN bookings b ON b.atom_id = o.id AND b.during && NEW.during AND b.allocation_id <> NEW.allocation_id
        JOIN allocations al ON al.id = b.allocation_id
        JOIN reservations r ON r.id = al.reservation_id
        WHERE a.id = NEW.atom_id AND r.request ->> 'binding' = 'node'
    ) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER bookings_outside_node_leases BEFORE INSERT ON bookings
FOR EACH ROW EXECUTE FUNCTION bookings_outside_node_leases();
