"""`gateway` / `python -m gateway`: run a node gateway against DATABASE_URL (or the embedded
PostgreSQL under BC_DATA_DIR when it is unset)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="Run a node gateway.")
    parser.add_argument("--listen", help="host:port for node sessions, mutual TLS (default $BC_GATEWAY_LISTEN)")
    parser.add_argument("--enrol-listen", help="host:port for enrolment, TLS (default $BC_GATEWAY_ENROL_LISTEN)")
    parser.add_argument("--metrics-listen", help="host:port for GET /metrics (default $BC_GATEWAY_METRICS_LISTEN;"
                        " off when empty)")
    parser.add_argument("--write-ca", metavar="PATH", help="write the CA certificate (PEM) that nodes trust here")
    args = parser.parse_args(argv)

    from controlplane import db
    from controlplane.config import Settings, check_listen
    from controlplane.logs import configure_logging
    from gateway.config import GatewaySettings
    from gateway.server import run_forever

    try:  # a malformed BC_* variable is a usage error naming it (exit 2), before anything starts
        common, settings = Settings(), GatewaySettings()
        listen = check_listen("--listen" if args.listen else "BC_GATEWAY_LISTEN", args.listen or settings.listen)
        enrol_listen = check_listen("--enrol-listen" if args.enrol_listen else "BC_GATEWAY_ENROL_LISTEN",
                                    args.enrol_listen or settings.enrol_listen)
        check_listen("--metrics-listen" if args.metrics_listen else "BC_GATEWAY_METRICS_LISTEN",
                     args.metrics_listen or settings.metrics_listen)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(common.log_format)
    conninfo = common.database_url or db.start_embedded(common.data_dir)
    db.migrate(conninfo)
    if args.metrics_listen is not None:
        settings = dataclasses.replace(settings, metrics_listen=args.metrics_listen)
    asyncio.run(run_forever(settings, conninfo, listen, enrol_listen, args.write_ca))
    return 0


if __name__ == "__main__":
    sys.exit(main())
