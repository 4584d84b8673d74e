"""capacity.preview: where a create would place now, or the earliest start it fits, booking
nothing. The request is validated and resolved as create does (controlplane.reservations.admission
.resolve_request: the pool, its checks, the host resources it books) and planned by the code that
plans a create (placing.plan_for), so a preview that fits is a create that fits at that moment; a
regular request that fits nowhere is planned as create then plans it, taking spot work from the end
of the pool's notice (placement.preempt.plan), and answers that window."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from controlplane import authorize, db
from controlplane.auth import Caller
from controlplane.metal import is_node_lease
from controlplane.metal import placement as whole_machines
from controlplane.placement import filters, gang, placer, preempt
from controlplane.placement.index import PoolIndex
from controlplane.placement.index_sync import read_pool
from controlplane.reservations import admission, earliest, placing, preemption
from controlplane.reservations.validate import DAY_MS, TimeLimits, check_start, validate_create
from controlplane.runtime import Runtime

_NODE_NAMES = "SELECT id, name FROM nodes WHERE id = ANY(%(ids)s)"


async def preview(rt: Runtime, caller: Caller, raw: dict[str, Any]) -> dict[str, Any]:
    limits = TimeLimits.of(rt.settings)
    # What create takes; the key names no draft here, so a preview needs none.
    inp = validate_create({**raw, "idempotency_key": raw.get("idempotency_key") or "preview"}, limits,
                          max_gang_size=rt.settings.max_gang_size)
    caller.require_member(inp.tenant_id)
    async with db.read_only(rt.pool) as conn:
        now_ms = await db.now_ms(conn)
        check_start(inp, now_ms, limits)
        resolved = await admission.resolve_request(conn, rt, inp.request, inp.tenant_id)
    pool_id = resolved.pool["id"]
    # Decided with the read transaction closed, as capacity.timeline.
    await authorize.require(rt.pool, caller, inp.tenant_id, "compute:capacity:read", "Pool", pool_id,
                            {"region": resolved.pool["region"], "ownerTenantId": resolved.pool["owner_tenant_id"]},
                            message="IAM refused this read", poolId=pool_id)
    await earliest.caught_up(rt)
    async with db.read_only(rt.pool) as conn:
        now_ms = await db.now_ms(conn)
        return await _plan(conn, rt, pool_id, resolved.request, now_ms)


async def _plan(conn: AsyncConnection, rt: Runtime, pool_id: str, request: dict[str, Any], now_ms: int) -> dict[str, Any]:
    out: dict[str, Any] = {"pool_id": pool_id, "fits": False, "members": [], "group": "",
                           "resources": request.get("resources") or {}, "reason": "", "filters": []}
    horizon_note = ""
    if request.get("startEarliest"):
        start = await earliest.find(conn, rt, pool_id, request, now_ms)
        if start is None:
            horizon_note = f"nothing fits within the horizon of {request['horizonMs'] / DAY_MS:g} days; now: "
        else:
            request = {**request, "start": start}
    row = {"id": "", "pool_id": pool_id, "request": request, "state": "draft", "conditions": []}
    ask = placing.ask_for(row, now_ms)
    out.update(start=ask.start_ms, end=ask.end_ms)
    members: list[dict[str, Any]] = []
    reason = ""
    if is_node_lease(request):  # one machine, or a gang of them
        machines = await whole_machines.plan(conn, ask, gang.Gang.of(request), rt.settings)
        out["group"], reason = machines.group, machines.reason
        members = [{"node_id": m["node_id"], "atom_ids": list(m["atom_ids"]), "device_ids": list(m["device_ids"] or [])}
                   for m in machines.nodes]
    else:
        planned = await placing.plan_for(conn, rt, row, ask)
        members, out["group"], reason = _members(planned)
        if not members and not preemption.is_spot(request):  # what create does next: take spot work
            choice = await preempt.plan(conn, ask, gang.Gang.of(request), rt.settings, now_ms=now_ms,
                                        notice=await preemption.pool_notice_ms(conn, pool_id))
            if choice is not None:
                members, out["group"], _ = _members(choice.planned)
                out.update(start=choice.ask.start_ms, end=choice.ask.end_ms)
    if members and not horizon_note:
        names = {r["id"]: r["name"] for r in await (await conn.execute(
            _NODE_NAMES, {"ids": [m["node_id"] for m in members]})).fetchall()}
        out.update(fits=True, members=[{**m, "node_name": names.get(m["node_id"], "")} for m in members])
        return out
    out["reason"] = horizon_note + (reason or await placing.explain(conn, row, ask))
    if not is_node_lease(request):
        index = await _pool(conn, rt, pool_id)
        members_of = gang.Gang.of(request)
        out["filters"] = [f.__dict__ for f in filters.funnel(index, ask.window(), members_of.key if members_of else "")]
    return out


def _members(planned: placer.Planned | gang.GangPlanned) -> tuple[list[dict[str, Any]], str, str]:
    """A plan's members (node, atoms, devices), its gang's group and why nothing fits."""
    if isinstance(planned, gang.GangPlanned):
        if planned.plan is None:
            return [], "", planned.reason
        return ([{"node_id": m.node_id, "atom_ids": list(m.atom_ids),
                  "device_ids": [planned.plan.uuids[a] for a in m.atom_ids]} for m in planned.plan.members],
                planned.plan.group, planned.reason)
    if planned.plan is None:
        return [], "", ""
    return ([{"node_id": planned.plan.node_id, "atom_ids": list(planned.plan.atom_ids),
              "device_ids": [planned.uuids[a] for a in planned.plan.atom_ids]}], "", "")


async def _pool(conn: AsyncConnection, rt: Runtime, pool_id: str) -> PoolIndex:
    index = rt.capacity.pool(pool_id) if rt.capacity is not None else None
    return index if index is not None else await read_pool(conn, pool_id)
