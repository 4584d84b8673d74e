-- The reservation worker judges each stored node report once.
ALTER TABLE node_reports ADD COLUMN judged_at timestamptz;
ALTER TABLE node_reports ADD COLUMN verdict text;
CREATE INDEX node_reports_unjudged ON node_reports (allocation_id, id) WHERE judged_at IS NULL;
