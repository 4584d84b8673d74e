-- Operator creates that take an idempotency key (Admin.CreatePool, Admin.CreateToken): the
-- object's id is derived from the caller and the key (controlplane.ids.keyed_id), and the hash of
-- the normalised request is kept with it, so a retry with the same key reaches the same row and a
-- different request under the key is told apart (CONFLICT). NULL: created without a key.
ALTER TABLE pools ADD COLUMN request_hash text;
ALTER TABLE api_tokens ADD COLUMN request_hash text;
