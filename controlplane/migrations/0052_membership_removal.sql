-- Removing an identity from one tenant (Admin.RemoveMembership, controlplane/memberships.py).
--
-- The caller lookup is per request and takes no lock, so a create authenticated just before its
-- identity was removed from the tenant may write its draft afterwards: a reservation in a tenant
-- its owner can no longer act in, which nobody would have reassigned. A new draft therefore needs
-- its owner's membership of the tenant, read under FOR KEY SHARE: the lock waits for a removal in
-- progress (which deletes the row) and then finds it gone; a draft that got in first is seen by
-- the removal, which waits for it on the row and moves or deletes it. Only drafts: every create
-- starts as one, and rows written in another state (tests, repairs by hand) are not creates.
-- Named to fire after reservations_owner_not_offboarded (triggers fire in name order), so an
-- offboarded owner is still refused as offboarded.
CREATE OR REPLACE FUNCTION reservations_owner_still_member() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM memberships
    WHERE tenant_id = NEW.tenant_id AND identity_id = NEW.owner_identity_id FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'identity % is not a member of tenant %', NEW.owner_identity_id, NEW.tenant_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'reservations_owner_still_member';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER reservations_owner_still_member BEFORE INSERT ON reservations
    FOR EACH ROW WHEN (NEW.state = 'draft') EXECUTE FUNCTION reservations_owner_still_member();

-- Whether an identity can act in a tenant now, as the caller lookup (controlplane.auth) decides
-- it at authentication: not offboarded, a member, and an agent only where its person is a member
-- (and not offboarded) too. A create's wait and a Watch stream ask it again before they answer,
-- so an identity removed from the tenant since its call authenticated is answered nothing more.
CREATE OR REPLACE FUNCTION can_act_in(p_identity text, p_tenant text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM identities i JOIN memberships m ON m.identity_id = i.id AND m.tenant_id = p_tenant
        WHERE i.id = p_identity AND i.offboarded_at IS NULL
          AND (i.delegator_id IS NULL OR EXISTS (
              SELECT 1 FROM memberships pm JOIN identities p ON p.id = pm.identity_id
              WHERE pm.identity_id = i.delegator_id AND pm.tenant_id = p_tenant AND p.offboarded_at IS NULL)))
$$;
