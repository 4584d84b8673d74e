-- Webhook limits: a delivery attempt in flight holds a lease, and the per-tenant concurrency cap
-- counts the leases held.

-- Set by the claim to the end of the attempt's deadline and a margin, cleared by its outcome. A
-- lease that ran out (its worker died) no longer counts, and its row is due again then.
ALTER TABLE webhook_deliveries ADD COLUMN leased_until timestamptz;
ALTER TABLE webhook_deliveries ADD CONSTRAINT webhook_deliveries_lease_pending
    CHECK (leased_until IS NULL OR state = 'pending');
CREATE INDEX webhook_deliveries_leased ON webhook_deliveries (webhook_id) WHERE leased_until IS NOT NULL;
