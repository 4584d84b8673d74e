-- charge_all (0028) in three statements instead of four per resource (issue 9: a create's CPU).
--
-- It called charge_quota once per resource (a create charges two: `gpu` and `gpu:<model>`), each
-- call a locked read of the limit row, a loop over the usage rows and an insert whose statement
-- trigger updated quota_usage. Now: the limit rows of every resource locked in one statement (in
-- resource order, as before: p_resources comes sorted), the fit of every resource decided in one
-- read, and every charge inserted in one statement (the usage trigger runs once). The answer is
-- the same: all or nothing, the first resource in order that does not fit raises BCQ01 with the
-- same DETAIL (`used` is the same reduced fraction divided out), BCQ02 unchanged.
--
-- Exact fractions as before: a resource's usage rows are amount/per with distinct `per`s, so with
-- P the product of those pers, used = sum(amount * (P / per)) / P in whole numbers; the charge
-- a/p fits when used * p + a * P <= limit * P * p (both sides times P * p).

CREATE AGGREGATE numeric_product(numeric) (SFUNC = numeric_mul, STYPE = numeric, INITCOND = '1');

CREATE OR REPLACE FUNCTION charge_all(
    p_tenant_id text, p_reservation_id text, p_resources text[], p_amounts bigint[], p_pers bigint[],
    p_lenient boolean[], p_unnamed_models text[]
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    limited record;
    refused record;
BEGIN
    IF cardinality(p_unnamed_models) > 0 THEN
        SELECT q.resource, q."limit" INTO limited FROM quotas q
        WHERE q.tenant_id = p_tenant_id AND q.resource = ANY(p_unnamed_models)
        ORDER BY q.resource LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'quota limits % and the request names no model', limited.resource
                USING ERRCODE = 'BCQ02',
                      DETAIL = jsonb_build_object('resource', limited.resource, 'limit', limited."limit")::text;
        END IF;
    END IF;
    IF coalesce(cardinality(p_resources), 0) = 0 THEN
        RETURN;
    END IF;
    -- The limit rows first (concurrent charges of the tenant decided one at a time), then the
    -- usage: it includes every charge committed by a transaction that held them.
    PERFORM 1 FROM quotas q
    WHERE q.tenant_id = p_tenant_id AND q.resource = ANY(p_resources)
    ORDER BY q.resource FOR UPDATE;
    SELECT c.resource, coalesce(q."limit", 0) AS quota_limit,
           div(u.scaled, gcd(u.scaled, u.pers)) / div(u.pers, gcd(u.scaled, u.pers)) AS used
    INTO refused
    FROM unnest(p_resources, p_amounts, p_pers, p_lenient) WITH ORDINALITY AS c(resource, amount, per, lenient, ord)
    LEFT JOIN quotas q ON q.tenant_id = p_tenant_id AND q.resource = c.resource
    CROSS JOIN LATERAL (
        SELECT p.pers, coalesce(sum(x.amount * div(p.pers, x.per)), 0) AS scaled
        FROM (SELECT numeric_product(y.per) AS pers FROM quota_usage y
              WHERE y.tenant_id = p_tenant_id AND y.resource = c.resource AND y.amount > 0) p
        LEFT JOIN quota_usage x ON x.tenant_id = p_tenant_id AND x.resource = c.resource AND x.amount > 0
        GROUP BY p.pers
    ) u
    WHERE NOT (q."limit" IS NULL AND c.lenient)
      AND u.scaled * c.per + c.amount::numeric * u.pers > coalesce(q."limit", 0)::numeric * u.pers * c.per
    ORDER BY c.ord
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'quota for % exceeded', refused.resource
            USING ERRCODE = 'BCQ01',
                  DETAIL = jsonb_build_object('resource', refused.resource, 'limit', refused.quota_limit,
                                              'used', refused.used::text)::text;
    END IF;
    INSERT INTO quota_charges (reservation_id, tenant_id, resource, amount, per)
    SELECT p_reservation_id, p_tenant_id, c.resource, c.amount, c.per
    FROM unnest(p_resources, p_amounts, p_pers) AS c(resource, amount, per)
    ORDER BY c.resource
    ON CONFLICT (reservation_id, resource) DO UPDATE
        SET amount = EXCLUDED.amount, per = EXCLUDED.per, charged_at = now(), refunded_at = NULL;
END $$;
