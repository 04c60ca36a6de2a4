"""The picker's gRPC-over-HTTP/2 transport, apart from the ext_proc protocol it carries.

``start_server(routes, host, port, limits=...)`` listens with the hand-written frame layer (``h2server``); the
``h2`` package's frame layer (``h2lib``, the same handlers and limits) exists to be measured against it
(``loraplane bench picker``: docs/benchmarks.md).

Handlers are plain objects: ``on_message(bytes) -> list[bytes]`` per gRPC message and ``on_close()`` when the
stream ends for any reason; a handler with a ``bind(push)`` method is given ``push(messages)`` to answer later
(a request the picker holds in its flow-control queue). The client's half-close (END_STREAM) only means no more
messages, as in gRPC: while the handler's ``replies_pending`` is true the call stays open, and its trailers follow
the push that leaves none pending (a reset or a lost connection still ends it at once). A handler that raises ``GrpcStatusError`` ends its call
with that status, any other exception with INTERNAL; a malformed frame ends the connection with GOAWAY.

Nothing a peer sends is held without a bound (``TransportLimits``): a message whose declared length is over the
limit ends its stream (RESOURCE_EXHAUSTED) before a byte of it is buffered; a header block (HEADERS plus
CONTINUATION) over its limit ends the connection (ENHANCE_YOUR_CALM); a decoded header list over its limit ends
the stream; a frame over the advertised SETTINGS_MAX_FRAME_SIZE ends the connection (FRAME_SIZE_ERROR); streams
beyond SETTINGS_MAX_CONCURRENT_STREAMS are refused (RST_STREAM REFUSED_STREAM); client stream ids must be odd and
increasing (else GOAWAY PROTOCOL_ERROR); a stream silent for longer than the idle timeout is reset (CANCEL); a
stream we end before the peer does is reset with NO_ERROR after its trailers (the peer stops sending); more than
``max_peer_resets_per_s`` streams reset by the peer in a second ends the connection (ENHANCE_YOUR_CALM); the
connection receive window is given back only as messages complete, so unfinished messages hold at most one
window; our DATA waits for the peer's windows; a peer that does not read our answers is not read either (its
frames wait in its own buffers).
"""

from loraplane.picker.transport.grpc import GrpcStatusError, Routes, StreamHandler, TransportLimits
from loraplane.picker.transport.listen import FRAME_LAYERS, FrameLayer, GrpcH2Server, start_server

__all__ = ["FRAME_LAYERS", "FrameLayer", "GrpcH2Server", "GrpcStatusError", "Routes", "StreamHandler", "TransportLimits", "start_server"]
