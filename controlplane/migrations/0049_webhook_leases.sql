-- The per-tenant cap on webhook attempts in flight counts leases kept here, apart from the
-- delivery rows: deleting a webhook deletes its deliveries (ON DELETE CASCADE), and with them the
-- lease of an attempt still running, so the cap counted one attempt fewer while it ran on to its
-- deadline and the tenant could take every slot of a process by deleting webhooks mid-attempt.
-- A lease row is written by the claim and removed by the attempt's outcome, whether or not its
-- delivery still exists; one whose worker died stops counting when it ends (and the next claim
-- removes it). No foreign keys: a lease outlives its webhook by design.
CREATE TABLE webhook_leases (
    webhook_id   text NOT NULL,
    event_id     bigint NOT NULL,
    tenant_id    text NOT NULL,
    attempt      integer NOT NULL,
    leased_until timestamptz NOT NULL,
    PRIMARY KEY (webhook_id, event_id)
);
CREATE INDEX webhook_leases_until ON webhook_leases (leased_until);

-- Attempts in flight when this migration runs keep counting.
INSERT INTO webhook_leases (webhook_id, event_id, tenant_id, attempt, leased_until)
SELECT d.webhook_id, d.event_id, w.tenant_id, d.attempts, d.leased_until
FROM webhook_deliveries d
JOIN webhooks w ON w.id = d.webhook_id
WHERE d.leased_until IS NOT NULL;
