"""nodesim: the FakeDaemon.

`nodesim --sim N ...` runs N simulated GPU nodes in one asyncio process. Each is a real gRPC client
of the gateway's NodeGateway service with its own keys and certificates; it converges to the
desired state by writing CDI specs, env files and cgroup slices under its own root in a sandbox
directory, and reports every bind, failure and release as a node-signed AttestedReport.

It is a separate program (in production a Go daemon): it imports only the generated node protocol
code and its own modules, never `controlplane` or `gateway`. The importable API for tests is
`nodesim.fleet.Fleet` with `nodesim.config.parse_args`.
"""

DAEMON_VERSION = "nodesim-1.0.0"
# What a --no-capabilities node says it is: a daemon from before limits and kubernetes bindings.
LEGACY_DAEMON_VERSION = "nodesim-0.8.0"
