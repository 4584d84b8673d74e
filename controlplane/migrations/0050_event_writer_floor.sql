-- An event id is final below the smallest id an open event writer may still commit, so a webhook
-- delivers an event only once every smaller id has committed or never will (controlplane/events.py).
-- A delivery went out as soon as its event committed, while a writer holding a smaller id was
-- still open: a client resuming Watch after the id it got by webhook never saw that event.

-- Besides the shared lock Watch's hub reads (migration 0005), a transaction's first call takes a
-- second shared lock keyed by a lower bound of every id it will take: the sequence's value read
-- before its first nextval (the sequence is not cached per session, so nextval only goes up from
-- there). The key is the two-key form (objsubid 2): 1000000000 + (floor >> 31), floor & 2^31-1.
-- A transaction holding the first lock but not yet the second has not called nextval yet: its ids
-- will exceed every id already committed. The transaction-local setting bc.event_writer marks a
-- transaction that already holds both (an aborted savepoint releases its locks and the setting).
CREATE OR REPLACE FUNCTION next_event_id() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    floor_id bigint;
BEGIN
    IF coalesce(current_setting('bc.event_writer', true), '') = '' THEN
        PERFORM pg_advisory_xact_lock_shared(7311005, 1);
        SELECT last_value INTO floor_id FROM events_id_seq;
        PERFORM pg_advisory_xact_lock_shared(1000000000 + (floor_id >> 31)::integer,
                                             (floor_id & 2147483647)::integer);
        PERFORM set_config('bc.event_writer', floor_id::text, true);
    END IF;
    RETURN nextval('events_id_seq');
END $$;

-- Every event id below the answer has committed or never will: the smallest floor of the event
-- writers open now (read after the caller's snapshot, so an event the caller sees below it is
-- final), or the largest bigint when none is open.
CREATE FUNCTION events_final_below() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(min(((l.classid::bigint - 1000000000) << 31) | l.objid::bigint), 9223372036854775807)
    FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.classid >= 1000000000
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
$$;

-- The claim reads only what it claims (controlplane/webhooks/queries.py): it read every due
-- pending delivery, every tenant's, to rank them, so a tenant with a long backlog (one subject
-- queued behind a failing receiver) made every claim of every worker read all of it. A delivery
-- now carries its tenant and whether it is the head of its webhook and subject's queue (the
-- earliest pending one: the only one that may be attempted), and the claim reads, per tenant with
-- pending deliveries, at most its free slots' worth of due heads from one index.
ALTER TABLE webhook_deliveries ADD COLUMN tenant_id text;
ALTER TABLE webhook_deliveries ADD COLUMN head boolean NOT NULL DEFAULT false;
UPDATE webhook_deliveries d SET tenant_id = w.tenant_id FROM webhooks w WHERE w.id = d.webhook_id;
ALTER TABLE webhook_deliveries ALTER COLUMN tenant_id SET NOT NULL;
UPDATE webhook_deliveries d SET head = true
WHERE d.state = 'pending' AND NOT EXISTS (
    SELECT 1 FROM webhook_deliveries p
    WHERE p.webhook_id = d.webhook_id AND p.subject = d.subject AND p.state = 'pending' AND p.event_id < d.event_id);
CREATE INDEX webhook_deliveries_heads ON webhook_deliveries (tenant_id, next_attempt_at, event_id)
    WHERE state = 'pending' AND head;
DROP INDEX webhook_deliveries_due;  -- read by nothing now

-- A new delivery is the head when no delivery of its webhook and subject is pending. The latest
-- pending one is locked FOR SHARE until this transaction ends, so its outcome (which makes the
-- next one the head, in a statement of its own) waits for this delivery to be visible; and if
-- that outcome came first, the lock waits for it and finds the row no longer pending.
CREATE OR REPLACE FUNCTION webhook_fan_out() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    hook_id text;
    fanned boolean := false;
BEGIN
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
