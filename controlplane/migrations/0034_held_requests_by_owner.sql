-- A request awaiting its person's confirmation is an unfinished create like a draft: the cap on
-- live drafts per identity counts both (an agent cannot open confirmations without end), read by owner.
CREATE INDEX reservations_unfinished_by_owner ON reservations (owner_identity_id, created_at)
    WHERE state IN ('draft', 'awaiting-confirmation');
