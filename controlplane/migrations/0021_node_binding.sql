-- The node binding (whole-machine leases): operator-managed profiles and their versions, the
-- deploys metal runs, the 'metal' work kind, and the node state of a machine a tenant holds.

-- A profile is what a leased machine runs; each version names an image and its checksum and
-- never changes once registered.
CREATE TABLE node_profiles (
    id          text PRIMARY KEY CHECK (id ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    description text NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE node_profile_versions (
    profile_id text NOT NULL REFERENCES node_profiles (id) ON DELETE CASCADE,
    version    integer NOT NULL CHECK (version BETWEEN 1 AND 1000000),
    image      text NOT NULL CHECK (length(image) BETWEEN 1 AND 512),
    checksum   text NOT NULL CHECK (checksum ~ '^sha256:[0-9a-f]{64}$'),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (profile_id, version)
);

-- One deploy per node-lease allocation, written by metal (controlplane/metal) when the lease
-- starts: the profile version it deploys (copied, so what the node is told never changes under
-- it), its deadline, and how it ended. `wiped_at` is set when the node reported the machine
-- wiped after the lease, which returns the node to the platform.
CREATE TABLE metal_deploys (
    allocation_id  text PRIMARY KEY REFERENCES allocations (id) ON DELETE CASCADE,
    reservation_id text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    node_id        text NOT NULL REFERENCES nodes (id),
    profile_id     text NOT NULL,
    version        integer NOT NULL,
    image          text NOT NULL,
    checksum       text NOT NULL,
    state          text NOT NULL DEFAULT 'deploying'
                   CHECK (state IN ('deploying', 'deployed', 'failed', 'ended')),
    reason         text,
    deadline       timestamptz NOT NULL,
    -- The node's state before the lease ('ready' or 'cordoned'): what it returns to after the wipe.
    node_state_before text NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT compute_now(),
    -- Wall-clock time (certificates live on now(), not compute_now()): certificates the node was
    -- issued before it are revoked when it returns from the tenant, so no key that was on the
    -- machine while a tenant held it serves the platform again.
    leased_at      timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    -- When the node first reported anything about this deploy: a deploy it never heard of never
    -- gave the tenant the machine, so no wipe is waited for after it.
    reported_at    timestamptz,
    wiped_at       timestamptz,
    FOREIGN KEY (profile_id, version) REFERENCES node_profile_versions (profile_id, version)
);
CREATE INDEX metal_deploys_node ON metal_deploys (node_id, started_at DESC);
-- At most one deploy per node is under way.
CREATE UNIQUE INDEX metal_deploys_one_live ON metal_deploys (node_id) WHERE state = 'deploying';

-- A leased node belongs to its tenant from the lease's start until metal saw it wiped: it is not
-- schedulable (placement takes only 'ready' nodes) and its certificates carry the role node-tenant.
ALTER TABLE nodes DROP CONSTRAINT nodes_state_check;
ALTER TABLE nodes ADD CONSTRAINT nodes_state_check CHECK (state IN ('ready', 'cordoned', 'leased'));

-- The metal worker's items: subject = a node id.
ALTER TABLE work_items DROP CONSTRAINT work_items_kind_check;
ALTER TABLE work_items ADD CONSTRAINT work_items_kind_check CHECK (kind IN ('reservation', 'metal'));

-- What a leased node says is on its disk changed (deploying, deployed, failed, wiping, wiped):
-- metal looks at it now. Only a leased node wakes it, so no other node can make work.
CREATE FUNCTION metal_deployed_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM schedule_work('metal', NEW.id, compute_now());
    RETURN NULL;
END $$;

CREATE TRIGGER nodes_metal_deployed AFTER UPDATE OF inventory ON nodes
FOR EACH ROW
WHEN (NEW.state = 'leased' AND OLD.inventory->'deployed' IS DISTINCT FROM NEW.inventory->'deployed')
EXECUTE FUNCTION metal_deployed_changed();
