"""Hostile review, round 26p: the node PKI and attested reports, tried as a hostile node would.
Real PostgreSQL, real certificates from the control-plane CA, real Ed25519 signatures.

- **A key certified once was certified again.** The CA checked that a CSR proves its key, never
  that the key was new: a renewal or an enrolment could bring keys already certified, the node's
  own (a revoked certificate's too) or another node's (its CSR bundle, copied: the CSRs prove the
  keys, not who sends them). So a node revoked because its key was stolen, readmitted and enrolled
  again with the same keys gave the thief a live certificate for the stolen key, and every report
  the thief signed with it counted; and a report the node signed before its revocation counted
  again under the new certificate's key id. Now a key any certificate names is never certified
  again (INVALID_INPUT, the join token not spent); a lost enrolment's answer is still answered
  again, which issues nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from controlplane import errors
from controlplane.pki import admin, attest, enrolment
from controlplane.pki.config import PkiSettings
from tests.test_pki import (Enrolled, NodeKeys, _enrol_with, _identify, arun, bound_report, enrol, seed_pool,
                            sign, sql, verify)


def _renew(conninfo: str, by: Enrolled, keys: NodeKeys) -> enrolment.Issued:
    peer = _identify(conninfo, by.cert)

    async def work(pool: Any) -> enrolment.Issued:
        ca = await enrolment.load_ca(pool, PkiSettings())
        return await enrolment.renew(pool, ca, PkiSettings(), peer, keys.csr())

    return arun(conninfo, work)


def _token(conninfo: str, pool_id: str, name: str) -> str:
    return arun(conninfo, lambda pool: admin.create_join_token(pool, pool_id, name, "node", 600))["secret"]


# Keys certified again ----------------------------------------------------------------------------

def test_a_stolen_key_is_never_certified_again_after_the_nodes_revocation(database: str) -> None:
    """Attack: the node's keys are stolen; the operator revokes the node, readmits it and gives it a
    new join token; the daemon enrols again with the keys on its disk (the stolen ones). The thief's
    reports, signed with the stolen key and naming the new certificate's key id, must not count."""
    pool_id = seed_pool(database)
    node = enrol(database, pool_id, "gpu-01")
    arun(database, lambda pool: admin.revoke_certificates(pool, node.node_id, "", "keys stolen"))
    arun(database, lambda pool: admin.readmit_node(pool, node.node_id))
    token = _token(database, pool_id, "gpu-01")
    with pytest.raises(errors.InvalidInput, match="already certified"):
        _enrol_with(database, token, node.keys.csr())
    for mixed in (NodeKeys(tls=node.keys.tls), NodeKeys(signing=node.keys.signing)):  # one old key is enough
        with pytest.raises(errors.InvalidInput, match="already certified"):
            _enrol_with(database, token, mixed.csr())
    assert sql(database, "SELECT used_at FROM join_tokens WHERE node_id IS NULL") == [{"used_at": None}]
    fresh = NodeKeys()
    again = Enrolled(fresh, _enrol_with(database, token, fresh.csr()))  # new keys: enrolled
    assert again.node_id == node.node_id
    body = bound_report(node.node_id, "alloc_1")  # the thief, with the stolen key
    assert verify(database, "alloc_1", node.node_id, body, again.key_id, sign(node.keys.signing, body))[0] is False


def test_a_renewal_brings_new_keys_never_its_own_nor_another_nodes(database: str) -> None:
    """Attack: a renewal CSR carrying the keys of the node's current certificate, of its revoked
    one, or another node's CSR bundle (copied on its way to the gateway)."""
    pool_id = seed_pool(database)
    a, b = enrol(database, pool_id, "a"), enrol(database, pool_id, "b")
    for keys in (a.keys, b.keys):
        with pytest.raises(errors.InvalidInput, match="already certified"):
            _renew(database, a, keys)
    stranger = NodeKeys()  # a CSR bundle not certified yet, sent by two nodes: the first one gets it
    assert _renew(database, b, stranger).node_id == b.node_id
    with pytest.raises(errors.InvalidInput, match="already certified"):
        _renew(database, a, stranger)
    renewed = Enrolled(NodeKeys(), None)  # type: ignore[arg-type]
    renewed.issued = _renew(database, a, renewed.keys)
    assert renewed.node_id == a.node_id
    assert sql(database, "SELECT count(*) AS n FROM node_certs WHERE node_id = %s", (a.node_id,)) == [{"n": 4}]
    body = bound_report(a.node_id, "alloc_1")
    assert verify(database, "alloc_1", a.node_id, body, renewed.key_id, sign(renewed.keys.signing, body)) == (
        True, "")
    assert verify(database, "alloc_1", a.node_id, body, renewed.key_id, sign(a.keys.signing, body)) == (
        False, attest.BAD_SIGNATURE)
