"""`better-compute COMMAND`: run one command, print its answer, exit 0, 1 (a failed call) or 2 (usage)."""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from controlplane.client import parser as cli_parser
from controlplane.client.connection import Client, Connection, open_channel
from controlplane.client.errors import UsageError, error_json, require_utf8
from controlplane.client.render import Output


def connect(args: argparse.Namespace) -> Connection:
    return Connection.resolve(
        connection=args.connection, endpoint=args.endpoint, token=args.token, tenant=args.tenant, pool=args.pool,
        ca=getattr(args, "ca", None), operator=getattr(args, "operator", False), token_file=args.token_file,
    )


def run(args: argparse.Namespace, output: Output) -> None:
    conn = connect(args)
    with open_channel(conn) as channel:
        client = Client(channel, conn)
        if getattr(args, "stream", False):
            for event in args.run(client, args):
                output.event(event)
        elif getattr(args, "progress", False):
            with output.progress(f"reserving {args.gpus} GPUs") as on_state:
                answer = args.run(client, args, on_state)
            output.show(answer)
        else:
            output.show(args.run(client, args))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = cli_parser.build().parse_args(argv)
    output = Output.choose(args.json)
    try:
        require_utf8(argv, "argument")
        run(args, output)
    except UsageError as exc:
        print(f"better-compute: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        output.error(error_json(err))
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_gone()
    return 0


def _reader_gone() -> int:
    """Standard output's reader went away (`list --json | head`): stop quietly, as a tool killed by
    SIGPIPE does (exit 141), with what is left unflushed sent nowhere instead of a traceback at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13
