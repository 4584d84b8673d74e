"""metal: whole-machine leases (binding "node", spec "Bindings" and "dedicated root").

A node lease books every bookable atom of one ready, platform-trusted node in a pool whose policy
sets tenantRoot. From the lease's start the node is metal's: the worker puts a deploy command (the
profile version's image and checksum) in the node's desired state, waits for the node's inventory
to report that profile version deployed, verifies it and marks the allocation bound, then the
reservation active. It has `metal_deploy_timeout_seconds` (2 hours) to do so and there is no
second placement: a failure or the deadline fails the reservation and refunds its quota. Once the
lease ends the node wipes the machine; the worker returns it to the platform when it sees the wipe.

While a tenant holds the machine (from the start until the wipe) the node's state is `leased`:
nothing else is placed on it, and its certificates carry the role `node-tenant` (the control plane
chooses the role at renewal, never the node).

Modules: `queries` (the SQL), `profiles` (the operator's profiles and versions), `request` (what a
create asks for), `placement` (whole machines for a window), `deploy` (the worker), `lifecycle`
(the reconciler's part).
"""

NODE = "node"


def is_node_lease(request: dict) -> bool:
    """A stored (normalised) request that leases whole machines."""
    return request.get("binding") == NODE
