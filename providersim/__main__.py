"""`providersim [--listen HOST:PORT] [--reservation ACCOUNT/NAME/FLAVOR/REGION/TOTAL ...]`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import structlog

from providersim.server import serve


def configure_logging(fmt: str) -> None:
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="providersim", description="a simulated cloud provider (gRPC)")
    parser.add_argument("--listen", default="127.0.0.1:50061")
    parser.add_argument("--reservation", action="append", default=[],
                        help="ACCOUNT/NAME/FLAVOR/REGION/TOTAL: a reservation present at start")
    parser.add_argument("--log-format", default="console", choices=["console", "json"])
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    server, port, state, _ = await serve(args.listen)
    for spec in args.reservation:
        account, name, flavor, region, total = spec.split("/")
        state.put_reservation(account, name, flavor, region, int(total))
    print(f"providersim listening on {args.listen.rsplit(':', 1)[0]}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_format)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
