-- "Events committed after the webhook are delivered to it" (events.proto). The fan-out ran when the
-- event row was inserted and read the webhooks its statement's snapshot showed: an event writer
-- open while a webhook was created (its event inserted before the webhook committed, itself
-- committing after) fanned out to no webhook, and its event was never delivered nor listed.
--
-- The fan-out now runs at the writer's commit (a deferred constraint trigger), after taking the
-- tenant's webhook lock shared: the advisory lock Webhooks.Create takes exclusively before it
-- counts and inserts (controlplane/webhooks/queries.py TENANT_LOCK), held by both to their ends.
-- A writer that takes it before a create's transaction does commits first, the create waiting for
-- it (an earlier event: not delivered); one that takes it after waits for the create to end and
-- then reads the webhooks in a new snapshot (READ COMMITTED, every event writer's level), which
-- shows the new webhook. A create waits only for writers already in their commit, and a writer
-- for a create's short transaction; shared holders never wait on each other.
-- The rest is migration 0050's: the head of a webhook and subject, the FOR SHARE lock on the
-- latest pending delivery (held to the writer's end, a moment later now), the NOTIFY (sent at
-- commit either way).
CREATE OR REPLACE FUNCTION webhook_fan_out() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    hook_id text;
    fanned boolean := false;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended('webhooks:' || NEW.tenant_id, 0));
    FOR hook_id IN
        SELECT w.id FROM webhooks w
        WHERE w.tenant_id = NEW.tenant_id AND event_type_matches(w.event_types, NEW.type)
        ORDER BY w.id
    LOOP
        PERFORM 1 FROM webhook_deliveries p
        WHERE p.webhook_id = hook_id AND p.subject = NEW.subject AND p.state = 'pending'
        ORDER BY p.event_id DESC
        LIMIT 1
        FOR SHARE;
        INSERT INTO webhook_deliveries (webhook_id, event_id, subject, next_attempt_at, tenant_id, head)
        VALUES (hook_id, NEW.id, NEW.subject, compute_now(), NEW.tenant_id, NOT FOUND);
        fanned := true;
    END LOOP;
    IF fanned THEN
        PERFORM pg_notify('bc_webhooks', NEW.tenant_id);
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER events_webhook_fan_out ON events;
CREATE CONSTRAINT TRIGGER events_webhook_fan_out AFTER INSERT ON events
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION webhook_fan_out();
