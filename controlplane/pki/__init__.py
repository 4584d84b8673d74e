"""The node PKI: a control-plane CA kept in PostgreSQL, one-time join tokens, short-lived node
certificates and their revocation, and the check of node-signed (attested) reports.

Key types (checked against grpcio's BoringSSL): gRPC Python servers neither offer nor accept
Ed25519 in the TLS handshake (NO_COMMON_SIGNATURE_ALGORITHMS), so every TLS key (the nodes' and
the gateways') is ECDSA P-256, and so is the CA's (accepted by every TLS stack). The report-signing
key stays Ed25519 (DESIGN §12): a node certificate carries it in an extension (`certs.SIGNING_KEY_OID`)
next to the TLS key, so one certificate names the node, its role, its TLS key and its signing key,
and its DER hash is the key id of the reports it signs. A certificate whose own key is Ed25519 (a
daemon on a TLS stack that accepts it) signs with that key and needs no extension.

Modules: `config` (settings), `certs` (pure X.509: CA, CSRs, issuing, parsing), `store` (the SQL),
`enrolment` (enrol, renew, gateway certificates), `admin` (the NodeAdmin domain), `attest` (the
report check).
"""

NODE = "node"
NODE_TENANT = "node-tenant"
GATEWAY = "gateway"
NODE_ROLES = frozenset({NODE, NODE_TENANT})
