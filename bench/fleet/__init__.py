"""`python -m bench.fleet`: a simulated fleet against one gateway, and placement-to-active latency.

What docs/benchmarks-fleet.md describes: an embedded PostgreSQL, the control plane, one node
gateway and `nodesim --sim N` as real processes on loopback (started by controlplane.devtools.devstack, as
`make dev` and the end-to-end tests start them). The tenant, pool, quota and policy are seeded
through the Admin API; the N nodes enrol with one-time join tokens and hold mutual-TLS sessions.
Measured: the time until all N are connected, the gateway's resident memory per session, the
time from `reservation.placed` to `reservation.active` of reservations that start now (node bind
and signed report included), and whether the fleet stayed healthy throughout.

    .venv/bin/python -m bench.fleet                 # 1,000 nodes, 300 reservations (a few minutes)
    .venv/bin/python -m bench.fleet --quick         # 50 nodes, 50 reservations (about 25 s)

The phases live in their own modules: options (flags and constants), start (database, control
plane, gateway, seed, enrolment), reserve (the creates and their latencies), report (the printed
figures), measure (process memory and CPU), main (one run, start to stop).
"""

import os

# As in controlplane.devtools.dev: gRPC's fork handlers are of no use here (this process forks only to
# run pg_ctl and the children) and must be off before grpc is imported; every module of this
# package is imported after this one.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
