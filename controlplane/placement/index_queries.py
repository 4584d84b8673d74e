"""The rows the capacity index is built from: one pool (%(pool)s, nodes empty) or some nodes
(%(nodes)s, pool NULL)."""

from controlplane.nodes import queries as node_queries

NODES = """
SELECT n.id, n.pool_id, n.name, n.labels, n.capabilities, n.state, n.connectivity
FROM nodes n
WHERE n.pool_id = %(pool)s OR n.id = ANY(%(nodes)s)
"""

ATOMS = """
SELECT a.id, a.node_id, a.kind, a.device_uuid, a.model, a.numa_node, a.nvlink_domain, a.health, a.bookable,
       a.profile
FROM atoms a JOIN nodes n ON n.id = a.node_id
WHERE n.pool_id = %(pool)s OR n.id = ANY(%(nodes)s)
"""

# Every booking still to come or running (an hour of slack): one that ended before now cannot
# overlap a window placement asks about (windows start now or later; the clock only moves forward).
# The cut-off is a subquery, computed once: compute_now() in the filter itself runs for every row
# (3 s of a million-booking build).
BOOKINGS = """
SELECT b.atom_id, a.node_id, epoch_ms(lower(b.during)) AS start_ms,
       coalesce(epoch_ms(upper(b.during)), 9223372036854775807) AS end_ms
FROM bookings b JOIN atoms a ON a.id = b.atom_id JOIN nodes n ON n.id = a.node_id
WHERE (n.pool_id = %(pool)s OR n.id = ANY(%(nodes)s))
  AND (upper(b.during) IS NULL OR upper(b.during) > (SELECT compute_now() - interval '1 hour'))
"""

# Host resources (allocatable) are the nodes package's table: its read is there.
HOST_RESOURCES = node_queries.CAPACITY_HOST_RESOURCES

HOST_BOOKINGS = """
SELECT h.node_id, h.resource, h.amount, epoch_ms(lower(h.during)) AS start_ms,
       coalesce(epoch_ms(upper(h.during)), 9223372036854775807) AS end_ms
FROM host_bookings h JOIN nodes n ON n.id = h.node_id
WHERE (n.pool_id = %(pool)s OR n.id = ANY(%(nodes)s))
  AND (upper(h.during) IS NULL OR upper(h.during) > (SELECT compute_now() - interval '1 hour'))
"""

POOLS = "SELECT id FROM pools ORDER BY id"

# A marker behind every change committed before it: the listener has applied them all once it
# hears this (notifications arrive in commit order).
BARRIER = "SELECT pg_notify('bc_capacity', 'barrier ' || %(token)s)"
