-- One device, one node: which node holds each GPU uuid (hostile review, 2026-12-01). A node could
-- report in its inventory a GPU another node had already reported; both nodes then had an atom of
-- that device, and bindings, CDI names and health could name another machine's GPU. The first node
-- to report a uuid holds it until its inventory no longer lists it, it is revoked, or its row goes;
-- another node reporting it meanwhile has it refused (controlplane.nodes.inventory). MIG instances
-- and slots ("<uuid>:<n>") are made only under a GPU their node holds, so they are unique with it.
CREATE TABLE gpu_holders (
    device_uuid text PRIMARY KEY,
    node_id     text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    held_since  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX gpu_holders_node ON gpu_holders (node_id);

-- The GPUs each node lists now, the oldest node first where two list one.
INSERT INTO gpu_holders (device_uuid, node_id)
SELECT a.device_uuid, a.node_id
FROM atoms a JOIN nodes n ON n.id = a.node_id
WHERE a.kind = 'gpu' AND n.revoked_at IS NULL
  AND EXISTS (SELECT 1 FROM jsonb_array_elements(CASE WHEN jsonb_typeof(n.inventory->'gpus') = 'array'
                                                      THEN n.inventory->'gpus' ELSE '[]' END) g
              WHERE g->>'uuid' = a.device_uuid)
ORDER BY n.created_at, n.id
ON CONFLICT (device_uuid) DO NOTHING;
