-- Certificates found by the key they certify (hostile review, 2026-12-05): the CA refuses to
-- certify a key any certificate already names (controlplane/pki/store.py already_certified), so a
-- stolen key is never certified again after a revocation and one node never gets another's keys.
-- Also what a lost enrolment's or renewal's retry looks up (store.enrolled_with, certified_to).
-- Not unique: a database that issued a key twice before this check keeps those rows.
CREATE INDEX node_certs_public_key ON node_certs (public_key);
