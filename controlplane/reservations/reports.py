"""Judging node reports: the gateway stored them exactly as received; the reservation worker
decides what they mean, and is the only writer of the evidence (allocations.bound_report,
bound_sig_kid, bound_sig: the bytes of the report that made the binding).

- AllocationBound counts only when the attestation check passes (with attested bindings on, the
  default) and it names exactly the allocation's devices: the binding then comes from the signed
  report, marked attested. A report that fails
  the check never counts and publishes reservation.binding-rejected; a forged re-report of a
  bound allocation marks the binding lost.
- A replay never counts: a report about an allocation must be newer (Report.sequence) than every
  report accepted about it from the same signing key, or from another of the node's certificates
  not revoked (the node's sequence runs across renewals). It is rejected and changes nothing else.
  (The gateway drops replays on arrival, in the node's order; this holds whoever stored them.)
- AllocationFailed (checked the same way) is a binding failure: re-placed, at most twice.
- AllocationReleased of a bound allocation: Degraded with BindingLost until it is bound again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from bettercompute.node.v1 import node_pb2
from controlplane import events
from controlplane.nodes import reports as stored_reports
from controlplane.metal import is_node_lease
from controlplane.pki import attest
from controlplane.pki.config import PkiSettings
from controlplane.reservations import binding_queries
from controlplane.reservations.transitions import condition, set_conditions

# Node leases are exempt from attested bindings (spec): the metal worker binds them after it
# verified the deploy, so a node's reports about them never count.
NODE_LEASE = "a node lease is bound by its deploy workflow, not by node reports"
NOT_ALLOCATED = "the report names devices that are not the allocation's"
CDI_VENDOR = "bcd.dev"
from controlplane.runtime import Runtime



@dataclass
class Judged:
    """What judging found: how many reports it judged, and the (node id, reason) of each verified
    AllocationFailed, for the caller's failure path."""
    count: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)


async def judge(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], now_ms: int) -> Judged:
    """Judge every unjudged report of the reservation's live allocations, oldest first."""
    failures: list[tuple[str, str]] = []
    pki = PkiSettings()
    node_lease = is_node_lease(row["request"])
    unjudged = await stored_reports.unjudged(conn, row["id"])
    rebound = False  # an allocation's binding changed: the reservation's version moves once for all
    for rep in unjudged:
        if node_lease:  # metal binds whole-machine leases; a node's report never does
            ok, reason, report = False, NODE_LEASE, None
        else:
            ok, reason, report = await _check(conn, rt, pki, rep)
        if ok and rep["kind"] == "bound" and not _names_the_allocations_devices(report, rep, row):
            ok, reason = False, NOT_ALLOCATED
        if ok and await _replayed(conn, rep, report):
            ok, reason = False, attest.REPLAYED
        await stored_reports.record_verdict(conn, rep["id"], "accepted" if ok else f"rejected: {reason}",
                                          report.sequence if ok else None)
        rt.metrics.report_judged(ok, reason)
        if not ok:
            await events.emit_reservation(conn, row, "reservation.binding-rejected",
                                          allocationId=rep["allocation_id"], nodeId=rep["node_id"], reason=reason)
            lost = reason not in (attest.REPLAYED, NODE_LEASE)
            if rep["kind"] == "bound" and rep["allocation_state"] == "bound" and lost:
                await _binding_lost(conn, row, rep, f"a re-report failed the check: {reason}", now_ms)
            continue
        if rep["kind"] == "bound":
            marked = await (await conn.execute(binding_queries.MARK_BOUND, {
                "id": rep["allocation_id"], "binding": Jsonb(_binding(rep, report, rt, row)),
                "body": rep["body"], "kid": rep["key_id"], "sig": rep["signature"]})).fetchone()
            rebound = rebound or bool(marked and marked["changed"])
            rep["allocation_state"] = "bound"
        elif rep["kind"] == "failed":
            failures.append((rep["node_id"], report.failed.reason or "allocation-failed"))
        elif rep["kind"] == "released" and rep["allocation_state"] == "bound":
            await _binding_lost(conn, row, rep, "the node released the devices", now_ms)
    await _clear_binding_lost_when_all_bound(conn, row)
    if rebound:  # every write bumps version (DESIGN.md section 10): a node's re-report too
        await conn.execute(binding_queries.BUMP_VERSION, {"id": row["id"]})
    if unjudged:  # only what judging needs stays (storage bounded whatever the node sends)
        await stored_reports.prune_judged(conn, row["id"])
    return Judged(len(unjudged), failures)


async def _check(conn: AsyncConnection, rt: Runtime, pki: PkiSettings, rep: dict[str, Any]):
    if rep["reporter"] != rep["node_id"]:  # the gateway already drops these; never trust it alone
        return False, attest.OTHER_NODE, None
    if rt.settings.attested_bindings or rep["kind"] != "bound":
        return await attest.verify_report(
            conn, rep["allocation_id"], rep["node_id"], rep["body"], rep["key_id"], rep["signature"],
            pki.offline_grace, kind=rep["kind"], roles=pki.workload_roles, clock_skew=pki.report_clock_skew)
    report = node_pb2.Report()  # attested bindings off: the gateway's word, for this allocation only
    try:
        report.ParseFromString(bytes(rep["body"]))
    except DecodeError:
        return False, attest.NOT_THIS_BOUND, None
    if report.WhichOneof("event") != "bound" or report.bound.allocation_id != rep["allocation_id"]:
        return False, attest.NOT_THIS_BOUND, None
    return True, "", report


def _names_the_allocations_devices(report: node_pb2.Report, rep: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether the bound report names exactly the allocation's devices, as bcd names them in the
    CDI spec (`bcd.dev/<class>=<device id>`, DESIGN.md section 11): the binding `get` answers is
    what the workload runs with, so a node must not point it at another allocation's GPUs."""
    device_class = row["request"]["devices"][0].get("class") or "gpu"
    allocated = {f"{CDI_VENDOR}/{device_class}={d}" for d in rep["device_ids"]}
    named = list(report.bound.cdi_devices)
    return len(named) == len(allocated) and set(named) == allocated


async def _replayed(conn: AsyncConnection, rep: dict[str, Any], report: node_pb2.Report) -> bool:
    last = await stored_reports.last_accepted_sequence(conn, rep["allocation_id"], rep["key_id"])
    return last is not None and report.sequence <= last


def _binding(rep: dict[str, Any], report: node_pb2.Report, rt: Runtime, row: dict[str, Any]) -> dict[str, Any]:
    """The binding as the node signed it. A cgroup parent counts only when it is exactly this
    allocation's slice, so a node cannot point a reservation at another allocation's slice; a
    kubernetes binding has none (its pods live in the kubelet's cgroups), nor has a hold without
    limits (it books no host resources, so bcd makes it no slice)."""
    own_slice = f"bcd-alloc-{rep['allocation_id']}.slice"
    kubernetes = row["request"].get("binding") == "kubernetes"
    limited = any((row["request"].get("resources") or {}).values())
    keep_slice = report.bound.cgroup_parent == own_slice and limited and not kubernetes
    return {
        "cdiDevices": list(report.bound.cdi_devices),
        "envFile": report.bound.env_file,
        "cgroupParent": report.bound.cgroup_parent if keep_slice else "",
        "attested": rt.settings.attested_bindings,
    }


async def _binding_lost(conn: AsyncConnection, row: dict[str, Any], rep: dict[str, Any], why: str, now_ms: int) -> None:
    await conn.execute(binding_queries.MARK_BINDING_LOST, {"id": rep["allocation_id"]})
    kept = [c for c in row["conditions"] if c.get("type") != "Degraded"]
    message = f"allocation {rep['allocation_id']} on {rep['node_id']}: {why}"
    await set_conditions(conn, row, [*kept, condition("Degraded", "BindingLost", message, now_ms)])


async def _clear_binding_lost_when_all_bound(conn: AsyncConnection, row: dict[str, Any]) -> None:
    if not any(c.get("type") == "Degraded" for c in row["conditions"]):
        return
    live = await (await conn.execute(binding_queries.ALL_LIVE_BOUND, {"id": row["id"]})).fetchone()
    if live["all_bound"]:
        await set_conditions(conn, row, [c for c in row["conditions"] if c.get("type") != "Degraded"])

