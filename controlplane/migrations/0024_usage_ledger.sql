-- The metering ledger: one row per (tenant, meter, subject, hour), written by the reconcilers once
-- the hour has ended. The key makes a rerun or a second replica write nothing twice.
CREATE TABLE usage_records (
    tenant_id   text NOT NULL,
    meter       text NOT NULL,
    subject     text NOT NULL,
    hour        timestamptz NOT NULL CHECK (date_trunc('hour', hour) = hour),
    quantity    numeric NOT NULL CHECK (quantity > 0),
    region      text NOT NULL DEFAULT '',
    pool_id     text NOT NULL DEFAULT '',
    provider    text NOT NULL DEFAULT '',
    recorded_at timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (tenant_id, meter, subject, hour)
);
CREATE INDEX usage_records_hour ON usage_records (tenant_id, hour);

-- How far each hourly reconciler has metered (the start of the first hour not yet written).
CREATE TABLE metering_progress (
    source        text PRIMARY KEY,
    metered_until timestamptz NOT NULL
);
