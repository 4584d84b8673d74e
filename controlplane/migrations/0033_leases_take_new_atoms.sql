-- A leased machine is the lessee's whole, whatever the inventory says later (docs/decisions.md).
-- A node lease books every bookable atom of its machine when it is placed; an atom that becomes
-- bookable afterwards (a new GPU, a GPU out of MIG mode, a pool's new MIG instances or slots) was
-- not among them, so it could be booked by someone else into the lease's window (and bound on a
-- machine another tenant has root on), or a hold on it extended there. Such an atom now joins
-- every live node lease of its node for the rest of that lease's window, in the transaction that
-- made it bookable.
--
-- Deferred to the commit, so an atom that is bookable only for a moment inside the transaction
-- (the inventory sets every present GPU bookable, then takes MIG-mode GPUs out again) joins
-- nothing. The cost is on the inventory path only (atoms change when inventories change), never on
-- a create: a row trigger on bookings did this once and cost 0.9 ms per create.
CREATE FUNCTION atoms_join_node_leases() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO bookings (atom_id, allocation_id, during)
    SELECT a.id, al.id, tstzrange(greatest(lower(b.during), compute_now()), upper(b.during), '[)')
    FROM atoms a
    JOIN allocations al ON al.node_id = a.node_id AND al.state IN ('placed', 'binding', 'bound')
    JOIN reservations r ON r.id = al.reservation_id AND r.request->>'binding' = 'node'
    JOIN LATERAL (SELECT x.during FROM bookings x WHERE x.allocation_id = al.id
                  ORDER BY upper(x.during) DESC LIMIT 1) b ON true
    WHERE a.id = NEW.id AND a.bookable AND upper(b.during) > compute_now()
      AND NOT EXISTS (SELECT 1 FROM bookings y WHERE y.atom_id = a.id AND y.allocation_id = al.id)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER atoms_new_join_node_leases AFTER INSERT ON atoms
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.bookable)
EXECUTE FUNCTION atoms_join_node_leases();

CREATE CONSTRAINT TRIGGER atoms_bookable_join_node_leases AFTER UPDATE OF bookable ON atoms
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.bookable AND NOT OLD.bookable)
EXECUTE FUNCTION atoms_join_node_leases();
