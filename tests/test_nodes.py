"""The nodes package's lock rule: every operator change that placement depends on (GPU health,
cordon, connectivity, a new node's GPUs) takes the pool's lock before the node's rows, as the
inventory a node reports does, so a placement holding that lock never sees them change under it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from bettercompute.v1 import admin_pb2 as apb
from tests.promise_support import poll, pool_locked
from tests.support import World, gpus

_WAITING_FOR_ADVISORY_LOCK = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory'
  AND query LIKE '%%pg_advisory_xact_lock%%'
"""


def _gpu_health(world: World) -> tuple[Callable[[], Any], Callable[[], Any]]:
    node = world.nodes[0]
    uuid = node_gpu(world, node.id)
    call = lambda: world.root.admin("SetGpuHealth", apb.SetGpuHealthRequest(  # noqa: E731
        node_id=node.id, device_uuid=uuid, health="unhealthy"))
    state = lambda: world.sql("SELECT health FROM atoms WHERE node_id = %s AND device_uuid = %s",  # noqa: E731
                              (node.id, uuid))[0][0]
    return call, state


def _cordon(world: World) -> tuple[Callable[[], Any], Callable[[], Any]]:
    node = world.nodes[0]
    call = lambda: world.root.admin("SetNodeState", apb.SetNodeStateRequest(  # noqa: E731
        node_id=node.id, state="cordoned"))
    return call, lambda: world.sql("SELECT state FROM nodes WHERE id = %s", (node.id,))[0][0]


def _connectivity(world: World) -> tuple[Callable[[], Any], Callable[[], Any]]:
    node = world.nodes[0]
    call = lambda: world.root.admin("SetNodeConnectivity", apb.SetNodeConnectivityRequest(  # noqa: E731
        node_id=node.id, connectivity="unreachable"))
    return call, lambda: world.sql("SELECT connectivity FROM nodes WHERE id = %s", (node.id,))[0][0]


def _register(world: World) -> tuple[Callable[[], Any], Callable[[], Any]]:
    call = lambda: world.root.admin("RegisterNode", apb.RegisterNodeRequest(  # noqa: E731
        pool_id=world.pool_id, name="late", gpus=gpus("late", 2)))
    return call, lambda: world.sql("SELECT count(*) FROM atoms a JOIN nodes n ON n.id = a.node_id"
                                   " WHERE n.pool_id = %s AND n.name = 'late'", (world.pool_id,))[0][0]


def node_gpu(world: World, node_id: str) -> str:
    return world.sql("SELECT device_uuid FROM atoms WHERE node_id = %s ORDER BY device_uuid LIMIT 1", (node_id,))[0][0]


@pytest.mark.parametrize("change", [_gpu_health, _cordon, _connectivity, _register],
                         ids=["gpu-health", "cordon", "connectivity", "register"])
def test_operator_node_changes_wait_for_the_pool_lock(world: World, change: Callable) -> None:
    call, state = change(world)
    before = state()
    with ThreadPoolExecutor(1) as executor:
        with pool_locked(world):
            done = executor.submit(call)
            poll(lambda: world.sql(_WAITING_FOR_ADVISORY_LOCK)[0][0] >= 1, seconds=30,
                 what="the operator's change waiting for the pool lock")
            assert state() == before and not done.done()  # it waits, nothing written yet
        done.result(timeout=60)
    assert state() != before
