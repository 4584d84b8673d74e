-- The work queue's kinds and dead letters.

-- Only kinds a handler serves can be inserted. The app registers one handler per kind
-- (controlplane/app.py); a new kind comes with a migration that widens this CHECK. 'pool' and
-- 'webhook' were allowed but never had a handler: their items were deleted unhandled, so none
-- that exist now carry anything.
DELETE FROM work_items WHERE kind <> 'reservation';
ALTER TABLE work_items DROP CONSTRAINT work_items_kind_check;
ALTER TABLE work_items ADD CONSTRAINT work_items_kind_check CHECK (kind IN ('reservation'));

-- An item whose handler failed work_max_attempts times (BC_WORK_MAX_ATTEMPTS) is dead: it keeps
-- its attempts and last error, no worker claims it again, and the worker logs "work item dead".
ALTER TABLE work_items ADD COLUMN dead_at timestamptz;
DROP INDEX work_items_due;
CREATE INDEX work_items_due ON work_items (run_at) WHERE dead_at IS NULL;

-- What operators read: SELECT * FROM dead_work_items ORDER BY dead_at DESC.
-- To retry one after the cause is fixed:
--   UPDATE work_items SET dead_at = NULL, attempts = 0, run_at = compute_now() WHERE id = …;
--   NOTIFY bc_work;
CREATE VIEW dead_work_items AS
SELECT id, kind, subject, attempts, last_error, created_at, dead_at
FROM work_items
WHERE dead_at IS NOT NULL;
