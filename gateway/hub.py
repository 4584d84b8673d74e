"""The sessions this gateway process holds, and the one LISTEN connection that wakes them.

`bc_node_desired` (payload: node id; sent by bump_desired) makes the node's sessions push their
desired state; `bc_node_session` (a newer session registered, or a certificate was revoked) makes
them check they are still the node's newest session with a good certificate; `bc_node_renew` (the
node's role changes: a whole-machine lease began or ended) hints the node to renew. No polling: when
the LISTEN connection is lost, every session re-pushes and re-checks once it is back (the
RECONNECTED of controlplane.listen).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import psycopg

from controlplane.listen import RECONNECTED, listen
from controlplane.nodes.desired import DESIRED_CHANNEL
from controlplane.nodes.sessions import SESSION_CHANNEL
from controlplane.nodes.tenancy import RENEW_CHANNEL
from gateway.session_state import CHECK, DESIRED, RENEW, NodeSession

_CHANNELS = {DESIRED_CHANNEL: DESIRED, SESSION_CHANNEL: CHECK, RENEW_CHANNEL: RENEW}


class Hub:
    def __init__(self) -> None:
        self._by_node: dict[str, set[NodeSession]] = defaultdict(set)
        self.listening = asyncio.Event()

    def add(self, session: NodeSession) -> None:
        self._by_node[session.node_id].add(session)

    def remove(self, session: NodeSession) -> None:
        sessions = self._by_node.get(session.node_id)
        if sessions is not None:
            sessions.discard(session)
            if not sessions:
                del self._by_node[session.node_id]

    def sessions(self, node_id: str | None = None) -> list[NodeSession]:
        if node_id is not None:
            return list(self._by_node.get(node_id, ()))
        return [s for group in self._by_node.values() for s in group]

    def wake(self, node_id: str, kind: str) -> None:
        for session in self._by_node.get(node_id, ()):
            session.signal(kind)

    async def listen(self, conninfo: str, stopping: asyncio.Event) -> None:
        """Fan notifications out to the sessions until `stopping`; after every (re)connect, every
        session re-pushes and re-checks (notifications may have been missed meanwhile)."""
        async with listen(conninfo, list(_CHANNELS), stopping, name="gateway") as listener:
            async for item in listener:
                if item is RECONNECTED:
                    for session in self.sessions():
                        session.signal(DESIRED)
                        session.signal(CHECK)
                    self.listening.set()
                elif isinstance(item, psycopg.Notify):
                    self.wake(item.payload, _CHANNELS[item.channel])
