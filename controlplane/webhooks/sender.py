"""One webhook attempt on the event loop, under one total deadline.

The deadline covers everything: resolving and checking the target (`targets`), connecting to the
checked address, TLS (certificates verified, SNI and the certificate check against the URL's host),
sending, and reading the answer up to its status line (at most MAX_HEAD bytes, interim 1xx
answers included). Only the status matters: the rest of the answer is never read, and the
connection is aborted, not closed gracefully (no lingering on a receiver that will not finish).
Redirects are not followed (a 3xx is a failed attempt).

The tenant sees a status or one of a few fixed texts, never a receiver's bytes or an exception's
text (no banner oracle); `Outcome.detail` is for the log only.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.webhooks import targets

_TLS = ssl.create_default_context()
_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?\r?\n$")
MAX_LINE = 8192  # a status or header line longer than this is not an HTTP answer
MAX_INTERIM = 5  # 1xx answers skipped before the final status
# The status lines and interim headers read in all: a receiver flooding header lines would
# otherwise be parsed, line by line on the event loop, until the deadline.
MAX_HEAD = 65536

TIMED_OUT = "timed out"
NOT_ALLOWED = "the host does not resolve to an allowed address"
CONNECT_FAILED = "connection failed"
TLS_FAILED = "TLS failed"
BAD_ANSWER = "not an HTTP answer"


@dataclass(frozen=True)
class Outcome:
    status: int | None  # the HTTP status, None when there was no answer
    error: str  # empty on success; otherwise a fixed text shown to the tenant
    detail: str = ""  # for the operator's log only

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class _BadAnswer(Exception):
    pass


async def post(url: str, payload: bytes, headers: dict[str, str], *, deadline: float,
               allow: Sequence[targets.Network], tenant_id: str = "") -> Outcome:
    """POST `payload` to `url`, all of it within `deadline` seconds (the name looked up as
    `tenant_id`'s, see targets.LOOKUPS_PER_TENANT)."""
    try:
        async with asyncio.timeout(deadline):
            target = await targets.resolve(targets.parse(url), allow, tenant_id)
            status = await _exchange(target, payload, headers)
    except TimeoutError as exc:
        return Outcome(None, TIMED_OUT, repr(exc))
    except ssl.SSLError as exc:  # before ValueError and OSError: a certificate error is both
        return Outcome(None, TLS_FAILED, repr(exc))
    except (targets.Refused, ValueError) as exc:
        return Outcome(None, NOT_ALLOWED, repr(exc))
    except (_BadAnswer, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        return Outcome(None, BAD_ANSWER, repr(exc))
    except OSError as exc:
        return Outcome(None, CONNECT_FAILED, repr(exc))
    if 200 <= status < 300:
        return Outcome(status, "")
    return Outcome(status, f"HTTP {status}")


async def _exchange(target: targets.Target, payload: bytes, headers: dict[str, str]) -> int:
    reader, writer = await _connect(target)
    url = target.url
    try:
        lines = [f"POST {url.request_target} HTTP/1.1", f"Host: {url.host_header}",
                 f"Content-Length: {len(payload)}", "Connection: close",
                 *(f"{name}: {value}" for name, value in headers.items())]
        writer.write("\r\n".join(lines).encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        read = 0

        async def line() -> bytes:
            nonlocal read
            data = await reader.readuntil(b"\n")
            read += len(data)
            if read > MAX_HEAD:
                raise _BadAnswer(f"more than {MAX_HEAD} bytes before the final status")
            return data

        for _ in range(MAX_INTERIM + 1):
            match = _STATUS_LINE.match(await line())
            if match is None:
                raise _BadAnswer("no status line")
            status = int(match.group(1))
            if status >= 200:
                return status
            while (await line()).strip():  # an interim answer's headers
                pass
        raise _BadAnswer("too many interim answers")
    finally:
        writer.transport.abort()


async def _connect(target: targets.Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the first checked address that takes one (TLS failures are final)."""
    url = target.url
    tls = url.scheme == "https"
    failure: OSError | None = None
    for address in target.addresses:
        try:
            return await asyncio.open_connection(
                address, url.port, ssl=_TLS if tls else None, server_hostname=url.host if tls else None,
                limit=MAX_LINE)
        except ssl.SSLError:
            raise
        except OSError as exc:
            failure = exc
    assert failure is not None  # a target has at least one address
    raise failure
