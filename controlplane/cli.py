"""Command line: `controlplane serve|migrate|bootstrap`, `better-compute dev`, and client commands."""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import sys

from controlplane.config import Settings, check_listen


def _conninfo(settings: Settings) -> str:
    from controlplane import db

    return settings.database_url or db.start_embedded(settings.data_dir)


def serve_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="controlplane", description="Run the control plane.")
    parser.add_argument("command", nargs="?", default="serve", choices=["serve", "migrate", "bootstrap"])
    parser.add_argument("--listen", help="host:port for the tenant API (default $BC_LISTEN)")
    parser.add_argument("--metrics-listen", help="host:port for GET /metrics (default $BC_METRICS_LISTEN; off when"
                        " empty)")
    args = parser.parse_args(argv)

    from controlplane import bootstrap, db
    from controlplane.logs import configure_logging

    try:  # a malformed BC_* variable is a usage error naming it (exit 2), before anything starts
        settings = Settings()
        listen = check_listen("--listen" if args.listen else "BC_LISTEN", args.listen or settings.listen)
        check_listen("--metrics-listen" if args.metrics_listen else "BC_METRICS_LISTEN",
                     args.metrics_listen or settings.metrics_listen)
    except ValueError as exc:
        parser.error(str(exc))
    if args.metrics_listen is not None:
        settings = dataclasses.replace(settings, metrics_listen=args.metrics_listen)
    configure_logging(settings.log_format)
    conninfo = _conninfo(settings)
    db.migrate(conninfo)
    if args.command == "migrate":
        return 0
    if args.command == "bootstrap":
        print(bootstrap.ensure_root(conninfo))
        return 0

    from controlplane.app import run_forever

    asyncio.run(run_forever(settings, conninfo, listen=listen))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "dev":
        from controlplane.devtools.dev import main as dev_main

        return dev_main(argv[1:])
    if argv and argv[0] in {"serve", "migrate", "bootstrap"}:
        return serve_main(argv)
    if argv and argv[0] == "mcp":
        from controlplane.client.mcp_server import main as mcp_main

        return mcp_main(argv[1:])
    from controlplane.client.main import main as client_main

    return client_main(argv)


if __name__ == "__main__":
    sys.exit(main())
