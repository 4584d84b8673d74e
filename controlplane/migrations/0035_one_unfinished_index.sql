-- The live-drafts cap and offboarding's draft deletion read an identity's unfinished creates by
-- owner through reservations_unfinished_by_owner (0034), which covers drafts too; the drafts-only
-- index of 0007 is no longer read, and every create paid for an entry in it.
DROP INDEX reservations_drafts_by_owner;
