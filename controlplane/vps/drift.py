"""Bring the provider's instances in line with the rows, once per scan of an account.

A provider call can land after a later one (a start answered after the stop that followed it),
be carried out after the control plane gave up waiting for it (a create it then undid before it
landed), or be lost. The rows are what was decided and billed, so the provider is told them again:
an instance of ours (named by its row id) that runs there while its row is stopped is stopped, one
whose row is deleted is deleted, and a stopped one whose row runs is started. An instance no row
knows is left alone and logged: the provider account may hold other machines, another
deployment's among them (named like ours), and a create given up on keeps its row, deleted, for
this check to find. The provider is asked outside any transaction; each call is idempotent, and
one that fails waits for the next scan.
"""

from __future__ import annotations

from typing import Any

import structlog

from controlplane import db
from controlplane.runtime import Runtime
from controlplane.vps import names
from controlplane.vps import queries as q
from controlplane.vps.provider import Provider, ProviderFailure, ProviderInstance

log = structlog.get_logger(__name__)


def _wanted(found: ProviderInstance, row: dict[str, Any]) -> str | None:
    """The call that brings the provider's instance to its row's state, if any."""
    state = row["state"]
    if state == "deleted":
        return "delete_instance"
    if state == "stopped" and found.state == "running":
        return "stop_instance"
    if state == "running" and found.state == "stopped":
        return "start_instance"
    return None


async def sync_instances(rt: Runtime, provider: Provider, account: dict[str, Any]) -> int:
    """One pass over the account's instances at the provider; returns how many calls it made."""
    try:
        reported = [i for i in await provider.list_instances(account["external_account"])
                    if i.state != "deleted" and names.INSTANCE_ID.fullmatch(i.name)]
    except ProviderFailure as exc:
        log.warning("provider instances not listed", account_id=account["id"], kind=exc.kind)
        return 0
    if not reported:
        return 0
    # Read after the provider answered: a row changed since then was changed by a call that
    # itself asks the provider after its commit. By id alone: an operator may have registered the
    # provider's account twice, and the other account's rows are as much ours.
    async with db.read_only(rt.pool) as conn:
        rows = {r["id"]: r for r in await (await conn.execute(q.INSTANCE_STATES, {
            "ids": [i.name for i in reported]})).fetchall()}
    calls = 0
    for found in reported:
        row = rows.get(found.name)
        if row is None:
            log.warning("provider instance no row knows, left alone", account_id=account["id"],
                        instance_id=found.name, provider_state=found.state)
            continue
        call = _wanted(found, row)
        if call is None:
            continue
        calls += 1
        log.warning("provider instance out of line with its row", account_id=account["id"], instance_id=found.name,
                    provider_state=found.state, row_state=row["state"], call=call)
        try:
            await getattr(provider, call)(account["external_account"], found.name)
        except ProviderFailure as exc:
            log.warning("provider instance not brought in line", instance_id=found.name, call=call, kind=exc.kind)
    return calls
