-- Core schema: tenancy, pools and nodes, atoms and bookings, reservations, quota, IAM, events.
CREATE EXTENSION IF NOT EXISTS btree_gist;

-- The one clock: the database's now() plus an offset that only dev/test mode moves.
CREATE TABLE clock (
    id        boolean PRIMARY KEY DEFAULT true CHECK (id),
    offset_ms bigint  NOT NULL DEFAULT 0 CHECK (offset_ms >= 0)
);
INSERT INTO clock DEFAULT VALUES;

CREATE FUNCTION compute_now() RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT now() + offset_ms * interval '1 millisecond' FROM clock
$$;

CREATE FUNCTION epoch_ms(t timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT (extract(epoch FROM t) * 1000)::bigint $$;

CREATE FUNCTION from_epoch_ms(ms bigint) RETURNS timestamptz
LANGUAGE sql IMMUTABLE AS $$ SELECT to_timestamp(ms / 1000.0) $$;

-- Tenancy and authentication ------------------------------------------------------------

CREATE TABLE tenants (
    id         text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9._:-]{1,128}$'),
    name       text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE identities (
    id              text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9._:@-]{1,128}$'),
    kind            text NOT NULL CHECK (kind IN ('user', 'service', 'agent')),
    name            text NOT NULL,
    -- An agent acts for a person in a delegated session.
    delegator_id    text REFERENCES identities (id),
    confirm_actions text[] NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'agent') = (delegator_id IS NOT NULL))
);

CREATE TABLE memberships (
    tenant_id   text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    identity_id text NOT NULL REFERENCES identities (id) ON DELETE CASCADE,
    PRIMARY KEY (tenant_id, identity_id)
);

CREATE TABLE api_tokens (
    token_hash  bytea PRIMARY KEY,           -- SHA-256 of the secret; the secret is never stored
    identity_id text NOT NULL REFERENCES identities (id) ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

-- Pools, nodes, atoms ------------------------------------------------------------------

CREATE TABLE pools (
    id              text PRIMARY KEY,
    owner_tenant_id text NOT NULL REFERENCES tenants (id),
    name            text NOT NULL,
    region          text NOT NULL DEFAULT '',
    policy          jsonb NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE pool_offers (
    pool_id   text NOT NULL REFERENCES pools (id) ON DELETE CASCADE,
    tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    PRIMARY KEY (pool_id, tenant_id)
);

CREATE TABLE nodes (
    id                   text PRIMARY KEY,
    pool_id              text NOT NULL REFERENCES pools (id),
    name                 text NOT NULL,
    -- {key: {"value": ..., "source": "system" | "operator"}}
    labels               jsonb NOT NULL DEFAULT '{}',
    capabilities         text[] NOT NULL DEFAULT '{}',
    state                text NOT NULL DEFAULT 'ready' CHECK (state IN ('ready', 'cordoned')),
    connectivity         text NOT NULL DEFAULT 'unknown'
                         CHECK (connectivity IN ('connected', 'unreachable', 'unknown')),
    last_seen            timestamptz,
    daemon_version       text NOT NULL DEFAULT '',
    inventory_generation bigint NOT NULL DEFAULT 0,
    inventory            jsonb NOT NULL DEFAULT '{}',
    created_at           timestamptz NOT NULL DEFAULT now(),
    UNIQUE (pool_id, name)
);

CREATE TABLE atoms (
    id             text PRIMARY KEY,
    node_id        text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    kind           text NOT NULL CHECK (kind IN ('gpu', 'gpu.mig', 'gpu.slot')),
    parent_id      text REFERENCES atoms (id),
    device_uuid    text NOT NULL,
    model          text NOT NULL,
    numa_node      integer NOT NULL DEFAULT 0,
    nvlink_domain  text NOT NULL DEFAULT '',
    health         text NOT NULL DEFAULT 'healthy' CHECK (health IN ('healthy', 'unhealthy')),
    bookable       boolean NOT NULL DEFAULT true,
    gpu_equivalent numeric NOT NULL DEFAULT 1 CHECK (gpu_equivalent > 0 AND gpu_equivalent <= 1),
    UNIQUE (node_id, device_uuid, kind),
    CHECK ((kind = 'gpu') = (parent_id IS NULL))
);
CREATE INDEX atoms_node ON atoms (node_id);

CREATE TABLE host_resources (
    node_id     text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    resource    text NOT NULL CHECK (resource IN ('vcpu', 'memoryGiB', 'hugepages2Mi', 'hugepages1Gi')),
    allocatable numeric NOT NULL CHECK (allocatable >= 0),
    PRIMARY KEY (node_id, resource)
);

-- Reservations, allocations, bookings --------------------------------------------------

CREATE TABLE reservations (
    id                text PRIMARY KEY,     -- the deterministic draft id
    tenant_id         text NOT NULL REFERENCES tenants (id),
    pool_id           text NOT NULL REFERENCES pools (id),
    owner_identity_id text NOT NULL REFERENCES identities (id),
    idempotency_key   text NOT NULL,
    request           jsonb NOT NULL,
    request_hash      text NOT NULL,
    state             text NOT NULL DEFAULT 'draft' CHECK (state IN (
                          'draft', 'awaiting-confirmation', 'pending', 'queued', 'placed',
                          'binding', 'active', 'denied', 'released', 'failed', 'cancelled',
                          'expired')),
    during            tstzrange,
    lease_deadline    timestamptz,
    conditions        jsonb NOT NULL DEFAULT '[]',
    operation_state   text NOT NULL DEFAULT 'running'
                      CHECK (operation_state IN ('running', 'succeeded', 'failed')),
    attempts          integer NOT NULL DEFAULT 0,
    host_share        jsonb,
    end_reason        text,
    version           bigint NOT NULL DEFAULT 1,
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (tenant_id, owner_identity_id, idempotency_key),
    -- Placed and later states have a window; drafts and pending ones may not.
    CHECK (state NOT IN ('placed', 'binding', 'active') OR during IS NOT NULL)
);
CREATE INDEX reservations_tenant_newest ON reservations (tenant_id, created_at DESC, id DESC);
CREATE INDEX reservations_pending ON reservations (pool_id, created_at) WHERE state = 'pending';

CREATE TABLE allocations (
    id             text PRIMARY KEY,
    reservation_id text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    node_id        text NOT NULL REFERENCES nodes (id),
    state          text NOT NULL DEFAULT 'placed'
                   CHECK (state IN ('placed', 'binding', 'bound', 'released', 'failed')),
    device_ids     text[] NOT NULL,
    limits         jsonb NOT NULL DEFAULT '{}',
    binding        jsonb,
    bound_report   bytea,
    bound_sig_kid  text,
    bound_sig      bytea,
    bind_deadline  timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX allocations_reservation ON allocations (reservation_id);
CREATE INDEX allocations_node ON allocations (node_id);

CREATE TABLE bookings (
    atom_id       text NOT NULL REFERENCES atoms (id),
    allocation_id text NOT NULL REFERENCES allocations (id) ON DELETE CASCADE,
    during        tstzrange NOT NULL CHECK (NOT isempty(during)),
    CONSTRAINT bookings_no_overlap EXCLUDE USING gist (atom_id WITH =, during WITH &&)
);
CREATE INDEX bookings_allocation ON bookings (allocation_id);

CREATE TABLE host_bookings (
    allocation_id text NOT NULL REFERENCES allocations (id) ON DELETE CASCADE,
    node_id       text NOT NULL REFERENCES nodes (id),
    resource      text NOT NULL,
    amount        numeric NOT NULL CHECK (amount >= 0),
    during        tstzrange NOT NULL,
    PRIMARY KEY (allocation_id, resource)
);

-- Quota --------------------------------------------------------------------------------

CREATE TABLE quotas (
    tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    resource  text NOT NULL,
    "limit"   bigint NOT NULL CHECK ("limit" >= 0),
    PRIMARY KEY (tenant_id, resource)
);

-- One row per reservation and resource; used = the sum of live (unrefunded) charges.
CREATE TABLE quota_charges (
    reservation_id text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    tenant_id      text NOT NULL REFERENCES tenants (id),
    resource       text NOT NULL,
    amount         bigint NOT NULL CHECK (amount > 0),
    charged_at     timestamptz NOT NULL DEFAULT now(),
    refunded_at    timestamptz,
    PRIMARY KEY (reservation_id, resource)
);
CREATE INDEX quota_charges_live ON quota_charges (tenant_id, resource) WHERE refunded_at IS NULL;

-- IAM ----------------------------------------------------------------------------------

CREATE TABLE policies (
    tenant_id  text PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
    cedar      text NOT NULL,
    version    bigint NOT NULL DEFAULT 1,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- What IAM decides on: the draft's attributes, and one pending change per resource.
CREATE TABLE authz_projection (
    reservation_id text PRIMARY KEY REFERENCES reservations (id) ON DELETE CASCADE,
    attributes     jsonb NOT NULL,
    pending        jsonb,
    decision       text CHECK (decision IN ('allow', 'deny', 'confirm')),
    decided_at     timestamptz
);

CREATE TABLE confirmations (
    id                 text PRIMARY KEY,
    tenant_id          text NOT NULL REFERENCES tenants (id),
    reservation_id     text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    request_hash       text NOT NULL,
    action             text NOT NULL,
    agent_identity_id  text NOT NULL REFERENCES identities (id),
    person_identity_id text NOT NULL REFERENCES identities (id),
    state              text NOT NULL DEFAULT 'pending'
                       CHECK (state IN ('pending', 'approved', 'rejected', 'expired')),
    expires_at         timestamptz NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    decided_at         timestamptz
);
-- At most one open confirmation per reservation and action.
CREATE UNIQUE INDEX confirmations_open ON confirmations (reservation_id, action)
    WHERE state IN ('pending', 'approved');

CREATE TABLE extend_holds (
    reservation_id text PRIMARY KEY REFERENCES reservations (id) ON DELETE CASCADE,
    hold           text NOT NULL,
    taken_at       timestamptz NOT NULL
);

-- Events (outbox) ----------------------------------------------------------------------

CREATE TABLE events (
    id        bigserial PRIMARY KEY,
    tenant_id text NOT NULL,
    type      text NOT NULL,
    subject   text NOT NULL,
    data      jsonb NOT NULL,
    time      timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX events_tenant ON events (tenant_id, id);
CREATE INDEX events_subject ON events (subject, id);
