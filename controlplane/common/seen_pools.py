"""The pools as tenants last read them, for a create that checks its request before its facts
read (draft_ahead)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any


class SeenPools:
    """(tenant id, pool id) -> the pool as that tenant last read it (VISIBLE_POOL_FACTS as JSON).
    An entry proves nothing about the pool now: the statement compares it with the pool it reads.
    Least recently used entries leave first beyond `entries`."""

    def __init__(self, entries: int = 4096) -> None:
        self.entries = entries
        self._seen: OrderedDict[tuple[str, str], tuple[str, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()  # servers in threads of one process (tests) share a runtime's

    def remember(self, tenant_id: str, pool: dict[str, Any]) -> None:
        """Every create's facts read calls this: the JSON is made only when the view changed."""
        key = (tenant_id, pool["id"])
        with self._lock:
            held = self._seen.get(key)
            if held is None or held[1] != pool:
                self._seen[key] = (json.dumps(pool), pool)
            self._seen.move_to_end(key)
            while len(self._seen) > self.entries:
                self._seen.popitem(last=False)

    def get(self, tenant_id: str, pool_id: str) -> tuple[str, dict[str, Any]] | None:
        with self._lock:
            return self._seen.get((tenant_id, pool_id))
