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

-- The pool's per-GPU host share leaves out leased machines (hostile review, 2026-12-01): a tenant
-- with root on one says what its inventory is, and 256 GPUs on 3 vCPUs made every reservation's
-- share in the pool 0. A machine counts again once it is the platform's (wiped, enrolled anew).
CREATE OR REPLACE FUNCTION pool_host_share_per_gpu(p_pool_id text) RETURNS TABLE (resource text, per_gpu numeric)
LANGUAGE sql STABLE AS $$
    SELECT r.resource, min(host_capacity(n.id, r.resource) / g.gpus)
    FROM nodes n
    CROSS JOIN LATERAL (SELECT count(*) AS gpus FROM atoms a WHERE a.node_id = n.id AND a.kind = 'gpu') g
    CROSS JOIN (VALUES ('vcpu'), ('memoryGiB')) AS r(resource)
    WHERE n.pool_id = p_pool_id AND g.gpus > 0 AND n.state <> 'leased'
      AND EXISTS (SELECT 1 FROM host_resources h WHERE h.node_id = n.id AND h.resource = r.resource)
    GROUP BY r.resource
$$;
