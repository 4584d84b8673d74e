-- Drafts (creates refused or abandoned before placement) expire after a retention window and are
-- capped per identity: the sweeper reads them by age, the cap by owner.
CREATE INDEX reservations_drafts_by_owner ON reservations (owner_identity_id, created_at) WHERE state = 'draft';
CREATE INDEX reservations_drafts_by_age ON reservations (created_at) WHERE state = 'draft';
