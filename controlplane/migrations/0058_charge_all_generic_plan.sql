-- charge_all's fit read (migration 0055) was planned again on every call: its rows come from
-- unnest() of the array arguments, which a custom plan counts (two resources per create) and a
-- generic plan guesses at ten, so the plan cache found every custom plan cheaper than the generic
-- one and never kept a plan. pg_stat_statements (track = all, track_planning) over a benchmark's
-- creates: 4,049 plans for 4,039 calls, 0.29 ms of planning against 0.05 of execution: about a
-- tenth of PostgreSQL's CPU per create. Both plans have the same shape (the quota rows of the
-- tenant, then the usage rows of each resource by the primary key), so the function's statements
-- take the generic plan, planned once per backend.
ALTER FUNCTION charge_all(text, text, text[], bigint[], bigint[], boolean[], text[])
    SET plan_cache_mode = force_generic_plan;
