"""The lease placer's batch SQL: every planned allocation of a batch and its bookings in one
statement."""

# The allocations of a batch (one row each: its reservation, node, window and selector) and the
# atoms each wants, in the batch's order. As INSERT_PLACEMENT does for one: node state, labels and
# atom health are re-read under the pool lock, only atoms still schedulable are booked, and a
# booking the EXCLUDE constraint refuses (another writer's, or an earlier member's of this very
# statement) is skipped by ON CONFLICT DO NOTHING: no error, no savepoint. The caller counts the
# bookings each allocation got and deletes the partial ones. Earlier members are inserted first
# (ORDER BY), so a conflict inside the batch costs the later one.
INSERT_BATCH = """
WITH planned AS (
    SELECT * FROM unnest(%(allocation_ids)s::text[], %(reservation_ids)s::text[], %(node_ids)s::text[],
                         %(starts)s::bigint[], %(ends)s::bigint[], %(selectors)s::jsonb[], %(devices)s::jsonb[])
        AS p(allocation_id, reservation_id, node_id, start_ms, end_ms, selector, device)
),
wanted AS (
    SELECT * FROM unnest(%(atom_allocations)s::text[], %(atom_ids)s::text[]) WITH ORDINALITY
        AS w(allocation_id, atom_id, ord)
),
-- The members whose atoms are still as their request asks (migration 0063): the others get nothing.
as_asked AS (
    SELECT p.allocation_id
    FROM planned p JOIN wanted w ON w.allocation_id = p.allocation_id
    GROUP BY p.allocation_id, p.device
    HAVING atoms_as_asked(array_agg(w.atom_id), p.device)
),
allocated AS (
    INSERT INTO allocations (id, reservation_id, node_id, device_ids, state)
    SELECT p.allocation_id, p.reservation_id, p.node_id,
           ARRAY(SELECT a.device_uuid FROM wanted w JOIN atoms a ON a.id = w.atom_id
                 WHERE w.allocation_id = p.allocation_id ORDER BY w.ord),
           'placed'
    FROM planned p
    RETURNING id
)
INSERT INTO bookings (atom_id, allocation_id, during)
SELECT a.id, p.allocation_id, tstzrange(from_epoch_ms(p.start_ms), from_epoch_ms(p.end_ms), '[)')
FROM allocated
JOIN planned p ON p.allocation_id = allocated.id
JOIN as_asked ON as_asked.allocation_id = p.allocation_id
JOIN wanted w ON w.allocation_id = p.allocation_id
JOIN atoms a ON a.id = w.atom_id
JOIN nodes n ON n.id = a.node_id
WHERE n.id = p.node_id
  AND n.pool_id = %(pool_id)s
  AND n.state = 'ready'
  AND n.connectivity <> 'unreachable'
  AND n.labels @> p.selector
  AND a.health = 'healthy' AND a.bookable
ORDER BY w.ord
ON CONFLICT DO NOTHING
RETURNING allocation_id
"""

# The allocations that did not get all their bookings (theirs go with them).
DELETE_ALLOCATIONS = "DELETE FROM allocations WHERE id = ANY(%(ids)s)"
