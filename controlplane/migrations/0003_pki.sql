-- The node PKI (the control-plane CA, join tokens, node certificates, revocations), node
-- sessions, and the reports nodes send. Certificate and token validity is wall-clock time
-- (now()), as X.509 and TLS see it, never compute_now(): moving the dev clock expires nothing.

-- The one CA: created once, under an advisory lock, by whichever process needs it first.
CREATE TABLE pki_ca (
    id              boolean PRIMARY KEY DEFAULT true CHECK (id),
    -- PKCS#8 PEM; encrypted when BC_CA_KEY_PASSPHRASE was set when it was created.
    key_pem         bytea NOT NULL,
    certificate_der bytea NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- One-time enrolment secrets, stored as SHA-256, bound to a pool, a node name and a role.
CREATE TABLE join_tokens (
    token_hash bytea PRIMARY KEY,
    pool_id    text NOT NULL REFERENCES pools (id) ON DELETE CASCADE,
    node_name  text NOT NULL CHECK (node_name ~ '^[A-Za-z0-9._-]{1,128}$'),
    role       text NOT NULL CHECK (role IN ('node', 'node-tenant')),
    expires_at timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    used_at    timestamptz,
    node_id    text REFERENCES nodes (id) ON DELETE SET NULL,
    CHECK ((used_at IS NULL) OR (node_id IS NOT NULL))
);

-- Every certificate the CA issued. A node holds two at a time, issued together from one CSR
-- bundle: `signing` (its Ed25519 report-signing key; key_id is what its reports name) and `tls`
-- (its ECDSA P-256 client key for mutual TLS). A gateway holds a `server` certificate.
CREATE TABLE node_certs (
    serial      text PRIMARY KEY,                -- lowercase hex
    node_id     text REFERENCES nodes (id) ON DELETE CASCADE,
    usage       text NOT NULL CHECK (usage IN ('signing', 'tls', 'server')),
    role        text NOT NULL CHECK (role IN ('node', 'node-tenant', 'gateway')),
    key_id      text NOT NULL UNIQUE,            -- SHA-256 hex of the certificate's DER
    public_key  bytea NOT NULL,                  -- the certified key (SubjectPublicKeyInfo DER)
    signing_key bytea,                           -- the raw Ed25519 key of a signing certificate
    certificate bytea NOT NULL,                  -- DER
    not_before  timestamptz NOT NULL,
    not_after   timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    CHECK ((role = 'gateway') = (node_id IS NULL)),
    CHECK ((role = 'gateway') = (usage = 'server')),
    CHECK (CASE WHEN usage = 'signing' THEN coalesce(length(signing_key), 0) = 32 ELSE signing_key IS NULL END),
    CHECK (not_before < not_after)
);
CREATE INDEX node_certs_node ON node_certs (node_id, not_after DESC);

CREATE TABLE revocations (
    serial     text PRIMARY KEY REFERENCES node_certs (serial) ON DELETE CASCADE,
    revoked_at timestamptz NOT NULL DEFAULT now(),
    reason     text NOT NULL DEFAULT ''
);

-- A node's newest session wins: the session that registers last owns the node, and older ones
-- (on any gateway) close when bc_node_session names the node.
ALTER TABLE nodes
    ADD COLUMN session_id         text,
    ADD COLUMN session_gateway    text,
    ADD COLUMN session_started_at timestamptz,
    -- The DesiredState generation the node last said it converged to (its heartbeat).
    ADD COLUMN applied_generation bigint NOT NULL DEFAULT 0;

-- Every report a node sent about one of its own allocations, as received (the node signed the
-- body; nobody else may change it). The reservation worker verifies; the gateway only routes.
CREATE TABLE node_reports (
    id            bigserial PRIMARY KEY,
    node_id       text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    allocation_id text NOT NULL REFERENCES allocations (id) ON DELETE CASCADE,
    kind          text NOT NULL CHECK (kind IN ('bound', 'failed', 'released')),
    body          bytea NOT NULL,
    key_id        text NOT NULL,
    signature     bytea NOT NULL,
    received_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX node_reports_allocation ON node_reports (allocation_id, id);

-- A node was heard from (liveness is wall-clock time, now(): moving the dev clock makes no node
-- unreachable). Connected again after unreachable or unknown: the reservations with live
-- allocations on it wake, and so do the pool's pending ones (placement skips unreachable nodes).
-- True when the connectivity changed.
CREATE FUNCTION node_seen(p_node_id text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    previous text;
    pool     text;
BEGIN
    SELECT connectivity, pool_id INTO previous, pool FROM nodes WHERE id = p_node_id FOR UPDATE;
    IF NOT FOUND THEN
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

-- The unreachable sweeper: nodes not heard from within the grace become unreachable, each
-- waking the reservations with live allocations on it. Safe with several gateways: a row locked
-- by another sweeper or by a heartbeat is skipped, and the state check makes the change once.
CREATE FUNCTION sweep_unreachable(p_grace_seconds double precision) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    node text;
BEGIN
    FOR node IN
        UPDATE nodes SET connectivity = 'unreachable'
        WHERE id IN (SELECT id FROM nodes
                     WHERE connectivity = 'connected'
                       AND last_seen < now() - make_interval(secs => p_grace_seconds)
                     ORDER BY id FOR UPDATE SKIP LOCKED)
          AND connectivity = 'connected'
        RETURNING id
    LOOP
        PERFORM wake_node_reservations(node);
        RETURN NEXT node;
    END LOOP;
END
$$;
