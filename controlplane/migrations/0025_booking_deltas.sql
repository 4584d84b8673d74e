-- Booking changes reach the capacity index as deltas, not as "re-read this node's bookings".
--
-- One statement-level trigger per operation on bookings (their transition tables hold the rows
-- the statement inserted, deleted or updated) sends one notification per node it touched:
--
--   "<pool id> <node id> delta <seq> <op>;<op>;..."   op = +<atom id>,<start ms>,<end ms>
--                                                          | -<atom id>,<start ms>,<end ms>
--
-- in the order the index must apply them (an update is its old interval out, then its new one
-- in). <seq> is unique per notification, so two statements of one transaction that change the same
-- interval back and forth never send identical payloads (PostgreSQL folds identical
-- notifications of a transaction into one). A node with too many changes for one payload
-- (a bulk load) is sent as before, "<pool id> <node id> bookings": the index re-reads its
-- bookings. Intervals are what the index keeps: epoch ms, an open end as the largest bigint.
-- The other triggers of migration 0015 (atoms, host resources, nodes) are unchanged.

CREATE SEQUENCE capacity_delta_seq CACHE 100;

-- One op as the payload spells it.
CREATE FUNCTION booking_delta_op(p_op text, p_atom_id text, p_during tstzrange) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_op || p_atom_id || ',' || epoch_ms(lower(p_during)) || ','
           || coalesce(epoch_ms(upper(p_during)), 9223372036854775807)
$$;

-- One notification per node: its ops in order, or the re-read form when they do not fit.
CREATE FUNCTION notify_booking_deltas(p_pool_id text, p_node_id text, p_ops text) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('bc_capacity', CASE
        WHEN length(p_ops) <= 7000 THEN p_pool_id || ' ' || p_node_id || ' delta ' || nextval('capacity_delta_seq') || ' ' || p_ops
        ELSE p_pool_id || ' ' || p_node_id || ' bookings' END)
$$;

CREATE FUNCTION bookings_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM notify_booking_deltas(n.pool_id, n.id, string_agg(booking_delta_op('+', r.atom_id, r.during), ';'))
    FROM new_rows r JOIN atoms a ON a.id = r.atom_id JOIN nodes n ON n.id = a.node_id
    GROUP BY n.pool_id, n.id;
    RETURN NULL;
END $$;

CREATE FUNCTION bookings_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM notify_booking_deltas(n.pool_id, n.id, string_agg(booking_delta_op('-', r.atom_id, r.during), ';'))
    FROM old_rows r JOIN atoms a ON a.id = r.atom_id JOIN nodes n ON n.id = a.node_id
    GROUP BY n.pool_id, n.id;
    RETURN NULL;
END $$;

-- An update: every old interval out before any new one goes in (an atom's intervals never
-- overlap once the statement is done, but an old one may overlap another row's new one).
CREATE FUNCTION bookings_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM notify_booking_deltas(n.pool_id, n.id, string_agg(r.op, ';' ORDER BY r.ord))
    FROM (SELECT 0 AS ord, booking_delta_op('-', o.atom_id, o.during) AS op, o.atom_id FROM old_rows o
          UNION ALL
          SELECT 1, booking_delta_op('+', w.atom_id, w.during), w.atom_id FROM new_rows w) r
    JOIN atoms a ON a.id = r.atom_id JOIN nodes n ON n.id = a.node_id
    GROUP BY n.pool_id, n.id;
    RETURN NULL;
END $$;

DROP TRIGGER bookings_capacity ON bookings;

CREATE TRIGGER bookings_capacity_insert AFTER INSERT ON bookings
REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION bookings_inserted();

CREATE TRIGGER bookings_capacity_delete AFTER DELETE ON bookings
REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION bookings_deleted();

CREATE TRIGGER bookings_capacity_update AFTER UPDATE ON bookings
REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION bookings_updated();
