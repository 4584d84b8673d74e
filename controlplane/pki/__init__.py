"""The node PKI: a control-plane CA kept in PostgreSQL, one-time join tokens, short-lived node
certificates and their revocation, and the check of node-signed (attested) reports.

Key types (checked against grpcio 1.85's BoringSSL): gRPC Python neither offers nor accepts
Ed25519 in the TLS handshake (NO_COMMON_SIGNATURE_ALGORITHMS), for client and server keys alike,
though it verifies Ed25519 signatures on certificates. So every TLS key (the nodes' and the
gateways') is ECDSA P-256, and so is the CA's (accepted by every TLS stack). The report-signing
key stays Ed25519 (DESIGN §12). A node therefore holds two certificates, issued together from one
CSR bundle: `signing` (Ed25519; the SHA-256 of its DER is the key id its reports carry) and `tls`
(ECDSA P-256, the mutual-TLS client certificate). Both name the node (CN) and its role (OU).

Modules: `config` (settings), `certs` (pure X.509: CA, CSRs, issuing, parsing), `store` (the SQL),
`enrolment` (enrol, renew, gateway certificates), `admin` (the NodeAdmin domain), `attest` (the
report check).
"""

NODE = "node"
NODE_TENANT = "node-tenant"
GATEWAY = "gateway"
NODE_ROLES = frozenset({NODE, NODE_TENANT})
