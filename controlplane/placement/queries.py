"""Placement SQL: the shortlist of nodes that can fit a request, the guarded booking insert, and
the diagnostics behind an Unschedulable reason."""

# Free, healthy, bookable atoms of the asked kind (whole GPUs, MIG instances of a profile, slots)
# of schedulable nodes for the window; nodes whose best topology group fits the count; the fullest
# of them first (bin-pack), ties in random order so concurrent creates spread out; then every free
# atom of the shortlisted nodes.
SHORTLIST = """
WITH free AS MATERIALIZED (
    SELECT a.id, a.node_id, a.device_uuid, a.numa_node, a.nvlink_domain
    FROM atoms a
    JOIN nodes n ON n.id = a.node_id
    WHERE n.pool_id = %(pool_id)s
      AND n.state = 'ready'
      AND n.connectivity <> 'unreachable'
      AND n.labels @> %(selector)s
      AND NOT (n.id = ANY(%(exclude)s))
      AND a.kind = %(device_class)s AND a.health = 'healthy' AND a.bookable
      AND (%(model)s = '' OR a.model = %(model)s)
      AND (%(profile)s = '' OR a.profile = %(profile)s)
      AND NOT EXISTS (
          SELECT 1 FROM bookings b
          WHERE b.atom_id = a.id
            AND b.during && tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)'))
),
groups AS (
    SELECT node_id,
           CASE %(topology)s WHEN 'nvlink-all' THEN nvlink_domain
                             WHEN 'numa' THEN numa_node::text
                             ELSE '' END AS grp,
           count(*) AS n
    FROM free
    GROUP BY 1, 2
),
fit AS (
    SELECT node_id FROM (
        SELECT DISTINCT node_id FROM groups
        WHERE n >= %(count)s AND NOT (%(topology)s = 'nvlink-all' AND grp = '')) g
    WHERE %(host)s::jsonb = '{}'::jsonb
       OR host_fits(g.node_id, %(host)s, tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)'))
),
shortlist AS (
    SELECT f.node_id, count(*) AS free_total
    FROM fit f JOIN free USING (node_id)
    GROUP BY f.node_id
    ORDER BY count(*) ASC, random()
    LIMIT %(limit)s
)
SELECT s.node_id, n.name AS node_name, fr.id AS atom_id, fr.device_uuid, fr.numa_node, fr.nvlink_domain
FROM shortlist s
JOIN nodes n ON n.id = s.node_id
JOIN free fr ON fr.node_id = s.node_id
ORDER BY s.node_id, fr.id
"""

# The allocation and its bookings in one statement (one round trip under the pool lock).
# Re-reads node state, labels and atom health under the lock: only atoms still schedulable are
# inserted, and a booking the EXCLUDE constraint refuses is skipped (ON CONFLICT DO NOTHING: no
# error, no savepoint); the caller compares the count and deletes a partial allocation.
INSERT_PLACEMENT = """
WITH allocation AS (
    INSERT INTO allocations (id, reservation_id, node_id, device_ids, state)
    VALUES (%(allocation_id)s, %(reservation_id)s, %(node_id)s, %(device_ids)s, 'placed')
    RETURNING id
)
INSERT INTO bookings (atom_id, allocation_id, during)
SELECT a.id, allocation.id, tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)')
FROM allocation, atoms a
JOIN nodes n ON n.id = a.node_id
WHERE a.id = ANY(%(atom_ids)s)
  AND n.id = %(node_id)s
  AND n.pool_id = %(pool_id)s
  AND n.state = 'ready'
  AND n.connectivity <> 'unreachable'
  AND n.labels @> %(selector)s
  AND a.health = 'healthy' AND a.bookable
  AND (SELECT atoms_as_asked(%(atom_ids)s, %(device)s))  -- their shape as asked (migration 0063)
ON CONFLICT DO NOTHING
RETURNING atom_id
"""

# The allocation's host resources, booked on its node for the window of its devices, and its
# limits, or nothing: ok is false when the node cannot give them (migration 0018's guard). Run
# after INSERT_PLACEMENT in the same transaction, by every commit that books host resources.
BOOK_HOST = """
SELECT book_host_resources(%(allocation_id)s, %(node_id)s,
                           tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)'),
                           %(host)s, %(limits)s) AS ok
"""

# A placement that did not get all its bookings (its bookings go with it).
DELETE_ALLOCATION = "DELETE FROM allocations WHERE id = %(id)s"

# Why nothing fits: how many nodes each filter removed, and the most a node could give.
DIAGNOSE = """
WITH node_facts AS (
    SELECT n.id, n.state, n.connectivity, n.labels @> %(selector)s AS labels_ok,
           count(a.id) FILTER (WHERE a.kind = %(device_class)s AND (%(model)s = '' OR a.model = %(model)s)) AS gpus,
           count(a.id) FILTER (
               WHERE a.kind = %(device_class)s AND a.health = 'healthy' AND a.bookable
                 AND (%(model)s = '' OR a.model = %(model)s)
                 AND (%(profile)s = '' OR a.profile = %(profile)s)
                 AND NOT EXISTS (
                     SELECT 1 FROM bookings b WHERE b.atom_id = a.id
                       AND b.during && tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)'))
           ) AS free
    FROM nodes n LEFT JOIN atoms a ON a.node_id = n.id
    WHERE n.pool_id = %(pool_id)s
    GROUP BY n.id
)
SELECT count(*) AS nodes,
       count(*) FILTER (WHERE state <> 'ready') AS cordoned,
       count(*) FILTER (WHERE state = 'ready' AND connectivity = 'unreachable') AS unreachable,
       count(*) FILTER (WHERE state = 'ready' AND connectivity <> 'unreachable' AND NOT labels_ok) AS unlabelled,
       count(*) FILTER (WHERE gpus = 0) AS no_model,
       coalesce(max(free) FILTER (WHERE state = 'ready' AND connectivity <> 'unreachable' AND labels_ok), 0) AS most_free
FROM node_facts
"""
