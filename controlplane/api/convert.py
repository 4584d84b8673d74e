"""Conversions between protobuf messages and the plain dicts the domain speaks."""

from __future__ import annotations

from typing import Any

from bettercompute.v1 import admin_pb2, reservations_pb2 as pb
from controlplane.durations import format_duration_ms


def create_input(m: pb.CreateReservationRequest) -> dict[str, Any]:
    which = m.WhichOneof("duration_spec")
    return {
        "tenant_id": m.tenant_id,
        "pool_id": m.pool_id,
        "devices": [
            {"class": d.device_class, "count": d.count, "topology": d.topology, "model": d.model,
             "profile": d.profile}
            for d in m.devices
        ],
        "duration": m.duration if which == "duration" else None,
        "duration_ms": m.duration_ms if which == "duration_ms" else None,
        "start": m.start if m.HasField("start") else None,
        "binding": m.binding,
        "idempotency_key": m.idempotency_key,
        "wait_timeout_ms": m.wait.timeout_ms if m.HasField("wait") else None,
        "lease_seconds": m.lease_seconds if m.HasField("lease_seconds") else None,
        "node_selector": dict(m.node_selector),
        "resources": host_resources_input(m.resources) if m.HasField("resources") else None,
        "node": _node_lease(m.node) if m.HasField("node") else None,
        "gang": {"size": m.gang.size, "topology_key": m.gang.topology_key} if m.HasField("gang") else None,
        "spot": m.spot,
        "start_earliest": m.start_earliest,
        "horizon_ms": m.horizon_ms if m.HasField("horizon_ms") else None,
    }


def host_resources_input(m: pb.HostResources) -> dict[str, int | None]:
    return {"vcpu": m.vcpu if m.HasField("vcpu") else None,
            "memoryGiB": m.memory_gib if m.HasField("memory_gib") else None,
            "hugepages1Gi": m.hugepages_1gi if m.HasField("hugepages_1gi") else None}


def allocation_resources(limits: dict[str, Any] | None) -> pb.HostResources | None:
    """What an allocation booked on its node, from its limits (None: a hold that books none)."""
    if not limits:
        return None
    return resources_message({"vcpu": limits.get("vcpu", 0), "memoryGiB": limits.get("memoryGiB", 0),
                              "hugepages1Gi": limits.get("hugepages_1gi", 0)})


def resources_message(raw: dict[str, Any] | None) -> pb.HostResources:
    raw = raw or {}
    return pb.HostResources(vcpu=raw.get("vcpu"), memory_gib=raw.get("memoryGiB"),
                            hugepages_1gi=raw.get("hugepages1Gi"))


def _node_lease(n: pb.NodeLease) -> dict[str, Any]:
    return {"profile_id": n.profile_id, "profile_version": n.profile_version if n.HasField("profile_version") else None}


def list_input(m: pb.ListReservationsRequest) -> dict[str, Any]:
    return {"tenant_id": m.tenant_id, "scope": m.scope, "states": list(m.states), "pool_id": m.pool_id,
            "limit": m.limit, "cursor": m.cursor}


def reservation(row: dict[str, Any]) -> pb.Reservation:
    request = row["request"]
    out = pb.Reservation(
        id=row["id"],
        tenant_id=row["tenant_id"],
        pool_id=row["pool_id"],
        state=row["state"],
        request=pb.StoredRequest(
            pool_id=request["poolId"],
            devices=[
                pb.DeviceRequest(device_class=d["class"], count=d["count"], topology=d["topology"],
                                 model=d.get("model") or "", profile=d.get("profile") or "")
                for d in request["devices"]
            ],
            duration=format_duration_ms(request["durationMs"]),
            binding=request["binding"],
            start=request.get("start"),
            lease_seconds=request.get("leaseSeconds"),
            node_selector=request.get("nodeSelector") or {},
            resources=resources_message(request.get("resources")) if request.get("resources") is not None else None,
            node=_stored_node_lease(request.get("node")),
            gang=pb.Gang(size=request["gang"]["size"], topology_key=request["gang"]["topologyKey"])
            if request.get("gang") else None,
            spot=bool(request.get("spot")),
            start_earliest=bool(request.get("startEarliest")),
            horizon_ms=request.get("horizonMs"),
        ),
        owner_identity_id=row["owner_identity_id"],
        idempotency_key=row["idempotency_key"],
        conditions=[
            pb.Condition(type=c["type"], status=c.get("status", "True"), reason=c.get("reason", ""),
                         message=c.get("message", ""), last_transition_time=c.get("lastTransitionTime", 0))
            for c in row["conditions"]
        ],
        operation=pb.Operation(id=row["id"], state=row["operation_state"]),
        version=row["version"],
        lease_deadline=row.get("lease_deadline_ms"),
        created_at=row["created_ms"],
        updated_at=row["updated_ms"],
        spot=bool(request.get("spot")),
    )
    if row.get("host_share") is not None:
        out.host_share.CopyFrom(resources_message(row["host_share"]))
    if row.get("during_start") is not None:
        out.during.CopyFrom(pb.Interval(start=row["during_start"], end=row["during_end"]))
    for alloc in row.get("allocations", []):
        out.allocations.append(
            pb.Allocation(id=alloc["id"], node_id=alloc["node_id"], device_ids=alloc["device_ids"],
                          state=alloc["state"],
                          resources=allocation_resources(alloc.get("limits")))
        )
    bound = sorted((a for a in row.get("allocations", []) if a["state"] == "bound" and a["binding"]),
                   key=lambda a: a["id"])
    if bound:
        b = bound[0]["binding"]
        out.binding.CopyFrom(pb.HoldBinding(
            node_id=bound[0]["node_id"], cdi_devices=b.get("cdiDevices", []), env_file=b.get("envFile", ""),
            cgroup_parent=b.get("cgroupParent", ""), attested=bool(b.get("attested")),
        ))
    return out


def _stored_node_lease(node: dict[str, Any] | None) -> pb.NodeLease | None:
    if not node:
        return None
    return pb.NodeLease(profile_id=node["profileId"], profile_version=node.get("profileVersion"))


def confirmation(row: dict[str, Any]) -> pb.Confirmation:
    return pb.Confirmation(
        id=row["id"], tenant_id=row["tenant_id"], reservation_id=row["reservation_id"], action=row["action"],
        agent_identity_id=row["agent_identity_id"], person_identity_id=row["person_identity_id"],
        state="expired" if row["past_deadline"] and (row["state"] == "pending" or (
            row["state"] == "approved" and row["until_ms"] is not None)) else row["state"],
        expires_at=row["expires_ms"], until=row["until_ms"],
    )


def pool(row: dict[str, Any]) -> admin_pb2.Pool:
    policy = row["policy"]
    sharing = policy.get("sharing", {})
    return admin_pb2.Pool(
        id=row["id"], owner_tenant_id=row["owner_tenant_id"], name=row["name"], region=row["region"],
        policy=admin_pb2.PoolPolicy(
            sharing=admin_pb2.SharingPolicy(mode=sharing.get("mode", ""), replicas=sharing.get("replicas", 0)),
            kubernetes=policy.get("kubernetes", False), tenant_root=policy.get("tenantRoot", False),
            placer=policy.get("placer", "inline"),
            per_gpu=admin_pb2.PerGpuShare(vcpu=policy["perGpu"].get("vcpu"), memory_gib=policy["perGpu"].get("memoryGiB"))
            if policy.get("perGpu") else None,
            host_reserve=admin_pb2.HostReserve(vcpu=policy["hostReserve"].get("vcpu"))
            if policy.get("hostReserve") else None,
            spot_notice_seconds=(policy.get("spot") or {}).get("noticeSeconds", 0),
        ),
        offered_to=row["offered_to"],
    )


def node(row: dict[str, Any]) -> admin_pb2.Node:
    return admin_pb2.Node(
        id=row["id"], pool_id=row["pool_id"], name=row["name"], state=row["state"],
        connectivity=row["connectivity"], gpu_count=row["gpu_count"],
        labels={k: v["value"] for k, v in row["labels"].items()},
        refused_gpus=[admin_pb2.RefusedGpu(uuid=g["uuid"], reason=g["reason"], held_by_node_id=g["heldBy"])
                      for g in (row.get("inventory") or {}).get("refused_gpus", [])],
    )


def identity(row: dict[str, Any]) -> admin_pb2.Identity:
    out = admin_pb2.Identity(id=row["id"], kind=row["kind"], name=row["name"], tenant_ids=row["tenant_ids"])
    if row["delegator_id"]:
        out.delegation.CopyFrom(admin_pb2.Delegation(person_identity_id=row["delegator_id"],
                                                     confirm_actions=row["confirm_actions"]))
    return out


def node_profile(row: dict[str, Any]) -> admin_pb2.NodeProfile:
    return admin_pb2.NodeProfile(
        id=row["id"], description=row["description"], created_at=row["created_ms"],
        versions=[admin_pb2.NodeProfileVersion(version=v["version"], image=v["image"], checksum=v["checksum"],
                                               created_at=v["created_ms"]) for v in row["versions"]])
