-- Spot and preemption: a regular reservation that fits nowhere looks up the pool's live spot
-- reservations (controlplane/placement/preempt.py), and a lease batch that left a regular member
-- pending asks whether there are any: both without scanning the pool's other reservations.
CREATE INDEX reservations_spot_live ON reservations (pool_id)
WHERE state IN ('placed', 'binding', 'active') AND request @> '{"spot": true}';
