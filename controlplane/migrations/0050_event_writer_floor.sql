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
