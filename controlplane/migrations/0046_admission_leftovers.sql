-- The live-drafts cap per identity (DESIGN.md 7a), held under concurrency. Transaction 1 counted
-- the identity's unfinished creates (drafts and requests awaiting confirmation) in one statement
-- and inserted its draft in another, with nothing between them, so concurrent creates with
-- distinct keys from one identity each saw room and all inserted, past the cap.
--
-- draft_room runs in the draft's insert statement (autocommit: the statement is its transaction,
-- so its lock is held until the draft commits). Each query of a VOLATILE plpgsql function takes a
-- fresh snapshot, so the count after the lock sees every draft committed before it.
--
-- Far from the cap (the count transaction 1 read, `seen`, plus max_connections is within it) the
-- identity's lock is taken SHARED: creates do not wait for each other. Every create in flight
-- holds a backend from its count to its commit, so at most max_connections of them are uncounted
-- by any one count: the shared count, re-read under the lock, must still leave that much room.
-- Near the cap the lock is EXCLUSIVE (it waits for the shared holders to commit, and they for it),
-- and the exact count under it decides. A shared count that finds the identity near the cap after
-- all raises draft-room-near: the caller runs the insert again as near (seen = cap).
CREATE OR REPLACE FUNCTION draft_room(p_identity text, p_cap integer, p_seen integer) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key bigint := hashtextextended('drafts:' || p_identity, 0);
    backends integer := current_setting('max_connections')::integer;
    live integer;
BEGIN
    IF p_seen + backends <= p_cap THEN
        PERFORM pg_advisory_xact_lock_shared(lock_key);
    ELSE
        PERFORM pg_advisory_xact_lock(lock_key);
    END IF;
    SELECT count(*) INTO live FROM (
        SELECT 1 FROM reservations
        WHERE owner_identity_id = p_identity AND state IN ('draft', 'awaiting-confirmation')
        LIMIT p_cap) d;
    IF p_seen + backends <= p_cap THEN
        IF live + backends > p_cap THEN
            RAISE EXCEPTION 'identity % is near its draft cap', p_identity
                USING ERRCODE = 'check_violation', CONSTRAINT = 'reservations_draft_room_near';
        END IF;
    ELSIF live >= p_cap THEN
        RAISE EXCEPTION 'identity % holds % unfinished creates', p_identity, live
            USING ERRCODE = 'check_violation', CONSTRAINT = 'reservations_draft_room';
    END IF;
    RETURN true;
END $$;

