"""What both HTTP/2 frame layers share: the handler interface, gRPC status codes and the limits of a connection."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

GRPC_OK, GRPC_INVALID_ARGUMENT, GRPC_NOT_FOUND, GRPC_RESOURCE_EXHAUSTED = 0, 3, 5, 8
GRPC_UNIMPLEMENTED, GRPC_INTERNAL = 12, 13

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransportLimits:
    """What one connection may make the server hold (``loraplane.picker.transport`` says what each limit answers)."""

    #: largest gRPC message (its declared length prefix), bytes
    max_message_bytes: int = 4 << 20
    #: largest decoded header list (RFC 7541 sizes: name + value + 32 per field), bytes
    max_header_list_bytes: int = 16 << 10
    #: largest header block as sent (HEADERS plus CONTINUATION fragments), bytes
    max_header_block_bytes: int = 64 << 10
    #: open streams per connection (SETTINGS_MAX_CONCURRENT_STREAMS)
    max_concurrent_streams: int = 100
    #: seconds a stream may go without a frame from the peer before it is reset
    stream_idle_timeout_s: float = 300.0
    #: open streams the peer may reset per second (more is a "rapid reset" flood: GOAWAY ENHANCE_YOUR_CALM)
    max_peer_resets_per_s: int = 1000

    @property
    def max_frame_bytes(self) -> int:
        """The SETTINGS_MAX_FRAME_SIZE we advertise: one largest message fits one frame."""
        return min((1 << 24) - 1, max(1 << 14, self.max_message_bytes + 5))

    @property
    def connection_window_bytes(self) -> int:
        """Our receive window per connection: DATA bytes a peer may send that we still hold (partial messages)."""
        return 4 * self.max_frame_bytes


class GrpcStatusError(Exception):
    """Raised by a handler to end its call with a gRPC status other than OK."""

    def __init__(self, code: int, message: str) -> None:
        """``code`` is a gRPC status code (5 NOT_FOUND, 12 UNIMPLEMENTED ...)."""
        super().__init__(message)
        self.code = code
        self.message = message


class StreamHandler(Protocol):
    """Serves one gRPC call: messages in, serialized messages out."""

    def on_message(self, message: bytes) -> list[bytes]:
        """Answer one request message."""
        ...

    def on_close(self) -> None:
        """The stream is over (client half-close with no replies pending, reset or connection loss)."""
        ...


class Connection(Protocol):
    """An open connection of either frame layer, as its server sees it."""

    def shutdown(self) -> None:
        """GOAWAY (no error) and close: the server is stopping."""
        ...


#: method path (``/package.Service/Method``) -> a factory of handlers, one per call
Routes = Mapping[str, Callable[[], StreamHandler]]


def answer(handler: StreamHandler, message: bytes) -> list[bytes]:
    """``handler``'s replies to ``message``; a handler that fails for another reason is a ``GrpcStatusError`` INTERNAL."""
    try:
        return handler.on_message(message)
    except GrpcStatusError:
        raise
    except Exception:
        log.exception("gRPC handler failed")
        raise GrpcStatusError(GRPC_INTERNAL, "internal error") from None
