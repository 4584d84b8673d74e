"""How the servicers reach gRPC's server: as generic handlers only.

grpcio's generated `add_*Servicer_to_server` also registers every method of the service with the
core (`add_registered_method_handlers`). The asyncio server then keeps one pending request per
registered method and, for every call it accepts, waits on all of them at once (`asyncio.wait`
over each pending future: one done-callback added to and removed from each of about 75 per call),
which cost about 4 % of the control plane's time per create. Generic handlers are found by the
method's name instead (one dict per service, the busiest service first), with a single pending
request for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc


class GenericOnly:
    """The one part of a server the generated `add_*Servicer_to_server` functions use, taking their
    handlers as generic handlers and leaving the methods unregistered."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        """Not registered (see the module): the generic handler added beside it serves them."""
