-- Delegated confirmation of an extend: the confirmation names the end the person is asked to
-- approve (NULL for a create), and one used by the retry it approved is closed ('used'), so the
-- reservation's next extend held for confirmation can open its own (one open per reservation and
-- action) and the approval never authorises a second change.
ALTER TABLE confirmations ADD COLUMN until_at timestamptz;
ALTER TABLE confirmations DROP CONSTRAINT confirmations_state_check;
ALTER TABLE confirmations ADD CONSTRAINT confirmations_state_check
    CHECK (state IN ('pending', 'approved', 'rejected', 'expired', 'withdrawn', 'used'));
