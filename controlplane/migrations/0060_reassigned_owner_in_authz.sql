-- A reservation handed to a successor (RemoveMembership, OffboardIdentity) kept its creator as the
-- owner IAM sees in authz_projection, which extend decides on: the successor was refused its own
-- reservation's extend under an owner-only policy, and the creator, added back, allowed it.
-- REASSIGN_OWNER now moves the stored owner with the row; this brings the rows moved before it
-- in step.
UPDATE authz_projection a
SET attributes = jsonb_set(a.attributes, '{ownerIdentityId}', to_jsonb(r.owner_identity_id))
FROM reservations r
WHERE r.id = a.reservation_id
  AND a.attributes ? 'ownerIdentityId'
  AND a.attributes->>'ownerIdentityId' IS DISTINCT FROM r.owner_identity_id;
