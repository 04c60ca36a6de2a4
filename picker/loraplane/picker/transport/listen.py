"""A listening socket serving gRPC with one of the two frame layers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Literal

from loraplane.picker.transport.grpc import Connection, Routes, TransportLimits
from loraplane.picker.transport.h2server import GrpcH2Protocol

#: "hand": the hand-written frame layer (``h2server``, the default); "h2lib": the ``h2`` package's (``h2lib``)
FrameLayer = Literal["hand", "h2lib"]
FRAME_LAYERS: tuple[FrameLayer, ...] = ("hand", "h2lib")


class GrpcH2Server:
    """A listening socket and its open connections."""

    def __init__(self, server: asyncio.Server, connections: set[Connection]) -> None:
        """Wrap a started ``asyncio.Server``."""
        self.server = server
        self.connections = connections

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self, grace: float = 2.0) -> None:
        """Stop accepting, send GOAWAY on every connection, and wait (at most ``grace`` s) for them to go."""
        self.server.close()
        for connection in list(self.connections):
            connection.shutdown()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.server.wait_closed(), grace)


async def start_server(routes: Routes, host: str, port: int, reuse_port: bool = True,
                       limits: TransportLimits | None = None, frame_layer: FrameLayer = "hand") -> GrpcH2Server:
    """Listen on ``host:port`` (port 0 picks one) and serve ``routes`` within ``limits``."""
    limits = limits or TransportLimits()
    connections: set[Connection] = set()
    factory: Callable[[], asyncio.Protocol]
    if frame_layer == "h2lib":
        try:
            from loraplane.picker.transport.h2lib import H2LibProtocol
        except ImportError as exc:  # the h2 package is a dev extra (tests and bench picker --frame-layers)
            raise RuntimeError("the h2lib frame layer needs the h2 package (pip install h2)") from exc

        factory = functools.partial(H2LibProtocol, routes, connections, limits)
    else:
        factory = functools.partial(GrpcH2Protocol, routes, connections, limits)
    server = await asyncio.get_running_loop().create_server(factory, host, port, reuse_port=reuse_port)
    return GrpcH2Server(server, connections)
