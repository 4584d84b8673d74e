-- Watch's event frontier, webhooks and their deliveries.

-- Watch's frontier (see controlplane/watch.py): a transaction holds this shared advisory lock
-- from before it takes an event id until it ends, so another session can list, in pg_locks, the
-- transactions that may still commit an id it has not seen. Shared holders never wait on each
-- other; nothing takes the lock exclusively.
CREATE FUNCTION next_event_id() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7311005, 1);
    RETURN nextval('events_id_seq');
END $$;
ALTER TABLE events ALTER COLUMN id SET DEFAULT next_event_id();

-- The type filter of Watch and webhooks: empty matches all; an entry ending in '.' is a prefix,
-- any other entry an exact type.
CREATE FUNCTION event_type_matches(filters text[], event_type text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT cardinality(filters) = 0 OR EXISTS (
        SELECT 1 FROM unnest(filters) f
        WHERE f = event_type OR (right(f, 1) = '.' AND starts_with(event_type, f)))
$$;

CREATE TABLE webhooks (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    url         text NOT NULL CHECK (url ~ '^https?://' AND length(url) <= 2048),
    -- Kept as given: it is the HMAC key. Never returned by the API.
    secret      text NOT NULL CHECK (length(secret) BETWEEN 16 AND 256),
    event_types text[] NOT NULL DEFAULT '{}',
    created_by  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX webhooks_tenant ON webhooks (tenant_id, id);

-- One row per webhook and event: the delivery queue itself. A worker claims due rows with
-- FOR UPDATE SKIP LOCKED; a claim counts the attempt and pushes next_attempt_at out by a lease,
-- so the row of a worker that died mid-attempt becomes due again (at least once).
CREATE TABLE webhook_deliveries (
    webhook_id      text NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
    event_id        bigint NOT NULL REFERENCES events (id) ON DELETE CASCADE,
    subject         text NOT NULL,
    state           text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts        integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at timestamptz,
    last_attempt_at timestamptz,
    last_status     integer,
    last_error      text NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (webhook_id, event_id),
    CHECK ((state = 'pending') = (next_attempt_at IS NOT NULL))
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE state = 'pending';
-- Order per subject: a delivery waits while an earlier one of its webhook and subject is pending.
CREATE INDEX webhook_deliveries_subject ON webhook_deliveries (webhook_id, subject, event_id)
    WHERE state = 'pending';
CREATE INDEX webhook_deliveries_event ON webhook_deliveries (event_id);

-- Fan-out in the event's own transaction: a delivery exists exactly when its event committed,
-- with no cursor to keep (a cursor over a bigserial would skip an id committed late).
-- Events of one subject are written under that subject's row lock, so their ids follow their
-- commit order and the per-subject order of deliveries is the order of the changes.
CREATE FUNCTION webhook_fan_out() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webhook_deliveries (webhook_id, event_id, subject, next_attempt_at)
    SELECT w.id, NEW.id, NEW.subject, compute_now()
    FROM webhooks w
    WHERE w.tenant_id = NEW.tenant_id AND event_type_matches(w.event_types, NEW.type);
    IF FOUND THEN
        PERFORM pg_notify('bc_webhooks', NEW.tenant_id);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER events_webhook_fan_out AFTER INSERT ON events
    FOR EACH ROW EXECUTE FUNCTION webhook_fan_out();
