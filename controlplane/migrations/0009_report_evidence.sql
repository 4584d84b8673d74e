-- Evidence and replays. Only the reservation worker writes allocations.bound_report (after the
-- check passes); the gateway keeps reports in node_reports and nothing else.

-- The newest report sequence the gateway stored per node signing key (the raw Ed25519 key, so a
-- renewed certificate over the same key shares it). Advanced only by a report whose signature
-- that key made; a genuine report not newer than it is a replay and is not stored.
CREATE TABLE report_sequences (
    signing_key bytea PRIMARY KEY CHECK (length(signing_key) = 32),
    sequence    bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- The sequence of a report the worker accepted (NULL otherwise): a report about the same
-- allocation from the same signing key must be newer than every accepted one.
ALTER TABLE node_reports ADD COLUMN sequence bigint;
CREATE INDEX node_reports_accepted ON node_reports (allocation_id, key_id, sequence)
    WHERE verdict = 'accepted';

-- A node an operator revoked (RevokeCertificates by node id) enrols again only after ReadmitNode;
-- re-enrolment revokes a node's older certificates without marking the node.
ALTER TABLE nodes
    ADD COLUMN revoked_at     timestamptz,
    ADD COLUMN revoked_reason text NOT NULL DEFAULT '';
