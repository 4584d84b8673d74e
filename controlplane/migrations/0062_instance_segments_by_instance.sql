-- An instance's billing segments, found by the instance: a grant start or end applied late
-- re-classes each instance's segments from startsAt or endsAt on (and a segment opened after a
-- stop reads the instance's last end), so every such read was a scan of the whole table.
CREATE INDEX instance_segments_instance ON instance_segments (instance_id, started_at);
