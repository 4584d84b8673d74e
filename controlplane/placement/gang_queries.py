"""Gang placement SQL: every member's allocation and bookings in one statement."""

# All members at once, under the pool lock, inside the caller's savepoint: one allocation per member
# node (carrying the gang's label value), then the bookings of every member's atoms. As for one
# allocation (queries.INSERT_PLACEMENT), node state, labels (the gang's own label value included, in
# %(selector)s) and atom health are re-read here, only atoms still schedulable are inserted, and a
# booking the EXCLUDE constraint refuses is skipped; the caller counts the bookings per member and
# rolls the whole gang back when any member got fewer than it planned.
INSERT_GANG = """
WITH member AS (
    SELECT m.allocation_id, m.node_id, m.device_ids
    FROM jsonb_to_recordset(%(members)s) AS m(allocation_id text, node_id text, device_ids text[])
),
allocation AS (
    INSERT INTO allocations (id, reservation_id, node_id, device_ids, state, gang_group)
    SELECT allocation_id, %(reservation_id)s, node_id, device_ids, 'placed', %(group)s FROM member
    RETURNING id, node_id
),
-- The members whose atoms are still as the request asks (migration 0063): the others get nothing.
as_asked AS (
    SELECT w.allocation_id
    FROM unnest(%(member_of)s::text[], %(atom_ids)s::text[]) AS w(allocation_id, atom_id)
    GROUP BY w.allocation_id
    HAVING atoms_as_asked(array_agg(w.atom_id), %(device)s)
)
INSERT INTO bookings (atom_id, allocation_id, during)
SELECT a.id, al.id, tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)')
FROM allocation al
JOIN as_asked ON as_asked.allocation_id = al.id
JOIN unnest(%(member_of)s::text[], %(atom_ids)s::text[]) AS w(allocation_id, atom_id) ON w.allocation_id = al.id
JOIN atoms a ON a.id = w.atom_id
JOIN nodes n ON n.id = a.node_id
WHERE n.id = al.node_id
  AND n.pool_id = %(pool_id)s
  AND n.state = 'ready'
  AND n.connectivity <> 'unreachable'
  AND n.labels @> %(selector)s
  AND a.health = 'healthy' AND a.bookable
ON CONFLICT DO NOTHING
RETURNING allocation_id
"""

# Under the pool lock, before the insert: the planned member nodes that already have a booking on
# one of their planned atoms in the window (a change the index has not heard of yet). Finding them
# here costs one index probe; finding them by the insert would cost the whole gang's insert and its
# rollback.
TAKEN_NODES = """
SELECT DISTINCT a.node_id
FROM bookings b JOIN atoms a ON a.id = b.atom_id
WHERE b.atom_id = ANY(%(atom_ids)s)
  AND b.during && tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)')
"""
