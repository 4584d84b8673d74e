-- When the provider first answered an instance's create (hostile review, 2026-12-01). A create the
-- provider did not answer in time is given up (its row deleted, the provider asked to delete what
-- it may have made); a retry under the same key may meanwhile have had the provider's answer and
-- told the tenant "running". The give-up and the confirmation are decided under the row's lock:
-- a confirmed create is never given up, and a given-up one is never confirmed.
ALTER TABLE instances ADD COLUMN confirmed_at timestamptz;
