"""The SQL of a placed reservation's way onto its nodes: binding its allocations at the start,
repairing them before it (BookingRepair), and the nodes' signed reports that bind them."""

# binding ---------------------------------------------------------------------------------------

START_BINDING = """
UPDATE allocations SET state = 'binding', bind_deadline = from_epoch_ms(%(deadline)s)
WHERE reservation_id = %(id)s AND state = 'placed'
"""

LIVE_ALLOCATIONS = """
SELECT id, node_id, state, epoch_ms(bind_deadline) AS bind_deadline_ms
FROM allocations WHERE reservation_id = %(id)s AND state IN ('binding', 'bound') ORDER BY id
"""

FAILED_NODES = "SELECT DISTINCT node_id FROM allocations WHERE reservation_id = %(id)s AND state = 'failed'"

# The conditions' facts of a reservation's live (binding or bound) allocations, in one read: the
# names of their unreachable nodes, and their booked atoms an operator quarantined or that their
# node no longer reports (gone: not bookable), each {name, device_uuid, gone}.
NODE_CONDITION_FACTS = """
WITH live AS (
    SELECT id, node_id FROM allocations WHERE reservation_id = %(id)s AND state IN ('binding', 'bound')
)
SELECT array(SELECT n.name FROM nodes n WHERE n.id IN (SELECT node_id FROM live) AND n.connectivity = 'unreachable'
             ORDER BY n.id) AS unreachable,
       array(SELECT DISTINCT jsonb_build_object('name', n.name, 'device_uuid', at.device_uuid, 'gone', NOT at.bookable)
             FROM live JOIN bookings b ON b.allocation_id = live.id JOIN atoms at ON at.id = b.atom_id
             JOIN nodes n ON n.id = at.node_id
             WHERE at.health = 'unhealthy' OR NOT at.bookable) AS sick
"""

# A later wake-up already due within the recheck interval (the one being handled is due now).
RECHECK_PENDING = """
SELECT 1 FROM work_items
WHERE kind = 'reservation' AND subject = %(id)s
  AND run_at > compute_now() AND run_at <= compute_now() + %(within)s * interval '1 millisecond'
LIMIT 1
"""


COUNT_BIND_FAILURE = """
UPDATE reservations SET bind_failures = bind_failures + 1 WHERE id = %(id)s RETURNING bind_failures
"""


# repair ----------------------------------------------------------------------------------------

# Nodes of the reservation's live allocations that are no longer fit to serve them: the node
# (state, connectivity, required capability labels), a booked atom (health, bookable), or what the
# node's inventory changed in place since placement: the booked atoms no longer as the request
# asks (atoms_as_asked, migration 0063: model, MIG profile, one NVLink domain for nvlink-all, one
# NUMA node for numa), or a gang member no longer carrying the label value it was placed under.
BAD_NODES = """
SELECT al.node_id
FROM allocations al
JOIN reservations r ON r.id = al.reservation_id
JOIN nodes n ON n.id = al.node_id
WHERE al.reservation_id = %(id)s AND al.state = 'placed'
  AND (n.state <> 'ready' OR n.connectivity = 'unreachable' OR NOT n.labels @> %(required)s
       OR EXISTS (SELECT 1 FROM bookings b JOIN atoms a ON a.id = b.atom_id
                  WHERE b.allocation_id = al.id AND (a.health <> 'healthy' OR NOT a.bookable))
       OR NOT atoms_as_asked(ARRAY(SELECT b.atom_id FROM bookings b WHERE b.allocation_id = al.id),
                             r.request->'devices'->0)
       OR (coalesce(al.gang_group, '') <> '' AND NOT n.labels @> jsonb_build_object(
               r.request->'gang'->>'topologyKey', jsonb_build_object('value', al.gang_group))))
ORDER BY al.node_id
"""

LIVE_NODES = "SELECT node_id FROM allocations WHERE reservation_id = %(id)s AND state = 'placed' ORDER BY id"

DROP_PLACED_BOOKINGS = """
DELETE FROM bookings b USING allocations al
WHERE al.id = b.allocation_id AND al.reservation_id = %(id)s AND al.state = 'placed'
"""

RELEASE_PLACED_ALLOCATIONS = "UPDATE allocations SET state = 'released' WHERE reservation_id = %(id)s AND state = 'placed'"


BUMP_VERSION = "UPDATE reservations SET version = version + 1, updated_at = clock_timestamp() WHERE id = %(id)s"

# A repair the worker reached after the start: the window begins when it placed again (the end stays).
SET_WINDOW_START = """
UPDATE reservations SET during = tstzrange(from_epoch_ms(%(start)s), upper(during), '[)') WHERE id = %(id)s
"""


# reports ---------------------------------------------------------------------------------------

# `changed`: what `get` answers of the allocation changed (it was not bound, or bound otherwise).
MARK_BOUND = """
WITH before AS (SELECT state, binding FROM allocations WHERE id = %(id)s)
UPDATE allocations a SET state = 'bound', binding = %(binding)s,
       bound_report = %(body)s, bound_sig_kid = %(kid)s, bound_sig = %(sig)s
FROM before WHERE a.id = %(id)s
RETURNING before.state <> 'bound' OR before.binding IS DISTINCT FROM a.binding AS changed
"""

MARK_BINDING_LOST = "UPDATE allocations SET state = 'binding' WHERE id = %(id)s AND state = 'bound'"

ALL_LIVE_BOUND = """
SELECT bool_and(state = 'bound') AS all_bound FROM allocations
WHERE reservation_id = %(id)s AND state IN ('binding', 'bound')
"""


# gangs -----------------------------------------------------------------------------------------

# A placed gang's members, with the label value they were placed under.
PLACED_MEMBERS = """
SELECT id, node_id, gang_group FROM allocations
WHERE reservation_id = %(id)s AND state = 'placed' ORDER BY id
"""

# Some members leave (BookingRepair moved them): their bookings go, the allocations are history.
DROP_BOOKINGS_OF = "DELETE FROM bookings WHERE allocation_id = ANY(%(ids)s)"
RELEASE_ALLOCATIONS_OF = "UPDATE allocations SET state = 'released' WHERE id = ANY(%(ids)s)"

# The members whose node failed to bind, once the whole gang has ended.
MARK_FAILED = "UPDATE allocations SET state = 'failed' WHERE id = ANY(%(ids)s)"
