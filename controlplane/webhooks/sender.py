"""One webhook POST with the standard library's http.client, meant to run in a thread.

A direct connection (no environment proxies), certificates verified for https, a timeout on
connect and on every read, redirects not followed (a 3xx is a failed attempt). Only the status
matters: at most 64 KiB of the answer is read.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse
from dataclasses import dataclass

MAX_ERROR = 500
_TLS = ssl.create_default_context()


@dataclass(frozen=True)
class Outcome:
    status: int | None  # the HTTP status, None when there was no answer
    error: str  # empty on success

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def post(url: str, payload: bytes, headers: dict[str, str], timeout: float) -> Outcome:
    parts = urllib.parse.urlsplit(url)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    conn: http.client.HTTPConnection
    try:
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout, context=_TLS)
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        try:
            conn.request("POST", target, body=payload, headers=headers)
            response = conn.getresponse()
            response.read(65536)
        finally:
            conn.close()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Outcome(None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR])
    if 200 <= response.status < 300:
        return Outcome(response.status, "")
    return Outcome(response.status, f"HTTP {response.status} {response.reason}"[:MAX_ERROR])
