-- VM instances on a provider reservation, and their billing segments (what each running stretch
-- is billed as). Written only by controlplane/vps/queries.py.

CREATE TABLE instances (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL REFERENCES tenants (id),
    project_id      text REFERENCES projects (id),
    pool_id         text NOT NULL REFERENCES pools (id),
    account_id      text NOT NULL,
    reservation_id  text NOT NULL,
    flavor          text NOT NULL,
    name            text NOT NULL,
    state           text NOT NULL CHECK (state IN ('running', 'stopped', 'deleted')),
    grant_id        text REFERENCES reservation_grants (id) ON DELETE SET NULL,
    placement       text NOT NULL CHECK (placement IN ('grant', 'reserved', 'on-demand')),
    billing         text NOT NULL CHECK (billing IN ('standard', 'none')),
    idempotency_key text NOT NULL,
    request_hash    text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    deleted_at      timestamptz,
    UNIQUE (tenant_id, idempotency_key),
    CHECK ((placement = 'grant') = (grant_id IS NOT NULL) OR state = 'deleted'),
    CHECK (billing = 'standard' OR grant_id IS NULL)
);
CREATE INDEX instances_reservation ON instances (account_id, reservation_id) WHERE state <> 'deleted';
CREATE INDEX instances_grant ON instances (grant_id) WHERE grant_id IS NOT NULL;

-- One row per stretch an instance runs under one billing class: grant (informational usage of a
-- grant's slot), reserved (an ordinary slot, reservation rate), on-demand (the reservation gone).
-- ended_at NULL: still running so. Instances with billing 'none' have none.
CREATE TABLE instance_segments (
    id          bigserial PRIMARY KEY,
    instance_id text NOT NULL REFERENCES instances (id) ON DELETE CASCADE,
    tenant_id   text NOT NULL,
    class       text NOT NULL CHECK (class IN ('grant', 'reserved', 'on-demand')),
    grant_id    text,
    pool_id     text NOT NULL,
    region      text NOT NULL,
    provider    text NOT NULL,
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz,
    CHECK (ended_at IS NULL OR ended_at >= started_at)
);
CREATE UNIQUE INDEX instance_segments_open ON instance_segments (instance_id) WHERE ended_at IS NULL;
CREATE INDEX instance_segments_time ON instance_segments (started_at, ended_at);
