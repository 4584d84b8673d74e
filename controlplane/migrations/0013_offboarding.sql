-- Offboarding: an identity leaves and a successor takes over its live reservations.
--
-- An offboarded identity keeps its row (reservations, events and confirmations name it) but can
-- no longer authenticate or be issued tokens. `successor_id` is who took its reservations (the
-- same successor makes a repeated offboarding a no-op); `offboard_reason` says whether it was
-- offboarded itself or lost its delegation when its person was.
ALTER TABLE identities ADD COLUMN offboarded_at timestamptz;
ALTER TABLE identities ADD COLUMN successor_id text REFERENCES identities (id);
ALTER TABLE identities ADD COLUMN offboard_reason text;
ALTER TABLE identities ADD CONSTRAINT identities_offboarded CHECK (
    (offboarded_at IS NULL) = (offboard_reason IS NULL)
    AND offboard_reason IN ('offboarded', 'delegator-offboarded')
    AND (successor_id IS NULL OR successor_id <> id));
CREATE INDEX identities_delegator ON identities (delegator_id) WHERE delegator_id IS NOT NULL;

-- An idempotency key belongs to the identity that sent it, not to whoever owns the reservation
-- now: a reassigned reservation keeps its creator's key, and the successor's own keys stay free
-- (their reservation ids are derived from the successor's identity). NULL while the owner is the
-- creator, so creates write no new column.
ALTER TABLE reservations ADD COLUMN creator_identity_id text REFERENCES identities (id);
ALTER TABLE reservations DROP CONSTRAINT reservations_tenant_id_owner_identity_id_idempotency_key_key;
CREATE UNIQUE INDEX reservations_idempotency_key
    ON reservations (tenant_id, coalesce(creator_identity_id, owner_identity_id), idempotency_key);
CREATE INDEX reservations_by_owner ON reservations (owner_identity_id, tenant_id);

-- A confirmation is withdrawn when the person asked, or the agent asking, is offboarded.
ALTER TABLE confirmations DROP CONSTRAINT confirmations_state_check;
ALTER TABLE confirmations ADD CONSTRAINT confirmations_state_check
    CHECK (state IN ('pending', 'approved', 'rejected', 'expired', 'withdrawn'));

-- No new reservation for an offboarded identity, even from a request it authenticated just
-- before: the lock waits for an offboarding in progress (which holds the identity row) and then
-- reads its outcome. A create that got in first is seen by the offboarding, which waits for it.
CREATE FUNCTION reservations_owner_not_offboarded() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    gone timestamptz;
BEGIN
    SELECT offboarded_at INTO gone FROM identities WHERE id = NEW.owner_identity_id FOR KEY SHARE;
    IF gone IS NOT NULL THEN
        RAISE EXCEPTION 'identity % is offboarded', NEW.owner_identity_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'reservations_owner_not_offboarded';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER reservations_owner_not_offboarded BEFORE INSERT ON reservations
    FOR EACH ROW EXECUTE FUNCTION reservations_owner_not_offboarded();
