"""The command line: commands, their flags, and the options accepted before or after a command."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from controlplane.client import commands


def _common_args(parser: argparse.ArgumentParser, default: Any) -> None:
    group = parser.add_argument_group("connection and output (before or after the command)")
    group.add_argument(
        "--connection",
        metavar="PATH",
        default=default,
        help="the file `dev` writes (default $BC_DATA_DIR/connection.json)",
    )
    group.add_argument("--endpoint", default=default, help="host:port of the API")
    group.add_argument("--token", default=default,
                       help="bearer token (any local user sees it in `ps`: prefer $BC_TOKEN or --token-file)")
    group.add_argument("--token-file", metavar="PATH", default=default,
                       help="a file holding the bearer token (read once; a trailing newline is ignored)")
    group.add_argument("--tenant", default=default, help="tenant id")
    group.add_argument("--pool", default=default, help="pool id (default: the connection's)")
    group.add_argument("--ca", metavar="PATH", default=default,
                       help="PEM of the CA that signed the API's TLS certificate: dial TLS (default plaintext)")
    group.add_argument(
        "--json", action="store_true", default=default or False,
        help="print JSON (the default when stdout is not a terminal)",
    )


def _reservation_command(commands_: Any, common: argparse.ArgumentParser, name: str, run: Any, help_text: str) -> argparse.ArgumentParser:
    p = commands_.add_parser(name, parents=[common], help=help_text, description=help_text)
    p.add_argument("reservation_id", metavar="RSV_ID")
    p.set_defaults(run=run)
    return p


def build() -> argparse.ArgumentParser:
    # The common options are accepted on both sides of the command: the subcommands' copies
    # leave the attribute alone unless given.
    common = argparse.ArgumentParser(add_help=False)
    _common_args(common, argparse.SUPPRESS)

    # No abbreviations of the options before the command: every argument is matched against them,
    # and `capacity timeline --to` or `usage --to` would be ambiguous (--token, --token-file).
    parser = argparse.ArgumentParser(
        prog="better-compute",
        allow_abbrev=False,
        description="Reserve GPUs through the Better Compute API. Tables on a terminal, JSON otherwise.",
        epilog="`better-compute dev` runs the system locally; `better-compute mcp` serves the "
        "tools to an agent over stdio (see README.md)."
    )
    _common_args(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("reserve", parents=[common], help="reserve GPUs")
    _shape_flags(p, required=True)
    p.add_argument("--key", help="idempotency key (default: a new random key)")
    p.add_argument("--lease", help="a renewable lease such as 10m (see `renew`)")
    p.add_argument("--wait", type=float, default=20.0, help="seconds to wait while queued (default 20)")
    p.set_defaults(run=commands.reserve, progress=True)

    p = _reservation_command(sub, common, "extend", commands.extend, "move a reservation's end later")
    change = p.add_mutually_exclusive_group(required=True)
    change.add_argument("--until", help="the new end: +12h (from now), ISO 8601 or epoch ms")
    change.add_argument("--by", help="this much longer: 4h, 30m, 1h30m...")
    p.add_argument("--key", help="idempotency key (default: a new random key)")

    _reservation_command(sub, common, "renew", commands.renew, "renew a reservation's lease")
    _reservation_command(sub, common, "release", commands.release, "end a reservation now and refund its quota")
    _reservation_command(sub, common, "cancel", commands.cancel, "withdraw a reservation that has not started")
    _reservation_command(sub, common, "get", commands.get, "show a reservation")

    p = sub.add_parser("list", parents=[common], help="list reservations, newest first (--pool: only that pool)")
    p.add_argument("--all", action="store_true", help="the tenant's, not only mine")
    p.add_argument("--state", action="append", help="only this state (repeatable)")
    p.add_argument("--limit", type=_bounded("--limit", -2**31, 2**31 - 1), default=0,
                   help="page size, 1 to 200 (default 50)")
    p.add_argument("--cursor", help="nextCursor of the previous page")
    p.set_defaults(run=commands.list_)

    # No abbreviations here: `capacity timeline --to` must not read as a prefix of --topology.
    p = sub.add_parser("capacity", parents=[common], allow_abbrev=False,
                       help="the pool's rollup; --preview: where a reservation would go; `timeline`: over time")
    p.add_argument("--preview", action="store_true",
                   help="where `reserve` with these flags would place now (or --earliest), booking nothing")
    _shape_flags(p, required=False)
    p.set_defaults(run=commands.capacity)
    views = p.add_subparsers(dest="view", required=False, metavar="VIEW")
    t = views.add_parser("timeline", parents=[common], help="booked and free GPUs per time bucket")
    t.add_argument("--from", dest="from_", help="+1h, ISO 8601 or epoch ms (default: this hour)")
    t.add_argument("--to", help="+1d, ISO 8601 or epoch ms (default: from plus 24h)")
    t.add_argument("--step", help="bucket width: 5m to 1d (default 1h)")
    t.set_defaults(run=commands.timeline)

    p = sub.add_parser("watch", parents=[common], help="print the tenant's events as they happen")
    p.add_argument("--type", action="append", help="only this event type (repeatable)")
    p.add_argument("--subject", help="only this subject, e.g. reservation/rsv_…")
    p.add_argument("--after", type=_bounded("--after", -2**63, 2**63 - 1),
                   help="resume after this event id (default: all kept events)")
    p.add_argument("--from-now", action="store_true", help="only events from now on")
    p.add_argument("--count", type=_bounded("--count", 0, 2**31 - 1), default=0,
                   help="stop after this many events (0: never)")
    p.set_defaults(run=commands.watch, stream=True)

    p = sub.add_parser("usage", parents=[common], help="the tenant's metered usage, by meter, pool and hours")
    p.add_argument("--meter", help="a meter (vm.grant.slot.hours) or a prefix ending in '.' (vm.reserved.)")
    p.add_argument("--only-pool", action="store_true", help="only the pool of --pool (or the connection's)")
    p.add_argument("--from", dest="from_", help="ISO 8601 or epoch ms (default: every hour kept)")
    p.add_argument("--to", help="ISO 8601 or epoch ms (default: now)")
    p.set_defaults(run=commands.usage)

    _node_commands(sub, common)

    p = sub.add_parser("confirmations", parents=[common], help="decide on an agent's held request")
    p.add_argument("decision", choices=["approve", "reject"])
    p.add_argument("confirmation_id", metavar="ID")
    p.set_defaults(run=commands.confirmation)
    return parser


def _node_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """`nodes …`: the operator's side of the node PKI (NodeAdmin), with root's token (--token, or
    the connection file's rootToken)."""
    p = sub.add_parser("nodes", parents=[common], help="operator: join tokens and certificates of nodes (root)")
    ops = p.add_subparsers(dest="op", required=True, metavar="OP")
    o = ops.add_parser("join-token", parents=[common],
                       help="a one-time join token for a node name in the pool (the secret is shown once)")
    o.add_argument("name", metavar="NODE_NAME")
    o.add_argument("--role", choices=("node", "node-tenant"), default="node")
    o.add_argument("--ttl", help="how long it can be used: 30m, 1h (default), up to 7d")
    o.set_defaults(run=commands.join_token)
    o = ops.add_parser("certificates", parents=[common], help="a node's certificates, newest first")
    o.add_argument("node_id", metavar="NODE_ID")
    o.set_defaults(run=commands.node_certificates)
    o = ops.add_parser("revoke", parents=[common],
                       help="revoke every certificate of a node (it cannot enrol again until readmitted), or one serial")
    target = o.add_mutually_exclusive_group(required=True)
    target.add_argument("node_id", metavar="NODE_ID", nargs="?")
    target.add_argument("--serial", help="only this certificate (hex, as `nodes certificates` shows it)")
    o.add_argument("--reason", required=True, help="why, kept with the revocation")
    o.set_defaults(run=commands.revoke_node)
    o = ops.add_parser("readmit", parents=[common], help="let a revoked node enrol again, with a new join token")
    o.add_argument("node_id", metavar="NODE_ID")
    o.set_defaults(run=commands.readmit_node)
    p.set_defaults(operator=True)


def _shape_flags(p: argparse.ArgumentParser, *, required: bool) -> None:
    """What a reservation asks for: `reserve`'s flags, and `capacity --preview`'s."""
    p.add_argument("--gpus", type=int, required=required,
                   help="how many GPUs (or MIG instances with --class gpu.mig, slots with --class gpu.slot)")
    p.add_argument("--class", dest="device_class", default="gpu", choices=("gpu", "gpu.mig", "gpu.slot"),
                   help="whole GPUs (default); MIG instances or time-slice/MPS slots in a pool that shares its GPUs")
    p.add_argument("--profile", default="", help="the MIG profile of the instances, e.g. 1g.10gb (--class gpu.mig)")
    p.add_argument("--topology", default="", help="nvlink-all, numa or any (default any)")
    p.add_argument("--gang", type=int, metavar="NODES",
                   help="a gang: this many nodes (2-64), each taking all of --gpus")
    p.add_argument("--topology-key", default="", metavar="LABEL",
                   help="with --gang: every node shares one value of this label, e.g. fabric.domain")
    p.add_argument("--for", dest="duration", default="1h", help="8h, 90m, 1h30m, 2d12h... (default 1h)")
    p.add_argument("--start", help="+2h, an ISO 8601 time or epoch ms (default: now)")
    p.add_argument("--spot", action="store_true",
                   help="spot: a regular reservation that needs the GPUs may take them after the pool's notice")
    p.add_argument("--kubernetes", action="store_true",
                   help="binding kubernetes: the node's kubelet gets the GPUs (an owned pool with policy.kubernetes)")
    p.add_argument("--cpus", type=_bounded("--cpus", 0, 4096), metavar="N",
                   help="host CPUs per node, 0 to 4096 (default: the pool's per-GPU share)")
    p.add_argument("--memory", type=_bounded("--memory", 0, 65536), metavar="GIB",
                   help="host memory per node in GiB, 0 to 65536 (default: the pool's per-GPU share)")
    p.add_argument("--node-profile", metavar="ID[:VERSION]",
                   help="binding node: lease whole machines of --gpus GPUs running this profile (its newest"
                        " version unless one is named), in a pool with policy.tenantRoot")
    p.add_argument("--earliest", action="store_true",
                   help="start at the earliest moment the whole request fits (instead of --start)")
    p.add_argument("--horizon", metavar="DURATION",
                   help="with --earliest: how far ahead to search, up to 60d (default 14d)")


def _bounded(flag: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: a whole number from lo to hi."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, {lo} to {hi}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{flag} must be {lo} to {hi}")
        return value

    return parse
