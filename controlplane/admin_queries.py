"""The operator's SQL for tenants, identities, tokens, pools, offers and policies, in one
place (the nodes' statements live with the nodes)."""

INSERT_TENANT = "INSERT INTO tenants (id, name) VALUES (%(id)s, %(name)s) ON CONFLICT DO NOTHING"
TENANT = "SELECT id, name FROM tenants WHERE id = %(id)s"

INSERT_IDENTITY = """
INSERT INTO identities (id, kind, name, delegator_id, confirm_actions)
VALUES (%(id)s, %(kind)s, %(name)s, %(delegator_id)s, %(confirm_actions)s)
ON CONFLICT (id) DO NOTHING
"""
# An agent's person, held until the agent is written: an offboarding in progress (it locks the
# person's row) is waited for and seen, and one after it finds the new agent and disables it.
PERSON = "SELECT kind, offboarded_at FROM identities WHERE id = %(id)s FOR KEY SHARE"
INSERT_MEMBERSHIP = """
INSERT INTO memberships (tenant_id, identity_id) VALUES (%(tenant_id)s, %(identity_id)s)
ON CONFLICT DO NOTHING
"""
# A membership removed (controlplane.memberships): its rows locked, then deleted.
LOCK_MEMBERSHIPS = """
SELECT identity_id FROM memberships WHERE tenant_id = %(tenant_id)s AND identity_id = ANY(%(ids)s)
ORDER BY identity_id FOR UPDATE
"""
DELETE_MEMBERSHIPS = "DELETE FROM memberships WHERE tenant_id = %(tenant_id)s AND identity_id = ANY(%(ids)s)"
IDENTITY = """
SELECT i.*, coalesce(array_agg(m.tenant_id ORDER BY m.tenant_id)
                     FILTER (WHERE m.tenant_id IS NOT NULL), '{}') AS tenant_ids
FROM identities i LEFT JOIN memberships m ON m.identity_id = i.id
WHERE i.id = %(id)s GROUP BY i.id
"""


INSERT_POOL = """
INSERT INTO pools (id, owner_tenant_id, name, region, policy, request_hash)
VALUES (%(id)s, %(owner)s, %(name)s, %(region)s, %(policy)s, %(request_hash)s)
ON CONFLICT (id) DO NOTHING RETURNING id
"""
INSERT_OFFER = """
INSERT INTO pool_offers (pool_id, tenant_id) VALUES (%(pool_id)s, %(tenant_id)s) ON CONFLICT DO NOTHING
"""
DELETE_OFFER = "DELETE FROM pool_offers WHERE pool_id = %(pool_id)s AND tenant_id = %(tenant_id)s"
# Taken before the live grants are looked at: a grant being made on the offer (it holds the row
# FOR KEY SHARE, controlplane.vps.grants) is waited for and then seen, and one not yet made finds
# the offer gone.
LOCK_OFFER = "SELECT 1 FROM pool_offers WHERE pool_id = %(pool_id)s AND tenant_id = %(tenant_id)s FOR UPDATE"
POOL_FOR_OFFERS = "SELECT id, owner_tenant_id FROM pools WHERE id = %(pool_id)s FOR SHARE"
TENANT_EXISTS = "SELECT 1 FROM tenants WHERE id = %(tenant_id)s"
POOL_EXISTS = "SELECT 1 FROM pools WHERE id = %(pool_id)s"
# A grant commits slots of the pool to its tenant for its term: the offer stays while one is live.
LIVE_GRANT_ON_POOL = """
SELECT id FROM reservation_grants
WHERE pool_id = %(pool_id)s AND tenant_id = %(tenant_id)s AND state IN ('scheduled', 'active')
ORDER BY id LIMIT 1
"""
POOLS = """
SELECT p.*, coalesce(array_agg(o.tenant_id ORDER BY o.tenant_id) FILTER (WHERE o.tenant_id IS NOT NULL),
                     '{}') AS offered_to
FROM pools p LEFT JOIN pool_offers o ON o.pool_id = p.id
WHERE (%(id)s::text IS NULL OR p.id = %(id)s) AND (%(owner)s::text IS NULL OR p.owner_tenant_id = %(owner)s)
GROUP BY p.id ORDER BY p.created_at, p.id
"""

UPSERT_POLICY = """
INSERT INTO policies (tenant_id, cedar) VALUES (%(tenant_id)s, %(cedar)s)
ON CONFLICT (tenant_id) DO UPDATE SET cedar = EXCLUDED.cedar,
    version = policies.version + 1, updated_at = now()
RETURNING tenant_id, cedar, version
"""
