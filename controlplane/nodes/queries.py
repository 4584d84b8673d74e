"""The nodes package's SQL, one named statement each: nodes, atoms, host resources, node
sessions, desired state, node reports and report sequences. No other module writes these tables
(tests/test_layering.py checks it); others read them freely (placement, capacity)."""

# Nodes ----------------------------------------------------------------------------------------

NODE = """
SELECT n.*, (SELECT count(*) FROM atoms a WHERE a.node_id = n.id AND a.kind = 'gpu') AS gpu_count
FROM nodes n WHERE (%(id)s::text IS NULL OR n.id = %(id)s) AND (%(pool)s::text IS NULL OR n.pool_id = %(pool)s)
ORDER BY n.name
"""
POOL_OF = "SELECT pool_id FROM nodes WHERE id = %(node_id)s"
EXISTS = "SELECT 1 FROM nodes WHERE id = %(node_id)s"
LOCK = ("SELECT id, pool_id, name, state, labels, revoked_at, revoked_reason, session_id FROM nodes"
        " WHERE id = %(node_id)s FOR UPDATE")

REGISTER = """
INSERT INTO nodes (id, pool_id, name, labels, capabilities, inventory)
VALUES (%(id)s, %(pool_id)s, %(name)s, %(labels)s, %(capabilities)s, %(inventory)s)
"""
# Enrolment: the node of this name in the pool, created when absent.
CREATE_NAMED = """
INSERT INTO nodes (id, pool_id, name) VALUES (%(id)s, %(pool_id)s, %(name)s)
ON CONFLICT (pool_id, name) DO NOTHING
"""
BY_NAME = "SELECT id FROM nodes WHERE pool_id = %(pool_id)s AND name = %(name)s"

# The operator's cordon; a leased node is metal's (controlplane.nodes.tenancy).
SET_STATE = "UPDATE nodes SET state = %(state)s WHERE id = %(node_id)s AND state <> 'leased'"
SET_CONNECTIVITY = """
UPDATE nodes SET connectivity = %(connectivity)s,
       last_seen = CASE WHEN %(connectivity)s = 'connected' THEN compute_now() ELSE last_seen END
WHERE id = %(node_id)s
"""
# The first revocation's time and reason stay.
MARK_REVOKED = """
UPDATE nodes SET revoked_at = now(), revoked_reason = %(reason)s WHERE id = %(node_id)s AND revoked_at IS NULL
"""
READMIT = """
UPDATE nodes SET revoked_at = NULL, revoked_reason = '' WHERE id = %(node_id)s AND revoked_at IS NOT NULL
RETURNING id
"""

WAKE_RESERVATIONS = "SELECT wake_node_reservations(%(node_id)s)"
NOTIFY_POOL_FREED = "SELECT pg_notify('bc_pool_freed', %(pool_id)s)"
# What placement reads of one node that a node's own word changes (its atoms, host resources and
# labels), as one digest: an inventory or hello that leaves it as it was wakes no placer.
PLACEMENT_FACTS = """
SELECT md5(concat((SELECT string_agg(a::text, ',' ORDER BY a.id) FROM atoms a WHERE a.node_id = %(node_id)s),
                  (SELECT string_agg(h::text, ',' ORDER BY h.resource) FROM host_resources h
                   WHERE h.node_id = %(node_id)s),
                  (SELECT labels::text FROM nodes WHERE id = %(node_id)s))) AS facts
"""

# Atoms and host resources ----------------------------------------------------------------------

INSERT_GPU = """
INSERT INTO atoms (id, node_id, kind, device_uuid, model, numa_node, nvlink_domain)
VALUES (%(id)s, %(node_id)s, 'gpu', %(uuid)s, %(model)s, %(numa_node)s, %(nvlink_domain)s)
"""
UPSERT_GPU = INSERT_GPU + """
ON CONFLICT (node_id, device_uuid, kind) DO UPDATE
SET model = EXCLUDED.model, numa_node = EXCLUDED.numa_node, nvlink_domain = EXCLUDED.nvlink_domain, bookable = true
"""
# GPUs gone from the inventory (and their MIG instances and slots) stop being bookable; those
# booked or quarantined stay (their bookings, their health), the others go (DELETE_UNUSED_*).
GPUS_GONE = """
UPDATE atoms SET bookable = false
WHERE node_id = %(node_id)s AND bookable
  AND (CASE WHEN kind = 'gpu' THEN id ELSE parent_id END) IN (
      SELECT id FROM atoms WHERE node_id = %(node_id)s AND kind = 'gpu' AND NOT (device_uuid = ANY(%(present)s)))
"""
# Which node holds each GPU uuid (migration 0036): a node holds the GPUs it reports that no other
# node holds. A claim racing another of the same uuid waits for that one's commit and then finds
# the uuid held (HELD_ELSEWHERE reads it in a new snapshot). The uuids go in sorted, so two nodes
# claiming the same ones take them in one order.
HOLD_GPUS = """
INSERT INTO gpu_holders (device_uuid, node_id)
SELECT u, %(node_id)s FROM unnest(%(uuids)s::text[]) AS u ORDER BY u
ON CONFLICT (device_uuid) DO NOTHING
"""
HELD_ELSEWHERE = """
SELECT device_uuid, node_id FROM gpu_holders
WHERE device_uuid = ANY(%(uuids)s) AND node_id <> %(node_id)s
ORDER BY device_uuid
"""
# The node's GPUs it no longer reports (or all, when it is revoked): another node may report them.
RELEASE_GPUS = "DELETE FROM gpu_holders WHERE node_id = %(node_id)s AND NOT (device_uuid = ANY(%(held)s))"
# What an inventory no longer lists (a GPU gone, a MIG instance or slot gone), with nothing booked
# on it and not quarantined, is deleted, parts first: a node reporting fresh uuids in a loop grew
# its atoms without end. A booked or quarantined one stays (its bookings, its health when it is back).
DELETE_UNUSED_PARTS = """
DELETE FROM atoms c
WHERE c.node_id = %(node_id)s AND c.kind <> 'gpu' AND NOT c.bookable AND c.health = 'healthy'
  AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.atom_id = c.id)
"""
DELETE_UNUSED_GPUS = """
DELETE FROM atoms g
WHERE g.node_id = %(node_id)s AND g.kind = 'gpu' AND NOT (g.device_uuid = ANY(%(present)s))
  AND g.health = 'healthy'
  AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.atom_id = g.id)
  AND NOT EXISTS (SELECT 1 FROM atoms c WHERE c.parent_id = g.id)
"""
# A GPU and its MIG instances and slots (its children, "<uuid>:<n>").
SET_GPU_HEALTH = """
UPDATE atoms SET health = %(health)s
WHERE node_id = %(node_id)s
  AND (device_uuid = %(device_uuid)s
       OR parent_id IN (SELECT id FROM atoms WHERE node_id = %(node_id)s AND kind = 'gpu'
                        AND device_uuid = %(device_uuid)s))
"""
# The capacity.hosts reconciler (controlplane.nodes.hosts; SQL functions of migration 0018).
SYNC_HOST_RESOURCES = "SELECT sync_host_resources(%(node_id)s) AS changed"
HOSTS_OUT_OF_STEP = "SELECT n.id, n.pool_id FROM nodes n WHERE n.id IN (SELECT host_resources_out_of_step())"

# Inventory (what the node says about itself) ---------------------------------------------------

SET_INVENTORY = """
UPDATE nodes SET inventory = %(inventory)s, inventory_generation = %(generation)s WHERE id = %(node_id)s
"""
# A leased machine's inventory: all but its GPUs, which stay as they were when the lease began.
SET_LEASED_INVENTORY = """
UPDATE nodes SET inventory = %(inventory)s || jsonb_build_object('gpus', coalesce(inventory->'gpus', '[]'::jsonb)),
                 inventory_generation = %(generation)s
WHERE id = %(node_id)s
"""
SET_HELLO = """
UPDATE nodes SET daemon_version = %(daemon_version)s, capabilities = %(capabilities)s, labels = %(labels)s
WHERE id = %(node_id)s
"""
SET_LABELS = "UPDATE nodes SET labels = %(labels)s WHERE id = %(node_id)s"

# Sessions and liveness -------------------------------------------------------------------------

OPEN_SESSION = """
UPDATE nodes SET session_id = %(session_id)s, session_gateway = %(gateway)s, session_started_at = now()
WHERE id = %(node_id)s
"""
CLOSE_SESSION = """
UPDATE nodes SET session_id = NULL, session_gateway = NULL
WHERE id = %(node_id)s AND session_id = %(session_id)s
"""
CLOSE_GATEWAY_SESSIONS = "UPDATE nodes SET session_id = NULL, session_gateway = NULL WHERE session_gateway = %(gateway)s"
CURRENT_SESSION = "SELECT session_id FROM nodes WHERE id = %(node_id)s"
NOTIFY_SESSIONS = "SELECT pg_notify(%(channel)s, %(node_id)s)"

# Connected again (controlplane/migrations/0003_pki.sql): wakes its reservations and the pool.
SEEN = "SELECT node_seen(%(node_id)s) AS changed"
SET_APPLIED_GENERATION = "UPDATE nodes SET applied_generation = %(generation)s WHERE id = %(node_id)s"
SWEEP_UNREACHABLE = "SELECT sweep_unreachable(%(grace_seconds)s) AS node_id"
# A gateway's batch of what it heard (controlplane.nodes.connectivity.Liveness): `last_seen` moves
# to the time the node was last heard (now - its age) only when the stored one is older by more
# than the node's slack, so an idle fleet writes a row per node every so often, not per heartbeat.
# Rows another transaction holds (a desired-state bump, a heartbeat's write) are skipped, not waited
# for: the next round stores them.
# The arrays (thousands of nodes every round) go in binary (`%(...)b`): dumping them as text kept
# the gateway's event loop busy for tens of milliseconds a round, delaying every session.
REFRESH_SEEN = """
UPDATE nodes n SET last_seen = now() - make_interval(secs => d.age)
FROM (SELECT m.id, h.age
      FROM unnest(%(ids)b::text[], %(ages)b::float8[], %(slack)b::float8[]) AS h(id, age, slack)
      JOIN nodes m ON m.id = h.id
      WHERE m.last_seen IS NULL OR m.last_seen < now() - make_interval(secs => h.age + h.slack)
      ORDER BY m.id
      FOR UPDATE OF m SKIP LOCKED) AS d
WHERE n.id = d.id
"""
# In the sweep's own transaction, waiting for locks this time: the rows of nodes heard here whose
# stored time is older than `danger` seconds (none, normally) are stored before the sweep looks.
REFRESH_IN_DANGER = """
UPDATE nodes n SET last_seen = now() - make_interval(secs => h.age)
FROM unnest(%(ids)b::text[], %(ages)b::float8[]) AS h(id, age)
WHERE n.id = h.id AND n.last_seen < now() - make_interval(secs => GREATEST(h.age, %(danger)s))
"""
# Nodes heard within the grace that someone else marked otherwise (an operator, another gateway):
# connected again, as a heartbeat would make them.
RECONNECT_HEARD = """
SELECT id, node_seen(id) AS changed FROM nodes
WHERE id = ANY(%(ids)b::text[]) AND connectivity <> 'connected'
ORDER BY id
"""
SET_APPLIED_GENERATION_SEEN = """
UPDATE nodes SET applied_generation = %(generation)s, last_seen = now()
WHERE id = %(node_id)s AND connectivity = 'connected'
"""

# Desired state -----------------------------------------------------------------------------------

BUMP_DESIRED = "SELECT bump_desired(%(node_id)s)"
BUMP_DESIRED_OF_LIVE = """
SELECT bump_desired(node_id) FROM (
    SELECT DISTINCT node_id FROM allocations
    WHERE reservation_id = %(id)s AND state IN ('binding', 'bound')) live
"""
DESIRED_ASSIGNMENTS = """
SELECT a.id, a.device_ids, a.limits, r.request->>'binding' AS binding,
       r.request->'devices'->0->>'class' AS device_class,
       epoch_ms(max(upper(b.during))) AS until,
       d.profile_id, d.version AS profile_version, d.image, d.checksum
FROM allocations a
JOIN reservations r ON r.id = a.reservation_id
JOIN bookings b ON b.allocation_id = a.id
LEFT JOIN metal_deploys d ON d.allocation_id = a.id
WHERE a.node_id = %(node_id)s AND a.state IN ('binding', 'bound')
GROUP BY a.id, r.request, d.allocation_id
HAVING max(upper(b.during)) > compute_now()
ORDER BY a.id
"""
# The generation and the assignments in one statement, so in one snapshot: one row per
# assignment, or one row with a NULL id when there is none (and none when the node is unknown).
# A hold booking host resources (its limits not empty) is pinned to its devices' NUMA nodes: its
# row carries the node's facts for that (pin_inventory, pin_reserve; NULL on the other rows and
# for a node in no pool).
DESIRED_STATE = f"""
SELECT n.desired_generation, d.*,
       CASE WHEN d.limits <> '{{}}'::jsonb AND p.id IS NOT NULL THEN n.inventory END AS pin_inventory,
       CASE WHEN d.limits <> '{{}}'::jsonb AND p.id IS NOT NULL THEN host_reserve_vcpu(p.policy) END AS pin_reserve
FROM nodes n
LEFT JOIN pools p ON p.id = n.pool_id
LEFT JOIN LATERAL ({DESIRED_ASSIGNMENTS}) d ON true
WHERE n.id = %(node_id)s
ORDER BY d.id
"""

# Node reports ------------------------------------------------------------------------------------

# What intake decides on, in one read: the allocation when it is the reporting node's (no row:
# ignored), and the certificate of the report's key id (NULL columns: none) for
# attest.signing_key_in. `held`: the allocation's reports not judged yet, counted up to the cap
# (the partial index node_reports_unjudged): a report past it is dropped. Those of an allocation
# no longer live are never judged, so without the cap a node could write one row per message
# about it for ever.
INTAKE_FACTS = """
SELECT a.reservation_id,
       (SELECT count(*) FROM (SELECT 1 FROM node_reports
                              WHERE allocation_id = a.id AND judged_at IS NULL LIMIT %(cap)s) r) AS held,
       c.node_id AS cert_node_id, c.signing_key
FROM allocations a
LEFT JOIN node_certs c ON c.key_id = %(key_id)s
WHERE a.id = %(allocation_id)s AND a.node_id = %(node_id)s
"""
# Intake's write, in one statement: the signing key's high-water mark moves only forwards
# (`signing_key` NULL: the node's own key did not sign it, nothing to order it by), the report is
# kept unless the mark did not move (not newer: a replay), and its reservation wakes. `kept` 0: a
# replay.
INTAKE_KEEP = """
WITH advanced AS (
    INSERT INTO report_sequences AS s (signing_key, sequence)
    SELECT %(signing_key)s::bytea, %(sequence)s WHERE %(signing_key)s::bytea IS NOT NULL
    ON CONFLICT (signing_key) DO UPDATE SET sequence = excluded.sequence, updated_at = now()
    WHERE s.sequence < excluded.sequence
    RETURNING s.sequence
),
kept AS (
    INSERT INTO node_reports (node_id, allocation_id, kind, body, key_id, signature)
    SELECT %(node_id)s, %(allocation_id)s, %(kind)s, %(body)s, %(key_id)s, %(signature)s
    WHERE %(signing_key)s::bytea IS NULL OR EXISTS (SELECT 1 FROM advanced)
    RETURNING allocation_id
)
SELECT count(*) AS kept, count(wake_reservation(%(reservation_id)s)) AS woken FROM kept
"""

# The reservation worker's side: the unjudged reports of a reservation's live allocations, its
# verdicts, and the newest sequence accepted about an allocation from the node that signed with
# one key: from that key, or from any other of the node's certificates not revoked (the node's
# sequence runs across its renewals; a machine revoked and enrolled again may start it anew).
UNJUDGED_REPORTS = """
SELECT nr.id, nr.kind, nr.body, nr.key_id, nr.signature, nr.node_id AS reporter,
       a.id AS allocation_id, a.node_id, a.state AS allocation_state, a.device_ids
FROM node_reports nr
JOIN allocations a ON a.id = nr.allocation_id
WHERE a.reservation_id = %(id)s AND nr.judged_at IS NULL AND a.state IN ('binding', 'bound')
ORDER BY nr.id
FOR UPDATE OF nr
"""
# After judging, of a reservation's judged reports per allocation only the newest %(keep)s stay,
# and the newest accepted one per signing certificate and kind (what LAST_ACCEPTED compares a
# later report with: accepted sequences from one key only grow). The evidence a binding relies on
# is on the allocation row (bound_report, bound_sig_kid, bound_sig), not here.
PRUNE_JUDGED = """
DELETE FROM node_reports WHERE id IN (
    SELECT id FROM (
        SELECT nr.id, nr.verdict,
               row_number() OVER (PARTITION BY nr.allocation_id ORDER BY nr.id DESC) AS newest,
               row_number() OVER (PARTITION BY nr.allocation_id, nr.key_id, nr.kind, nr.verdict
                                  ORDER BY nr.id DESC) AS newest_of_key
        FROM node_reports nr JOIN allocations a ON a.id = nr.allocation_id
        WHERE a.reservation_id = %(id)s AND nr.judged_at IS NOT NULL
    ) r
    WHERE newest > %(keep)s AND NOT (verdict = 'accepted' AND newest_of_key = 1)
)
"""
# Retention: one batch of reports about allocations that ended (released or failed: never judged
# again) received longer ago than the window (wall-clock, like received_at).
DELETE_ENDED_REPORTS = """
DELETE FROM node_reports WHERE id IN (
    SELECT nr.id FROM node_reports nr JOIN allocations a ON a.id = nr.allocation_id
    WHERE a.state IN ('released', 'failed')
      AND nr.received_at < now() - %(retention_s)s * interval '1 second'
    LIMIT %(batch)s
    FOR UPDATE OF nr SKIP LOCKED
)
"""
JUDGED = "UPDATE node_reports SET judged_at = compute_now(), verdict = %(verdict)s, sequence = %(sequence)s WHERE id = %(id)s"
LAST_ACCEPTED = """
SELECT max(nr.sequence) AS sequence
FROM node_reports nr
JOIN node_certs c ON c.key_id = nr.key_id
JOIN node_certs k ON k.key_id = %(key_id)s
WHERE nr.allocation_id = %(allocation_id)s AND nr.verdict = 'accepted'
  AND (c.signing_key = k.signing_key
       OR (c.node_id = k.node_id AND NOT EXISTS (SELECT 1 FROM revocations v WHERE v.serial = c.serial)))
"""

# The capacity index's read (controlplane.placement.index_sync): allocatable host resources of one
# pool (%(pool)s, nodes empty) or of some nodes (%(nodes)s, pool NULL), less the pool's host reserve
# for vcpu (what a node can give: migration 0018's host_capacity).
CAPACITY_HOST_RESOURCES = """
SELECT h.node_id, h.resource,
       greatest(h.allocatable - CASE WHEN h.resource = 'vcpu' THEN host_reserve_vcpu(p.policy) ELSE 0 END, 0)
           AS allocatable
FROM host_resources h JOIN nodes n ON n.id = h.node_id JOIN pools p ON p.id = n.pool_id
WHERE n.pool_id = %(pool)s OR n.id = ANY(%(nodes)s)
"""

# MIG instances and slots (controlplane.nodes.shared_atoms) ------------------------------------

POOL_POLICY = "SELECT policy FROM pools WHERE id = %(pool_id)s"
# GPUs not bookable whole: all of a shared pool's (only their MIG instances or slots are), and an
# exclusive pool's GPUs in MIG mode (a workload given the whole GPU would see no device).
GPUS_NOT_WHOLE = """
UPDATE atoms SET bookable = false
WHERE node_id = %(node_id)s AND kind = 'gpu' AND bookable AND device_uuid = ANY(%(uuids)s)
"""
# The children of present GPUs (device "<uuid>:<n>"), with their parent's model, placement and
# health; bookable again if they were not. A child quarantined on its own (SetGpuHealth naming the
# instance or slot) stays quarantined: only the operator restores it, never the node's report.
UPSERT_CHILDREN = """
INSERT INTO atoms (id, node_id, kind, parent_id, device_uuid, model, numa_node, nvlink_domain, health,
                   profile, gpu_equivalent)
SELECT c.id, p.node_id, %(kind)s, p.id, c.device_uuid, p.model, p.numa_node, p.nvlink_domain, p.health,
       c.profile, 1::numeric / %(parts)s
FROM unnest(%(ids)s::text[], %(parents)s::text[], %(devices)s::text[], %(profiles)s::text[])
     AS c(id, parent_uuid, device_uuid, profile)
JOIN atoms p ON p.node_id = %(node_id)s AND p.kind = 'gpu' AND p.device_uuid = c.parent_uuid
ON CONFLICT (node_id, device_uuid, kind) DO UPDATE
SET parent_id = EXCLUDED.parent_id, model = EXCLUDED.model, numa_node = EXCLUDED.numa_node,
    nvlink_domain = EXCLUDED.nvlink_domain,
    health = CASE WHEN EXCLUDED.health = 'unhealthy' THEN EXCLUDED.health ELSE atoms.health END,
    profile = EXCLUDED.profile,
    gpu_equivalent = EXCLUDED.gpu_equivalent, bookable = true
WHERE (atoms.parent_id, atoms.model, atoms.numa_node, atoms.nvlink_domain, atoms.health, atoms.profile,
       atoms.gpu_equivalent, atoms.bookable)
      IS DISTINCT FROM (EXCLUDED.parent_id, EXCLUDED.model, EXCLUDED.numa_node, EXCLUDED.nvlink_domain,
                        EXCLUDED.health, EXCLUDED.profile, EXCLUDED.gpu_equivalent, true)
"""
# Children the inventory no longer has (or of a kind the pool does not book) stop being bookable;
# like GPUs, those booked or quarantined stay, the others go (DELETE_UNUSED_PARTS).
CHILDREN_GONE = """
UPDATE atoms SET bookable = false
WHERE node_id = %(node_id)s AND kind <> 'gpu' AND bookable
  AND NOT (kind = %(kind)s AND device_uuid = ANY(%(devices)s))
"""

# Tenancy (whole-machine leases, controlplane.metal) ---------------------------------------------

# A node lease's start: the node becomes its tenant's (leased); the state it had comes back.
LEASE = """
UPDATE nodes n SET state = 'leased'
FROM (SELECT id, state FROM nodes WHERE id = %(node_id)s FOR UPDATE) before
WHERE n.id = before.id
RETURNING before.state AS before
"""
# A machine wiped after a tenant had root on it: its last inventory was the tenant's word, so it is
# forgotten (no sizes: the host sync leaves it without rows) until the machine is enrolled anew.
FORGET_INVENTORY = "UPDATE nodes SET inventory = '{}'::jsonb WHERE id = %(node_id)s"
DELETE_HOST_RESOURCES = "DELETE FROM host_resources WHERE node_id = %(node_id)s"
# Wiped after the lease: back to the platform, in the state it had before.
UNLEASE = "UPDATE nodes SET state = %(state)s WHERE id = %(node_id)s AND state = 'leased' RETURNING pool_id"
