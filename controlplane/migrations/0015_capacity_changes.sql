-- One notification channel for every change the capacity index must see: bookings inserted,
-- truncated or deleted by any path (create, release, cancel, extend, expiry, repair), atom changes
-- (health, bookable, inventory) and the node facts placement filters on (pool, state,
-- connectivity, labels, capabilities), and host resources. Payload: "<pool id> <node id> <what>",
-- what = bookings (only the node's bookings changed) or node (anything else); the index re-reads
-- that node's changed rows. Heartbeats (last_seen) notify nothing.

CREATE FUNCTION capacity_changed(p_node_id text, p_what text DEFAULT 'node') RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('bc_capacity', n.pool_id || ' ' || n.id || ' ' || p_what) FROM nodes n WHERE n.id = p_node_id
$$;

CREATE FUNCTION bookings_capacity_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    row_atom text := CASE WHEN TG_OP = 'DELETE' THEN OLD.atom_id ELSE NEW.atom_id END;
BEGIN
    PERFORM capacity_changed(a.node_id, 'bookings') FROM atoms a WHERE a.id = row_atom;
    RETURN NULL;
END $$;

CREATE TRIGGER bookings_capacity AFTER INSERT OR UPDATE OR DELETE ON bookings
FOR EACH ROW EXECUTE FUNCTION bookings_capacity_changed();

CREATE FUNCTION node_rows_capacity_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM capacity_changed(OLD.node_id);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM capacity_changed(NEW.node_id);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER atoms_capacity AFTER INSERT OR UPDATE OR DELETE ON atoms
FOR EACH ROW EXECUTE FUNCTION node_rows_capacity_changed();

CREATE TRIGGER host_resources_capacity AFTER INSERT OR UPDATE OR DELETE ON host_resources
FOR EACH ROW EXECUTE FUNCTION node_rows_capacity_changed();

CREATE TRIGGER host_bookings_capacity AFTER INSERT OR UPDATE OR DELETE ON host_bookings
FOR EACH ROW EXECUTE FUNCTION node_rows_capacity_changed();

-- A deleted node is gone from the table when an AFTER trigger runs: the payload comes from OLD.
CREATE FUNCTION nodes_capacity_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND OLD.pool_id <> NEW.pool_id) THEN
        PERFORM pg_notify('bc_capacity', OLD.pool_id || ' ' || OLD.id || ' node');
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('bc_capacity', NEW.pool_id || ' ' || NEW.id || ' node');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER nodes_capacity_insert_delete AFTER INSERT OR DELETE ON nodes
FOR EACH ROW EXECUTE FUNCTION nodes_capacity_changed();

CREATE TRIGGER nodes_capacity_update AFTER UPDATE ON nodes
FOR EACH ROW
WHEN (OLD.pool_id IS DISTINCT FROM NEW.pool_id OR OLD.state IS DISTINCT FROM NEW.state
      OR OLD.connectivity IS DISTINCT FROM NEW.connectivity OR OLD.labels IS DISTINCT FROM NEW.labels
      OR OLD.capabilities IS DISTINCT FROM NEW.capabilities)
EXECUTE FUNCTION nodes_capacity_changed();
