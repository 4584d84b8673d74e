-- MIG instances and slots, and quota in fractions of a GPU and per model.

-- A MIG instance's profile (e.g. '1g.10gb'); '' for whole GPUs and slots.
ALTER TABLE atoms ADD COLUMN profile text NOT NULL DEFAULT '';

-- A charge is amount/per units of its resource: a MIG instance charges 1/7 of a GPU and a slot
-- 1/replicas, so a charge is stored as the exact fraction (amount 3, per 7: three instances).
ALTER TABLE quota_charges ADD COLUMN per bigint NOT NULL DEFAULT 1 CHECK (per > 0);

-- charge_quota (0016) with exact fractions, and with resources that limit only when the tenant
-- has a row for them (p_missing_is_unlimited: per-model rows, 'gpu:<model>'; the charge is still
-- recorded, so a limit set later counts what is already held). Used is summed per denominator and
-- added up as one exact fraction num/den; the charge fits when num/den + amount/per <= limit,
-- compared in integers. Locking and snapshots as in 0016: the limit row first (FOR UPDATE, also
-- when a lenient resource has no row: nothing to lock then, and nothing to decide either).
DROP FUNCTION charge_quota(text, text, text, bigint);

CREATE FUNCTION charge_quota(
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
        SELECT c.per, sum(c.amount) AS amount FROM quota_charges c
        WHERE c.tenant_id = p_tenant_id AND c.resource = p_resource AND c.refunded_at IS NULL
        GROUP BY c.per
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
