"""The collection policy of the gateway and the control plane (controlplane.common.gc_pauses) and of nodesim (nodesim.pauses): the
survivors of a full collection are frozen, so the next one scans only what came since; the
gateway unfreezes them once a period, so what became garbage meanwhile is freed; stalls of the
loop are logged."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from controlplane.common import gc_pauses
from nodesim import pauses


class Node:  # a cycle, as a session's objects are
    def __init__(self) -> None:
        self.me = self


class Lines:
    """A logger that keeps what it is told."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))


@pytest.fixture
def clean_gc() -> Iterator[None]:
    gc.collect()
    gc.unfreeze()
    before = list(gc.callbacks)
    yield
    gc.callbacks[:] = before
    gc.unfreeze()


def test_gateway_freezes_after_a_full_collection_and_unfreezes_once_a_period(clean_gc: None) -> None:
    now = [0.0]
    collections = gc_pauses.Collections(600, logger=Lines(), clock=lambda: now[0])
    gc.callbacks.append(collections.callback)
    node = Node()
    gone = weakref.ref(node)

    collections.tend()
    gc.collect(0)
    collections.tend()
    assert gc.get_freeze_count() == 0  # no full collection yet: nothing frozen

    gc.collect()
    collections.tend()
    assert gc.get_freeze_count() > 0 and collections.full_collections == 1

    del node  # garbage now, but frozen: full collections do not see it
    gc.collect()
    assert gone() is not None

    now[0] = 600.0  # a period later the freezer thaws...
    collections.tend()
    assert gc.get_freeze_count() == 0
    gc.collect()  # ...and the next full collection frees it
    assert gone() is None
    collections.tend()
    assert gc.get_freeze_count() > 0  # and its survivors are frozen again


def test_gateway_without_a_period_freezes_nothing(clean_gc: None) -> None:
    collections = gc_pauses.Collections(0, logger=Lines())
    gc.callbacks.append(collections.callback)
    gc.collect()
    collections.tend()
    assert collections.full_collections == 1 and gc.get_freeze_count() == 0


def test_nodesim_freezes_the_survivors_of_each_full_collection(clean_gc: None) -> None:
    collections = pauses.Collections()
    gc.callbacks.append(collections.callback)
    gc.collect(1)
    collections.tend()
    assert gc.get_freeze_count() == 0
    gc.collect()
    collections.tend()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    kept = [Node() for _ in range(100)]
    gc.collect()
    collections.tend()
    assert gc.get_freeze_count() >= frozen + len(kept)


def test_a_fleet_embedded_in_another_process_freezes_nothing(clean_gc: None) -> None:
    """Only nodesim's own process freezes its heap; a fleet run inside another program (the
    tests) logs its collections but leaves that process's collector alone."""
    collections = pauses.Collections(freeze=False)
    gc.callbacks.append(collections.callback)
    gc.collect()
    collections.tend()
    assert collections.full_collections == 1 and gc.get_freeze_count() == 0


def test_a_stalled_loop_is_logged_with_its_cpu_time(clean_gc: None) -> None:
    lines = Lines()
    collections = gc_pauses.Collections(0, logger=lines)

    async def main() -> None:
        watching = asyncio.create_task(gc_pauses.watch(collections, interval=0.01, long_seconds=0.1))
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # the loop runs nothing else meanwhile (and the thread uses no CPU)
        for _ in range(500):  # the watch's next tick (a bound for a broken watch, not a figure)
            if lines.lines:
                break
            await asyncio.sleep(0.01)
        watching.cancel()

    asyncio.run(main())
    event, fields = lines.lines[0]
    assert event == "event loop stalled"
    assert fields["seconds"] >= 0.25 and fields["cpu_seconds"] < fields["seconds"]


def test_a_control_plane_process_freezes_the_survivors_and_an_embedded_one_does_not(
        database: str, clean_gc: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """start_app alone (a control plane embedded in the tests' process) leaves the collector as it
    is; collect_as_a_server (what `python -m controlplane serve` and `make dev` call after it)
    freezes the survivors of the next full collection, and stopping the app stops its watch."""
    from controlplane.app import collect_as_a_server
    from tests.support import ServerThread

    monkeypatch.setattr(gc_pauses, "_installed", [])  # this process's first install is the test's
    server = ServerThread(database)
    try:
        gc.collect()
        time.sleep(0.2)
        assert gc.get_freeze_count() == 0, "an embedded control plane froze its host process's heap"

        async def serve_as_a_process() -> None:
            collect_as_a_server(server.app, dataclasses.replace(server.settings, gc_unfreeze_seconds=600))

        server.call(serve_as_a_process())
        watch = next(t for t in server.app.tasks if t.get_name() == "gc-pauses")
        gc.collect()
        for _ in range(100):  # the watch tends within its 50 ms interval (a bound, not a figure)
            if gc.get_freeze_count():
                break
            time.sleep(0.02)
        assert gc.get_freeze_count() > 0, "the survivors of a full collection were not frozen"
    finally:
        server.stop()
    assert watch.done()
