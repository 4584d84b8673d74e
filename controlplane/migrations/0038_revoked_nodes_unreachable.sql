-- A revoked node is unschedulable at once (hostile review, 2026-12-01). Its atoms stayed bookable
-- until the gateway's sweep marked it unreachable, so a create right after the revocation could be
-- placed on it. The revocation now marks it unreachable in its own transaction
-- (controlplane.nodes.registry.mark_revoked); here a revoked node is never made connected again by
-- being heard (a session, a hello or heartbeat still in flight): it is connected again only once
-- readmitted, enrolled anew and heard from. Otherwise as migration 0003's.
CREATE OR REPLACE FUNCTION node_seen(p_node_id text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    previous text;
    pool     text;
    revoked  timestamptz;
BEGIN
    SELECT connectivity, pool_id, revoked_at INTO previous, pool, revoked FROM nodes WHERE id = p_node_id FOR UPDATE;
    IF NOT FOUND OR revoked IS NOT NULL THEN
        RETURN false;
    END IF;
    UPDATE nodes SET last_seen = now(), connectivity = 'connected' WHERE id = p_node_id;
    IF previous <> 'connected' THEN
        PERFORM wake_node_reservations(p_node_id);
        PERFORM pg_notify('bc_pool_freed', pool);
        RETURN true;
    END IF;
    RETURN false;
END
$$;
