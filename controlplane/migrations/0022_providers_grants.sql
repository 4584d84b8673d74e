-- Provider accounts, the capacity reservations their provider reports, projects, and reservation
-- grants (spec 001). Written only by controlplane/vps/queries.py.

-- Named sub-scopes of a tenant; a grant that names one serves only its instances.
CREATE TABLE projects (
    id         text PRIMARY KEY CHECK (id ~ '^prj_[0-9a-hjkmnp-tv-z]{26,52}$'),
    tenant_id  text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name       text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT compute_now(),
    UNIQUE (tenant_id, name)
);

CREATE TABLE provider_accounts (
    id               text PRIMARY KEY CHECK (id ~ '^pacct_[0-9a-hjkmnp-tv-z]{26,52}$'),
    name             text NOT NULL UNIQUE,
    provider         text NOT NULL CHECK (provider IN ('sim')),
    endpoint         text NOT NULL,
    external_account text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT compute_now()
);

-- One row per reservation the provider reported on the account; `gone` once it stops reporting it.
-- short_total: the total a reservation-grant.capacity-short event was last published for.
CREATE TABLE provider_reservations (
    account_id     text NOT NULL REFERENCES provider_accounts (id) ON DELETE CASCADE,
    reservation_id text NOT NULL CHECK (length(reservation_id) <= 300 AND reservation_id ~ '^[A-Za-z0-9._/:-]+$'),
    flavor         text NOT NULL,
    region         text NOT NULL,
    total          integer NOT NULL CHECK (total >= 0),
    state          text NOT NULL CHECK (state IN ('ready', 'creating', 'gone')),
    pool_id        text REFERENCES pools (id),
    short_total    integer,
    seen_at        timestamptz NOT NULL DEFAULT compute_now(),
    gone_at        timestamptz,
    PRIMARY KEY (account_id, reservation_id)
);
CREATE INDEX provider_reservations_pool ON provider_reservations (pool_id) WHERE pool_id IS NOT NULL;

-- metered_until: the vps.grants reconciler has written the slot-hours of the term up to here.
CREATE TABLE reservation_grants (
    id               text PRIMARY KEY CHECK (id ~ '^rgrant_[0-9a-hjkmnp-tv-z]{26,52}$'),
    account_id       text NOT NULL,
    reservation_id   text NOT NULL,
    pool_id          text NOT NULL REFERENCES pools (id),
    tenant_id        text NOT NULL REFERENCES tenants (id),
    project_id       text REFERENCES projects (id),
    slots            integer NOT NULL CHECK (slots BETWEEN 1 AND 100000),
    starts_at        timestamptz NOT NULL,
    ends_at          timestamptz NOT NULL,
    state            text NOT NULL CHECK (state IN ('scheduled', 'active', 'ended', 'cancelled')),
    reason           text,
    region           text NOT NULL,
    flavor           text NOT NULL,
    provider         text NOT NULL,
    issuer_tenant_id text NOT NULL,
    idempotency_key  text NOT NULL,
    request_hash     text NOT NULL,
    created_by       text NOT NULL,
    metered_until    timestamptz,
    created_at       timestamptz NOT NULL DEFAULT compute_now(),
    UNIQUE (issuer_tenant_id, idempotency_key),
    CHECK (ends_at >= starts_at),
    FOREIGN KEY (account_id, reservation_id) REFERENCES provider_reservations ON DELETE CASCADE
);
CREATE INDEX reservation_grants_reservation ON reservation_grants (account_id, reservation_id, starts_at);
CREATE INDEX reservation_grants_tenant ON reservation_grants (tenant_id, created_at DESC);

-- A grant's state machine runs on the work queue at startsAt and endsAt.
ALTER TABLE work_items DROP CONSTRAINT work_items_kind_check;
ALTER TABLE work_items ADD CONSTRAINT work_items_kind_check CHECK (kind IN ('reservation', 'metal', 'grant'));
