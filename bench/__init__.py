"""The benchmark behind `make bench`: control-plane creates/s against two local baselines.

One run starts an embedded PostgreSQL in a temp dir, the control plane (a subprocess by default),
seeds a pool through the Admin API, drives Reservations.Create over loopback gRPC, and measures a
trivial gRPC echo and a raw-SQL three-transaction write path with the same concurrency, so the
figures can be compared across machines. See docs/benchmarks.md.
"""
