"""`nodesim --sim N --gateway HOST:PORT --sandbox DIR --tokens FILE [--ca FILE]`."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import sys

import structlog

from nodesim.config import FleetConfig, parse_args
from nodesim.fleet import Fleet


def configure_logging(fmt: str, level: str) -> None:
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def raise_open_files_limit(nodes: int) -> None:
    """One TCP connection per node: lift the soft open-files limit (often 1024) as far as needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = nodes + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            structlog.get_logger("nodesim").warning("open-files limit too low for the fleet", limit=new, wanted=want)


async def serve(config: FleetConfig) -> None:
    fleet = Fleet(config, freeze_gc=True)  # this process is the fleet's own
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, fleet.go_unreachable)
    loop.add_signal_handler(signal.SIGUSR2, fleet.restart_now)
    await fleet.start()
    running = asyncio.create_task(fleet.run_forever())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        await fleet.stop()
    if running.done() and not running.cancelled() and running.exception() is not None:
        raise running.exception()  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(config.log_format, config.log_level)
    raise_open_files_limit(config.sim)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
