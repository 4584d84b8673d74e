"""The kubernetes binding (spec "Bindings"): a hold whose devices the node hands to its kubelet.

- Only in a pool with policy.kubernetes, and only for the pool's owner tenant: the kubelet gives
  bound GPUs to any pod of the cluster, so a tenant the pool is merely offered to books holds.
- Only on nodes whose daemon advertises binding.kubernetes: the system label written from Hello's
  capabilities. An operator label of the same name does not count, so the requirement names the
  label's source too (nodes.labels holds {"value", "source"} per key).
"""

from __future__ import annotations

from typing import Any

from controlplane import errors
from controlplane.nodes.inventory import CAP_PREFIX, SYSTEM

KUBERNETES = "kubernetes"
CAPABILITY = "binding.kubernetes"
CAPABILITY_LABEL = CAP_PREFIX + CAPABILITY


def check_pool(request: dict[str, Any], pool: dict[str, Any], tenant_id: str) -> None:
    """INVALID_INPUT naming `binding` when a kubernetes binding cannot be booked in this pool."""
    if request.get("binding") != KUBERNETES:
        return
    if not (pool.get("policy") or {}).get("kubernetes"):
        raise errors.InvalidInput("binding", "'kubernetes' needs a pool whose policy sets kubernetes",
                                  poolId=pool["id"])
    if pool["owner_tenant_id"] != tenant_id:
        raise errors.InvalidInput("binding", "'kubernetes' is booked only by the pool's owner tenant; "
                                  "a tenant the pool is offered to books holds", poolId=pool["id"])


def required_labels(request: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Node labels the placement requires beyond the request's selector, as JSON containment."""
    if request.get("binding") != KUBERNETES:
        return {}
    return {CAPABILITY_LABEL: {"value": "true", "source": SYSTEM}}
