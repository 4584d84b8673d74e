"""A node's desired state: its generation, bumped whenever its allocations change (which tells
the gateways holding its sessions to push it, on `bc_node_desired`), and every allocation it
should hold now (binding or bound, with a booking that ends after compute_now()), read in one
statement (one snapshot) so a generation is never sent with assignments older than it."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from bettercompute.node.v1 import node_pb2
from controlplane import db
from controlplane.nodes import hosts, queries

# Sent by the SQL function bump_desired (controlplane/migrations/0002_work_queue.sql).
DESIRED_CHANNEL = "bc_node_desired"

_BINDINGS = {"kubernetes": node_pb2.BINDING_KUBERNETES, "node": node_pb2.BINDING_NODE}


async def bump(conn: AsyncConnection, node_id: str) -> None:
    """The node's desired state changed (its sessions push it once the caller commits)."""
    await conn.execute(queries.BUMP_DESIRED, {"node_id": node_id})


async def bump_live_of(conn: AsyncConnection, reservation_id: str) -> None:
    """Bump every node holding a live (binding or bound) allocation of the reservation."""
    await conn.execute(queries.BUMP_DESIRED_OF_LIVE, {"id": reservation_id})


def _limits(raw: dict[str, Any], cpuset: tuple[str, str] = ("", "")) -> node_pb2.Limits:
    return node_pb2.Limits(
        cpu_millis=int(raw.get("cpu_millis") or 0), memory_bytes=int(raw.get("memory_bytes") or 0),
        hugepages_1gi=int(raw.get("hugepages_1gi") or 0), cpus=str(raw.get("cpus") or cpuset[0]),
        mems=str(raw.get("mems") or cpuset[1]))


def assignment(row: dict[str, Any], facts: hosts.NumaFacts | None = None) -> node_pb2.DeviceAssignment:
    """The assignment of an allocation row; with the node's NUMA facts (from DESIRED_STATE's
    pin_inventory and pin_reserve), a hold booking host resources is pinned to the CPUs and memory
    of its devices' NUMA nodes."""
    raw = row["limits"] or {}
    cpuset = ("", "")
    if facts is not None and (raw.get("vcpu") or raw.get("memoryGiB")):
        cpuset = hosts.cpuset(facts, row["device_ids"], int(raw.get("vcpu") or 0), int(raw.get("memoryGiB") or 0))
    out = node_pb2.DeviceAssignment(
        allocation_id=row["id"], device_ids=row["device_ids"], until=row["until"],
        binding=_BINDINGS.get(row["binding"] or "", node_pb2.BINDING_HOLD),
        limits=_limits(raw, cpuset), device_class=row.get("device_class") or "gpu")
    if row.get("profile_id"):  # a whole-machine lease: the profile metal deploys (controlplane.metal)
        out.deploy.CopyFrom(node_pb2.Deploy(profile_id=row["profile_id"], version=row["profile_version"],
                                            image=row["image"], checksum=row["checksum"]))
    return out


async def read(pool: AsyncConnectionPool, node_id: str) -> node_pb2.DesiredState:
    """One statement in autocommit (one snapshot, one round trip): the generation, the
    assignments, and for pinned holds their node's NUMA facts."""
    async def work(conn: AsyncConnection) -> list[dict[str, Any]]:
        return await (await conn.execute(queries.DESIRED_STATE, {"node_id": node_id})).fetchall()

    rows = await db.run_autocommit(pool, work)
    live = [r for r in rows if r["id"] is not None]
    pinned = next((r for r in live if r["pin_reserve"] is not None), None)
    facts = hosts.NumaFacts.of(pinned["pin_inventory"] or {}, int(pinned["pin_reserve"])) if pinned else None
    return node_pb2.DesiredState(generation=rows[0]["desired_generation"] if rows else 0,
                                 assignments=[assignment(r, facts) for r in live])
