-- API tokens get an id (to list and revoke them without the secret), the secret's first
-- characters (to recognise one), and an expiry. Tokens issued before this migration had none:
-- they expire 30 days after it, so no permanent token survives the upgrade.
ALTER TABLE api_tokens ADD COLUMN id text;
ALTER TABLE api_tokens ADD COLUMN prefix text NOT NULL DEFAULT '';
ALTER TABLE api_tokens ADD COLUMN expires_at timestamptz;
UPDATE api_tokens SET id = 'tok_' || substr(encode(token_hash, 'hex'), 1, 26),
                      expires_at = now() + interval '30 days';
ALTER TABLE api_tokens ALTER COLUMN id SET NOT NULL;
ALTER TABLE api_tokens ALTER COLUMN expires_at SET NOT NULL;
-- A row written without the API (a script, a test) still gets an id and a short life.
ALTER TABLE api_tokens ALTER COLUMN id
    SET DEFAULT 'tok_' || substr(replace(gen_random_uuid()::text, '-', ''), 1, 26);
ALTER TABLE api_tokens ALTER COLUMN expires_at SET DEFAULT now() + interval '1 day';
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_id_key UNIQUE (id);
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_expiry CHECK (expires_at > created_at);
CREATE INDEX api_tokens_identity ON api_tokens (identity_id);
CREATE INDEX api_tokens_prefix ON api_tokens (prefix) WHERE prefix <> '';
