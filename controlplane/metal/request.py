"""What a create asks of a node lease (spec "Bindings": node).

- `node { profileId, profileVersion? }` is required with binding "node" and refused with any other.
- A node lease cannot be spot, and books no host resources (the machine is the tenant's whole):
  `spot` and `resources` are refused naming the field, so the rule holds as those fields arrive.
- It takes whole machines: `devices[0].count` is the machine's GPU count (the quota charge), the
  model may be named, the topology must be any. With `gang` it takes `size` such machines sharing
  one value of `topologyKey` (spec 004), charged `size` times.
- In transaction 1 (before the draft is written): the pool's policy must set tenantRoot
  (INVALID_INPUT naming `binding`), and the profile version must exist (NOT_FOUND naming the
  profile); a request without profileVersion is pinned to the profile's newest version then.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import errors
from controlplane.common.names import match
from controlplane.metal import NODE, is_node_lease, queries
from controlplane.metal.profiles import MAX_VERSION, PROFILE_ID

ANY = "any"


def normalise(raw: dict[str, Any], request: dict[str, Any]) -> None:
    """Check the node-lease fields of a validated request and add `node` to it (only for a node
    lease, so no other request's hash changes)."""
    node = raw.get("node")
    if request["binding"] != NODE:
        if node is not None:
            raise errors.InvalidInput("node", "is only for binding 'node'")
        return
    if node is None:
        raise errors.InvalidInput("node", "binding 'node' needs node.profileId")
    profile_id = match("node.profileId", node.get("profile_id") or "", PROFILE_ID)
    version = node.get("profile_version")
    if version is not None and not 1 <= version <= MAX_VERSION:
        raise errors.InvalidInput("node.profileVersion", f"must be 1 to {MAX_VERSION}")
    if raw.get("spot"):
        raise errors.InvalidInput("spot", "a node lease cannot be spot")
    if raw.get("resources"):
        raise errors.InvalidInput("resources", "a node lease takes whole machines: it books no host-resource limits")
    if request["devices"][0]["topology"] != ANY:
        raise errors.InvalidInput("devices[0].topology", "a node lease takes whole machines: use any")
    request["node"] = {"profileId": profile_id, "profileVersion": version}


async def check_create(conn: AsyncConnection, request: dict[str, Any], pool: dict[str, Any]) -> None:
    """In transaction 1, before the draft: the pool allows node leases and the profile version
    exists; an unnamed version is resolved to the newest and stored."""
    if not is_node_lease(request):
        return
    if not (pool.get("policy") or {}).get("tenantRoot"):
        raise errors.InvalidInput("binding", "'node' needs a pool whose policy sets tenantRoot", poolId=pool["id"])
    node = request["node"]
    found = await (await conn.execute(queries.RESOLVE_VERSION, {
        "id": node["profileId"], "version": node["profileVersion"]})).fetchone()
    if found is None:
        field = "node.profileVersion" if node["profileVersion"] is not None else "node.profileId"
        raise errors.NotFound("no such node profile version" if node["profileVersion"] is not None
                              else "no such node profile (or it has no version)",
                              field=field, profileId=node["profileId"], profileVersion=node["profileVersion"])
    node["profileVersion"] = found["version"]
