-- A quota charge for one resource in one call, for the short locked part of admission: the three
-- statements quota.charge ran (lock the tenant's limit row, sum the live charges, insert the
-- charge when it fits), unchanged. Each statement of a plpgsql function takes its own snapshot
-- under read committed, so the sum is read after the limit row is locked and sees every charge
-- committed by the transaction that held it, as the separate statements did.
CREATE FUNCTION charge_quota(
    p_tenant_id text, p_resource text, p_reservation_id text, p_amount bigint,
    OUT quota_limit bigint, OUT used bigint, OUT charged boolean
)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT q."limit" INTO quota_limit FROM quotas q
    WHERE q.tenant_id = p_tenant_id AND q.resource = p_resource FOR UPDATE;
    quota_limit := coalesce(quota_limit, 0);
    SELECT coalesce(sum(c.amount), 0) INTO used FROM quota_charges c
    WHERE c.tenant_id = p_tenant_id AND c.resource = p_resource AND c.refunded_at IS NULL;
    charged := used + p_amount <= quota_limit;
    IF charged THEN
        INSERT INTO quota_charges (reservation_id, tenant_id, resource, amount)
        VALUES (p_reservation_id, p_tenant_id, p_resource, p_amount)
        ON CONFLICT (reservation_id, resource) DO UPDATE
            SET amount = EXCLUDED.amount, charged_at = now(), refunded_at = NULL;
    END IF;
END $$;
