"""The deploy workflow: from a node lease's start to an active reservation, and the machine's way
back to the platform after it.

`begin` (the reconciler, at the start, holding the pool lock and the reservation row): the
allocation moves to binding with the deadline, the node becomes its tenant's (`leased`), the
deploy (the pinned profile version's image and checksum) is written, and the node's desired state
gains an assignment with BINDING_NODE and the deploy.

`handle` (the work queue's `metal` kind, subject: a node id; woken at the start, at the deadline
and whenever a leased node's reported disk changes) judges what the node's inventory says:
- the asked profile version deployed for this allocation, with the asked checksum: the allocation
  is bound (no signed report: node leases are exempt from attested bindings, the worker verified
  the machine) and the reservation active;
- the deploy failed, or deployed with another checksum (also reservation.binding-rejected): the
  reservation fails (no second placement) and its quota is refunded;
- a profile it was not asked for: rejected (reservation.binding-rejected), never bound;
- nothing good by the deadline: the reservation fails with deploy-timeout.
Once no lease of the node is live and the node reports the last lease's machine wiped, the node
returns to the platform in the state it had.
"""

from __future__ import annotations

from typing import Any

import structlog
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from controlplane import db, events
from controlplane.common.locks import pool_lock
from controlplane.metal import queries
from controlplane.nodes import desired, tenancy
from controlplane.pki import store as pki_store
from controlplane.reservations import queries as rq
from controlplane.reservations import schedule, states
from controlplane.reservations.lifecycle import free_capacity
from controlplane.reservations.transitions import move
from controlplane.runtime import Runtime

log = structlog.get_logger(__name__)

TIMEOUT = "deploy-timeout"
FAILED = "deploy-failed"
CHECKSUM_MISMATCH = "deploy-checksum-mismatch"
NOT_ASKED = "deployed profile not asked for"
PROFILE_GONE = "deploy-profile-missing"
EXPOSED = "on the machine while a tenant leased it"


async def begin(conn: AsyncConnection, rt: Runtime, row: dict[str, Any], now_ms: int) -> None:
    """At the start (the pool lock and the row lock held): every allocation (one machine, or each
    machine of a gang) gets its deploy; the reservation moves to binding, and is active once every
    machine is deployed (`_bound`)."""
    timeout_ms = int(rt.settings.metal_deploy_timeout_seconds * 1000)
    deadline = row["during_start"] + timeout_ms
    if deadline <= now_ms:  # the worker itself ran late: the node still gets its full time
        deadline = now_ms + timeout_ms
    node = row["request"]["node"]
    version = {"id": node["profileId"], "version": node["profileVersion"]}
    if await (await conn.execute(queries.VERSION, version)).fetchone() is None:  # removed by hand since create
        await fail(conn, row, {"allocation_id": "", "node_id": None}, PROFILE_GONE)
        return
    started = await conn.execute(queries.START_ALLOCATIONS, {"id": row["id"], "deadline": deadline})
    allocations = await started.fetchall()
    for alloc in allocations:
        before = await tenancy.lease(conn, alloc["node_id"])
        await conn.execute(queries.INSERT_DEPLOY, {
            "allocation_id": alloc["id"], "reservation_id": row["id"], "node_id": alloc["node_id"],
            "profile_id": node["profileId"], "version": node["profileVersion"], "deadline": deadline,
            "before": before})
        await desired.bump(conn, alloc["node_id"])
        for at in (now_ms, deadline):
            await conn.execute(queries.WAKE, {"node_id": alloc["node_id"], "at": at})
    await move(conn, row, states.BINDING, operation_state="succeeded")
    await events.emit_reservation(conn, row, "reservation.binding", deadline=deadline,
                                  profileId=node["profileId"], profileVersion=node["profileVersion"])
    log.info("node lease deploying", reservation_id=row["id"], nodes=[a["node_id"] for a in allocations],
             profile=node["profileId"], version=node["profileVersion"], deadline=deadline)


async def nudge(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """The reconciler woke a deploying reservation: the worker looks at its nodes now."""
    await conn.execute(queries.WAKE_LIVE_OF, {"id": row["id"]})


async def handle(conn: AsyncConnection, rt: Runtime, node_id: str) -> None:
    """The `metal` work item of one node. Lock order: pool, reservation, allocation, node."""
    node = await (await conn.execute(queries.NODE_POOL, {"node_id": node_id})).fetchone()
    if node is None:
        return
    await pool_lock(conn, node["pool_id"])
    now_ms = await db.now_ms(conn)
    deploy = await (await conn.execute(queries.LIVE_DEPLOY, {"node_id": node_id})).fetchone()
    if deploy is not None:
        await _progress(conn, deploy, now_ms)
    await _back_to_platform(conn, node_id)


async def _progress(conn: AsyncConnection, deploy: dict[str, Any], now_ms: int) -> None:
    row = await (await conn.execute(rq.BY_ID_FOR_UPDATE, {"id": deploy["reservation_id"]})).fetchone()
    if (deploy["deployed"] or {}).get("allocation_id") == deploy["allocation_id"]:
        await conn.execute(queries.MARK_REPORTED, {"id": deploy["allocation_id"]})
    alloc = await (await conn.execute(queries.ALLOCATION_FOR_UPDATE, {"id": deploy["allocation_id"]})).fetchone()
    if row is None or row["state"] != states.BINDING or alloc is None or alloc["state"] != "binding":
        await _finish(conn, deploy, "ended", "the lease ended before the deploy finished")
        return
    verdict, reason = judge(deploy, deploy["deployed"])
    if verdict == "bound":
        await _bound(conn, row, deploy, now_ms)
        return
    if verdict == "rejected" or reason.startswith(CHECKSUM_MISMATCH):  # what the node said does not count
        await events.emit_reservation(conn, row, "reservation.binding-rejected", allocationId=deploy["allocation_id"],
                                      nodeId=deploy["node_id"], reason=reason)
    if verdict == "failed":
        await fail(conn, row, deploy, reason)
    elif now_ms >= deploy["deadline_ms"]:
        await fail(conn, row, deploy, TIMEOUT)


def judge(deploy: dict[str, Any], deployed: dict[str, Any] | None) -> tuple[str, str]:
    """What the node's reported disk means for this deploy: ("bound" | "failed" | "rejected" |
    "waiting", reason). Only this allocation's deploy of the asked version with the asked
    checksum binds; a node cannot bind a lease by naming another profile or checksum."""
    if not deployed or deployed.get("state") not in ("deployed", "failed"):
        return "waiting", ""
    asked = (deploy["allocation_id"], deploy["profile_id"], deploy["version"])
    said = (deployed.get("allocation_id"), deployed.get("profile_id"), deployed.get("version"))
    if said != asked:
        if deployed.get("allocation_id") not in (deploy["allocation_id"], ""):
            return "waiting", ""  # a previous lease's disk, before this deploy began
        return "rejected", f"{NOT_ASKED}: {said[1] or '?'} v{said[2]} (asked {asked[1]} v{asked[2]})"
    if deployed["state"] == "failed":
        return "failed", f"{FAILED}: {deployed.get('message') or 'the node reported the reimage failed'}"
    if deployed.get("checksum") != deploy["checksum"]:
        return "failed", f"{CHECKSUM_MISMATCH}: the node wrote {deployed.get('checksum') or 'an unreadable checksum'}"
    return "bound", ""


async def _bound(conn: AsyncConnection, row: dict[str, Any], deploy: dict[str, Any], now_ms: int) -> None:
    binding = {"cdiDevices": [], "envFile": "", "cgroupParent": "", "attested": False,
               "deployed": {"profileId": deploy["profile_id"], "version": deploy["version"],
                            "checksum": deploy["checksum"]}}
    await conn.execute(queries.MARK_BOUND, {"id": deploy["allocation_id"], "binding": Jsonb(binding)})
    await _finish(conn, deploy, "deployed", None)
    log.info("node lease deployed", reservation_id=row["id"], node_id=deploy["node_id"],
             allocation_id=deploy["allocation_id"])
    if (await (await conn.execute(queries.ALL_LIVE_BOUND, {"id": row["id"]})).fetchone())["all_bound"]:
        await move(conn, row, states.ACTIVE, operation_state="succeeded")
        await events.emit_reservation(conn, row, "reservation.active")
        await schedule.at(conn, row["id"], now_ms + schedule.ACTIVE_RECHECK_MS)


async def fail(conn: AsyncConnection, row: dict[str, Any], deploy: dict[str, Any], reason: str) -> None:
    """No second placement: the reservation fails, its bookings end, its quota is refunded, and
    the node's desired state drops the assignment (the node then wipes the machine). The other
    machines of a gang are looked at now: their deploys end and they wipe too."""
    await _finish(conn, deploy, "failed", reason)
    await free_capacity(conn, row, allocation_state="failed")  # wakes the other members' deploys too
    await move(conn, row, states.FAILED, operation_state="failed", end_reason=reason)
    await events.emit_reservation(conn, row, "reservation.failed", reason=reason, nodeId=deploy["node_id"])
    log.info("node lease failed", reservation_id=row["id"], node_id=deploy["node_id"], reason=reason)


async def _finish(conn: AsyncConnection, deploy: dict[str, Any], state: str, reason: str | None) -> None:
    await conn.execute(queries.FINISH_DEPLOY, {"id": deploy["allocation_id"], "state": state, "reason": reason})


async def _back_to_platform(conn: AsyncConnection, node_id: str) -> None:
    """A leased node whose leases are over returns to the platform once it reports the last
    lease's machine wiped, or at once when it never reported that lease's deploy. A wiped one has
    every certificate revoked (the platform ones it had before the lease and the node-tenant ones
    of the lease were all on a machine a tenant had root on): it serves again once it enrolled
    again, with a join token that reached the re-imaged machine by a path the tenant never had."""
    after = await (await conn.execute(queries.AFTER_LEASE, {"node_id": node_id})).fetchone()
    if after is None:
        return
    deployed = after["deployed"] or {}
    wiped = deployed.get("state") == "wiped" and deployed.get("allocation_id") == after["allocation_id"]
    # A node that never reported this lease's deploy (unreachable throughout) never ran it: its
    # disk still says what it said before, so it has nothing of the tenant's to wipe.
    untouched = not after["reported"] and deployed.get("allocation_id") != after["allocation_id"]
    if not (wiped or untouched):
        return
    if await tenancy.unlease(conn, node_id, after["node_state_before"]):
        await conn.execute(queries.MARK_WIPED, {"id": after["allocation_id"]})
        revoked: list[str] = []
        if wiped:  # the tenant had root on the machine: every key the node held may be the tenant's,
            revoked = await pki_store.revoke(conn, node_id=node_id, reason=EXPOSED)
            await tenancy.forget_tenants_word(conn, node_id)  # and so was what its inventory says
        log.info("node wiped and back to the platform", node_id=node_id, allocation_id=after["allocation_id"],
                 revoked=revoked)
