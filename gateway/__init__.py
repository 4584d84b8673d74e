"""The node gateway: the node gRPC endpoint (bettercompute.node.v1.NodeGateway).

Nodes enrol with a one-time join token over server-authenticated TLS, then hold one session
(a bidirectional stream over mutual TLS) through which the gateway pushes their desired state
and receives their hello, heartbeats, inventory and node-signed reports. All state is in
PostgreSQL; any number of gateways may run, and a node's newest session wins.

Two listeners, one server: grpc Python's TLS either requires a client certificate or never asks
for one (it cannot ask for an optional one), so `--listen` is mutual TLS (Session, Renew) and
`--enrol-listen` is server-only TLS (Enrol). Session and Renew still check the peer certificate on
every call and answer UNAUTHENTICATED without a valid one, whichever port they arrive on.
"""
