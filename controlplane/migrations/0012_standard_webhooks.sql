-- Webhook secrets become Standard Webhooks secrets: "whsec_" and the base64 of the HMAC key.
--
-- A secret before this migration was the HMAC key itself (its UTF-8 bytes). Each becomes
-- "whsec_" and the base64 of those same bytes, so the key does not change: a receiver that knew
-- the old secret S verifies with "whsec_" + base64(S). New secrets are checked by the API (24 to 64
-- key bytes); old ones keep their length (16 to 256 characters).
ALTER TABLE webhooks DROP CONSTRAINT webhooks_secret_check;
UPDATE webhooks SET secret = 'whsec_' || translate(encode(convert_to(secret, 'UTF8'), 'base64'), E'\n', '');
ALTER TABLE webhooks ADD CONSTRAINT webhooks_secret_check
    CHECK (secret ~ '^whsec_[A-Za-z0-9+/]+={0,2}$' AND length(secret) <= 2048);
