-- A tenant's live usage per resource and denominator, kept beside its charges, so a charge no
-- longer sums every live charge of the tenant while it holds the limit row (that sum grew with
-- the tenant's reservations: thousands of rows read under the lock per create).
--
-- quota_usage is written only by the triggers below, in the transaction that writes the charges,
-- so it commits or rolls back with them: it cannot drift from the sum of live charges (the
-- invariants suite checks that it equals it). Each trigger is statement-level and adds one
-- aggregated delta per (tenant, resource, per) in key order, so two transactions lock usage rows
-- in the same order (a refund of several resources cannot deadlock a charge).
CREATE TABLE quota_usage (
    tenant_id text NOT NULL REFERENCES tenants (id),
    resource  text NOT NULL,
    per       bigint NOT NULL CHECK (per > 0),
    amount    bigint NOT NULL,  -- no CHECK: ON CONFLICT checks the proposed row, a negative delta
    PRIMARY KEY (tenant_id, resource, per)
);

INSERT INTO quota_usage (tenant_id, resource, per, amount)
SELECT tenant_id, resource, per, sum(amount) FROM quota_charges WHERE refunded_at IS NULL
GROUP BY tenant_id, resource, per;

CREATE FUNCTION quota_usage_on_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO quota_usage AS u (tenant_id, resource, per, amount)
    SELECT tenant_id, resource, per, sum(amount) FROM new_rows WHERE refunded_at IS NULL
    GROUP BY tenant_id, resource, per ORDER BY tenant_id, resource, per
    ON CONFLICT (tenant_id, resource, per) DO UPDATE SET amount = u.amount + EXCLUDED.amount;
    RETURN NULL;
END $$;

CREATE FUNCTION quota_usage_on_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO quota_usage AS u (tenant_id, resource, per, amount)
    SELECT tenant_id, resource, per, sum(delta)
    FROM (SELECT tenant_id, resource, per, amount AS delta FROM new_rows WHERE refunded_at IS NULL
          UNION ALL
          SELECT tenant_id, resource, per, -amount FROM old_rows WHERE refunded_at IS NULL) c
    GROUP BY tenant_id, resource, per HAVING sum(delta) <> 0 ORDER BY tenant_id, resource, per
    ON CONFLICT (tenant_id, resource, per) DO UPDATE SET amount = u.amount + EXCLUDED.amount;
    RETURN NULL;
END $$;

CREATE FUNCTION quota_usage_on_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO quota_usage AS u (tenant_id, resource, per, amount)
    SELECT tenant_id, resource, per, -sum(amount) FROM old_rows WHERE refunded_at IS NULL
    GROUP BY tenant_id, resource, per ORDER BY tenant_id, resource, per
    ON CONFLICT (tenant_id, resource, per) DO UPDATE SET amount = u.amount + EXCLUDED.amount;
    RETURN NULL;
END $$;

CREATE TRIGGER quota_charges_usage_insert AFTER INSERT ON quota_charges
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION quota_usage_on_insert();
CREATE TRIGGER quota_charges_usage_update AFTER UPDATE ON quota_charges
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION quota_usage_on_update();
CREATE TRIGGER quota_charges_usage_delete AFTER DELETE ON quota_charges
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION quota_usage_on_delete();

-- charge_quota (0020) summing the usage rows (one per denominator) instead of the live charges.
-- The limit row is locked first, as before; the usage is read after, so it includes every charge
-- committed by the transaction that held the lock (a concurrent refund only lowers it).
CREATE OR REPLACE FUNCTION charge_quota(
    p_tenant_id text, p_resource text, p_reservation_id text, p_amount bigint,
    p_per bigint DEFAULT 1, p_missing_is_unlimited boolean DEFAULT false,
    OUT quota_limit bigint, OUT used numeric, OUT charged boolean
)
LANGUAGE plpgsql AS $$
DECLARE
    num numeric := 0;
    den numeric := 1;
    g numeric;
    part record;
BEGIN
    SELECT q."limit" INTO quota_limit FROM quotas q
    WHERE q.tenant_id = p_tenant_id AND q.resource = p_resource FOR UPDATE;
    FOR part IN
        SELECT u.per, u.amount FROM quota_usage u
        WHERE u.tenant_id = p_tenant_id AND u.resource = p_resource AND u.amount > 0
    LOOP
        num := num * part.per + part.amount * den;
        den := den * part.per;
        g := gcd(num, den);
        num := div(num, g);
        den := div(den, g);
    END LOOP;
    used := num / den;
    IF quota_limit IS NULL AND p_missing_is_unlimited THEN
        charged := true;
    ELSE
        quota_limit := coalesce(quota_limit, 0);
        charged := num * p_per + p_amount * den <= quota_limit * den * p_per;
    END IF;
    IF charged THEN
        INSERT INTO quota_charges (reservation_id, tenant_id, resource, amount, per)
        VALUES (p_reservation_id, p_tenant_id, p_resource, p_amount, p_per)
        ON CONFLICT (reservation_id, resource) DO UPDATE
            SET amount = EXCLUDED.amount, per = EXCLUDED.per, charged_at = now(), refunded_at = NULL;
    END IF;
END $$;
