"""The gRPC floor: a generic unary handler that returns its request bytes unchanged.

No protobuf, no auth, no database: what remains is grpc.aio, HTTP/2 over loopback and the event
loop on both sides. `python -m bench.echo PORT` serves it as its own process, the way the control
plane is served, so the two are measured under the same process model.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc

METHOD = "/bench.Echo/Echo"


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def _handler() -> grpc.GenericRpcHandler:
    # No serializers: the handler sees and returns raw bytes (identity serialization).
    return grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
    )


async def serve(listen: str) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(),))
    port = server.add_insecure_port(listen)
    await server.start()
    return server, port


def echo_call(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    """The client side: bytes in, bytes out (no serializers)."""
    return channel.unary_unary(METHOD)


async def _main(port: int) -> None:
    server, _ = await serve(f"127.0.0.1:{port}")
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await server.stop(grace=1)


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1])))
