"""N simulated nodes on one event loop.

Nodes start staggered (`connect_rate` per second) and share one server-auth TLS channel for Enrol;
each keeps its own mutual-TLS channel, since each presents its own client certificate.

    fleet = Fleet(parse_args([...]))
    await fleet.start()
    await fleet.wait_connected(timeout=30)
    ...
    await fleet.stop()
"""

from __future__ import annotations

import asyncio
import gc
import time

import grpc
import structlog

from bettercompute.node.v1 import node_pb2_grpc
from nodesim import pauses
from nodesim.config import FleetConfig
from nodesim.node import Shared, SimNode, restarted

ENROL_CONCURRENCY = 16
PROGRESS_EVERY = 1.0

log = structlog.get_logger("nodesim.fleet")


class Fleet:
    def __init__(self, config: FleetConfig, *, freeze_gc: bool = False) -> None:
        """`freeze_gc`: freeze the survivors of full collections (nodesim's own process only)."""
        self.config = config
        self.freeze_gc = freeze_gc
        self.names = config.node_names()
        # The current incarnation of each node (a --restart-after fault replaces it).
        self.nodes: dict[str, SimNode] = {}
        self.restarts = 0
        # The running incarnation of each node with --restart-on-signal, until it restarted.
        self._restartable: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._enrol_channel: grpc.aio.Channel | None = None
        self._shared: Shared | None = None
        self._started_at = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        config = self.config
        options = [("grpc.ssl_target_name_override", config.server_name)] if config.server_name else []
        self._enrol_channel = grpc.aio.secure_channel(
            config.enrol_gateway or config.gateway,
            grpc.ssl_channel_credentials(root_certificates=config.ca_pem),
            options=options,
        )
        self._shared = Shared(
            config=config,
            enrol=node_pb2_grpc.NodeGatewayStub(self._enrol_channel),
            enrol_slots=asyncio.Semaphore(ENROL_CONCURRENCY),
            held_elsewhere=self._held_elsewhere,
        )
        self._started_at = time.monotonic()
        log.info("starting fleet", nodes=len(self.names), gateway=config.gateway, sandbox=str(config.sandbox))
        for position, name in enumerate(self.names):
            delay = position / config.connect_rate
            self._tasks.append(asyncio.create_task(self._run_node(position, name, delay), name=f"node-{name}"))
        self._tasks.append(asyncio.create_task(self._progress(), name="fleet-progress"))
        self._tasks.append(asyncio.create_task(pauses.watch(pauses.install(freeze=self.freeze_gc)), name="fleet-gc"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._enrol_channel is not None:
            await self._enrol_channel.close()
            self._enrol_channel = None
        log.info("fleet stopped", nodes=len(self.names))

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def run_forever(self) -> None:
        """Until cancelled; a node task that dies of a bug is reported, not silently lost."""
        await asyncio.gather(*self._tasks)

    # -- observation -------------------------------------------------------------------------

    def node(self, name: str) -> SimNode:
        return self.nodes[name]

    def enrolled(self) -> int:
        return sum(1 for n in self.nodes.values() if n.identity is not None)

    def connected(self) -> int:
        return sum(1 for n in self.nodes.values() if n.connected)

    async def wait_connected(self, timeout: float | None = None, count: int | None = None) -> None:
        """Until `count` nodes (default: all) have a session up at once; TimeoutError after `timeout`."""
        want = len(self.names) if count is None else count
        async with asyncio.timeout(timeout):
            while self.connected() < want:
                for task in self._tasks:
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                await asyncio.sleep(0.05)

    def go_unreachable(self) -> None:
        """Nodes with --unreachable-on-signal go unreachable now (SIGUSR1)."""
        for node in self.nodes.values():
            node.go_unreachable()

    def restart_now(self) -> None:
        """Nodes with --restart-on-signal restart now, once (SIGUSR2)."""
        for task in self._restartable.values():
            task.cancel()

    # -- internals ---------------------------------------------------------------------------

    def _held_elsewhere(self, name: str) -> list[str]:
        return [a for other, node in self.nodes.items() if other != name for a in node.converger.holds]

    async def _run_node(self, position: int, name: str, delay: float) -> None:
        assert self._shared is not None
        await asyncio.sleep(delay)
        node = SimNode(name, position, self._shared)
        self.nodes[name] = node
        restart_after = node.faults.restart_after
        if restart_after is not None or node.faults.restart_on_signal:
            running = asyncio.create_task(node.run(), name=f"node-{name}-first")
            self._restartable[name] = running
            try:  # until the time passes or restart_now() cancels it
                await asyncio.wait({running}, timeout=restart_after)
            finally:
                self._restartable.pop(name, None)
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
            if not running.cancelled() and running.exception() is not None:
                raise running.exception()  # type: ignore[misc]  # a bug, not a restart
            # Everything in memory is dropped; the next incarnation recovers from the sandbox.
            self.restarts += 1
            log.info("node restarted (fault injection)", node=name)
            node = SimNode(name, position, self._shared, faults=restarted(node.faults))
            self.nodes[name] = node
        await node.run()

    async def _progress(self) -> None:
        last = (-1, -1)
        total = len(self.names)
        announced = False
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            now = (self.enrolled(), self.connected())
            if now != last:
                log.info(f"{now[0]} enrolled, {now[1]} connected", enrolled=now[0], connected=now[1], nodes=total)
                last = now
            if now[1] == total and not announced:
                log.info("all nodes connected", nodes=total, seconds=round(time.monotonic() - self._started_at, 2))
                announced = True
                # The fleet's objects live as long as the process: no full collection scans them again
                # (with thousands of nodes one would stop every node's loop for seconds). Only in
                # nodesim's own process (see pauses.install).
                if self.freeze_gc:
                    gc.freeze()
