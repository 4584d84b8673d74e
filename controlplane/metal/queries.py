"""metal's SQL: profiles, whole-machine placement, deploys. Node rows are written by their owner
(controlplane.nodes); these statements only read them."""

# Profiles ---------------------------------------------------------------------------------------

INSERT_PROFILE = """
INSERT INTO node_profiles (id, description) VALUES (%(id)s, %(description)s) ON CONFLICT (id) DO NOTHING
"""
# Creates take this lock before they count, so concurrent ones never pass the cap together.
PROFILES_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('node-profiles', 0))"
PROFILE_COUNT = "SELECT count(*) AS n FROM node_profiles"
LOCK_PROFILE = "SELECT id FROM node_profiles WHERE id = %(id)s FOR UPDATE"
VERSION = "SELECT image, checksum FROM node_profile_versions WHERE profile_id = %(id)s AND version = %(version)s"
VERSION_COUNT = "SELECT count(*) AS n FROM node_profile_versions WHERE profile_id = %(id)s"
INSERT_VERSION = """
INSERT INTO node_profile_versions (profile_id, version, image, checksum)
VALUES (%(id)s, %(version)s, %(image)s, %(checksum)s)
"""
PROFILES = """
SELECT p.id, p.description, epoch_ms(p.created_at) AS created_ms,
       coalesce(jsonb_agg(jsonb_build_object('version', v.version, 'image', v.image, 'checksum', v.checksum,
                                             'created_ms', epoch_ms(v.created_at)) ORDER BY v.version)
                FILTER (WHERE v.version IS NOT NULL), '[]') AS versions
FROM node_profiles p LEFT JOIN node_profile_versions v ON v.profile_id = p.id
WHERE %(id)s::text IS NULL OR p.id = %(id)s
GROUP BY p.id ORDER BY p.id
"""
# The version a create names, or the profile's newest when it names none.
RESOLVE_VERSION = """
SELECT version FROM node_profile_versions
WHERE profile_id = %(id)s AND (%(version)s::int IS NULL OR version = %(version)s)
ORDER BY version DESC LIMIT 1
"""

# Placement --------------------------------------------------------------------------------------

# A node that is platform-trusted: enrolled as a platform node, never revoked, holding a current
# unrevoked TLS certificate of role `node` (a machine a tenant held has only node-tenant ones until
# metal saw it wiped and it renewed).
_TRUSTED = """
    n.revoked_at IS NULL
    AND EXISTS (SELECT 1 FROM node_certs c LEFT JOIN revocations rv ON rv.serial = c.serial
                WHERE c.node_id = n.id AND c.usage = 'tls' AND c.role = 'node' AND rv.serial IS NULL
                  AND now() < c.not_after)
"""

# Whole machines for the window: ready, connected, platform-trusted nodes of the pool whose daemon
# advertises binding.node (in the selector, matched with its source) with exactly %(count)s bookable
# GPUs (of the model, when one is asked), every bookable atom healthy, and no atom of them booked for
# the window: not even one no longer bookable (a GPU gone from the inventory or put in MIG mode keeps
# its bookings, and the machine is the lessee's whole). Each with its bookable atoms (all kinds), its
# GPUs' uuids and its label %(key)s (a gang's topologyKey); in random order, %(limit)s of them
# (NULL: all, for a gang).
LEASABLE_NODES = f"""
SELECT n.id AS node_id, n.labels -> %(key)s AS gang_label,
       array_agg(a.id ORDER BY a.id) AS atom_ids,
       array_agg(a.device_uuid ORDER BY a.device_uuid) FILTER (WHERE a.kind = 'gpu') AS device_ids
FROM nodes n
JOIN atoms a ON a.node_id = n.id AND a.bookable
WHERE n.pool_id = %(pool_id)s
  AND n.state = 'ready'
  AND n.connectivity = 'connected'
  AND n.labels @> %(selector)s
  AND NOT (n.id = ANY(%(exclude)s))
  AND {_TRUSTED}
GROUP BY n.id
HAVING count(*) FILTER (WHERE a.kind = 'gpu') = %(count)s
   AND bool_and(a.health = 'healthy')
   AND bool_and(%(model)s = '' OR a.kind <> 'gpu' OR a.model = %(model)s)
   AND NOT EXISTS (
       SELECT 1 FROM atoms x JOIN bookings b ON b.atom_id = x.id
       WHERE x.node_id = n.id AND b.during && tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)'))
ORDER BY random()
LIMIT %(limit)s
"""

# The allocation and a booking of every planned atom, re-reading the node (its state and labels: the
# selector, with a gang's label value) and atoms (the pool lock is held); a booking the EXCLUDE
# constraint refuses is skipped, and the caller compares the count.
INSERT_LEASE = """
WITH allocation AS (
    INSERT INTO allocations (id, reservation_id, node_id, device_ids, state, gang_group)
    VALUES (%(allocation_id)s, %(reservation_id)s, %(node_id)s, %(device_ids)s, 'placed', %(group)s)
    RETURNING id
)
INSERT INTO bookings (atom_id, allocation_id, during)
SELECT a.id, allocation.id, tstzrange(from_epoch_ms(%(start)s), from_epoch_ms(%(end)s), '[)')
FROM allocation, atoms a
JOIN nodes n ON n.id = a.node_id
WHERE a.id = ANY(%(atom_ids)s) AND n.id = %(node_id)s AND n.state = 'ready' AND n.labels @> %(selector)s
  AND a.health = 'healthy' AND a.bookable
ON CONFLICT DO NOTHING
RETURNING atom_id
"""

# Why no machine fits (the Unschedulable message).
DIAGNOSE = f"""
WITH facts AS (
    SELECT n.id, n.state, n.connectivity, n.labels @> %(selector)s AS labels_ok, ({_TRUSTED}) AS trusted,
           (SELECT count(*) FROM atoms a WHERE a.node_id = n.id AND a.kind = 'gpu' AND a.bookable) AS gpus
    FROM nodes n WHERE n.pool_id = %(pool_id)s
)
SELECT count(*) AS nodes,
       count(*) FILTER (WHERE state <> 'ready') AS not_ready,
       count(*) FILTER (WHERE state = 'ready' AND connectivity <> 'connected') AS not_connected,
       count(*) FILTER (WHERE state = 'ready' AND connectivity = 'connected' AND NOT trusted) AS untrusted,
       count(*) FILTER (WHERE state = 'ready' AND connectivity = 'connected' AND trusted AND NOT labels_ok)
           AS unlabelled,
       count(*) FILTER (WHERE state = 'ready' AND connectivity = 'connected' AND trusted AND labels_ok
                          AND gpus <> %(count)s) AS other_size
FROM facts
"""

# BookingRepair before the window: the nodes of a placed node lease that are no longer leasable.
NOT_LEASABLE = f"""
SELECT DISTINCT al.node_id
FROM allocations al
JOIN nodes n ON n.id = al.node_id
WHERE al.reservation_id = %(id)s AND al.state = 'placed'
  AND (n.state <> 'ready' OR n.connectivity = 'unreachable' OR NOT n.labels @> %(capability)s
       OR NOT ({_TRUSTED})
       OR EXISTS (SELECT 1 FROM bookings b JOIN atoms a ON a.id = b.atom_id
                  WHERE b.allocation_id = al.id AND (a.health <> 'healthy' OR NOT a.bookable)))
"""

# Deploys ----------------------------------------------------------------------------------------

START_ALLOCATIONS = """
UPDATE allocations SET state = 'binding', bind_deadline = from_epoch_ms(%(deadline)s)
WHERE reservation_id = %(id)s AND state = 'placed'
RETURNING id, node_id
"""
INSERT_DEPLOY = """
INSERT INTO metal_deploys (allocation_id, reservation_id, node_id, profile_id, version, image, checksum,
                           deadline, node_state_before)
SELECT %(allocation_id)s, %(reservation_id)s, %(node_id)s, v.profile_id, v.version, v.image, v.checksum,
       from_epoch_ms(%(deadline)s), %(before)s
FROM node_profile_versions v WHERE v.profile_id = %(profile_id)s AND v.version = %(version)s
RETURNING allocation_id
"""
WAKE = "SELECT schedule_work('metal', %(node_id)s, greatest(from_epoch_ms(%(at)s), compute_now()))"
WAKE_LIVE_OF = """
SELECT schedule_work('metal', node_id, compute_now()) FROM metal_deploys
WHERE reservation_id = %(id)s AND state = 'deploying'
"""
NODE_POOL = "SELECT pool_id FROM nodes WHERE id = %(node_id)s"
LIVE_DEPLOY = """
SELECT d.*, epoch_ms(d.deadline) AS deadline_ms, n.inventory->'deployed' AS deployed, n.name AS node_name
FROM metal_deploys d JOIN nodes n ON n.id = d.node_id
WHERE d.node_id = %(node_id)s AND d.state = 'deploying'
"""
MARK_REPORTED = """
UPDATE metal_deploys SET reported_at = compute_now() WHERE allocation_id = %(id)s AND reported_at IS NULL
"""
ALLOCATION_FOR_UPDATE = "SELECT id, state FROM allocations WHERE id = %(id)s FOR UPDATE"
FINISH_DEPLOY = """
UPDATE metal_deploys SET state = %(state)s, reason = %(reason)s, finished_at = compute_now()
WHERE allocation_id = %(id)s AND state = 'deploying'
"""
MARK_BOUND = "UPDATE allocations SET state = 'bound', binding = %(binding)s WHERE id = %(id)s AND state = 'binding'"
ALL_LIVE_BOUND = """
SELECT count(*) > 0 AND bool_and(state = 'bound') AS all_bound
FROM allocations WHERE reservation_id = %(id)s AND state IN ('binding', 'bound')
"""
# The node's newest deploy, when the node is leased and holds no live node lease any more: its
# wipe is what returns the node to the platform.
AFTER_LEASE = """
SELECT d.allocation_id, d.node_state_before, d.reported_at IS NOT NULL AS reported,
       n.inventory->'deployed' AS deployed
FROM nodes n
JOIN LATERAL (SELECT * FROM metal_deploys m WHERE m.node_id = n.id ORDER BY m.started_at DESC LIMIT 1) d ON true
WHERE n.id = %(node_id)s AND n.state = 'leased' AND d.state <> 'deploying' AND d.wiped_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM allocations a JOIN metal_deploys m ON m.allocation_id = a.id
                  WHERE a.node_id = n.id AND a.state IN ('binding', 'bound'))
"""
MARK_WIPED = """
UPDATE metal_deploys SET wiped_at = compute_now(),
       state = CASE WHEN state = 'deployed' THEN 'ended' ELSE state END
WHERE allocation_id = %(id)s
"""
DEPLOY_OF = "SELECT * FROM metal_deploys WHERE allocation_id = %(id)s"
