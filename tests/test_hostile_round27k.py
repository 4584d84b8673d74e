"""probe"""
from __future__ import annotations

import uuid

import grpc
import pytest

from bettercompute.v1 import reservations_pb2 as pb
from controlplane.placement import earliest as earliest_search
from controlplane.placement import gang as gang_placement
from controlplane.placement.index import PoolIndex
from tests.support import ServerThread, World, outcome
from tests.test_capacity_preview import preview

HOUR = 3_600_000


def live_pool(server: ServerThread, world: World) -> PoolIndex:
    capacity = server.app.runtime.capacity
    server.call(capacity.barrier())
    pool = capacity.pool(world.pool_id)
    assert pool is not None
    return pool


def remembered(pool: PoolIndex) -> int:
    """Every shape the pool's index and its nodes keep an answer for, and the module caches' entries
    for these nodes."""
    ids = set(pool.nodes)
    per_node = sum(len(n._sorted) + len(n._room) + len(n._whole) for n in pool.nodes.values())
    module = sum(1 for k in earliest_search._IDLE_FITS if k[0] in ids) + sum(
        1 for k in gang_placement._IDLE_PLANS if k[0] in ids)
    return per_node + len(pool._room) + module


def test_previews_naming_models_nobody_has_leave_no_memory_behind(server: ServerThread, world: World) -> None:
    world.create(count=2)  # a booked node: the plan visits it exactly
    for kw in ({}, {"start_earliest": True}, {"gang": pb.Gang(size=2)}):
        out = preview(world, count=1, **kw)
        assert out.fits, out.reason
    before = remembered(live_pool(server, world))
    for _ in range(30):
        model = f"X{uuid.uuid4().hex}"
        for kw in ({}, {"start_earliest": True}, {"gang": pb.Gang(size=2)}, {"topology": "nvlink-all"}):
            out = preview(world, count=1, model=model, **kw)
            assert not out.fits
    assert remembered(live_pool(server, world)) == before
