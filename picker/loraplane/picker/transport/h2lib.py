"""The ``h2`` package (hyper-h2) as the transport's frame layer: the same handlers and message limits as ``h2server``.

It exists to be measured against the hand-written layer (``loraplane bench picker``, section ``frame_layers``;
``--transport h2lib``) and is not the picker's default. Differences that stay: ``h2`` treats a stream past
SETTINGS_MAX_CONCURRENT_STREAMS and a header list past SETTINGS_MAX_HEADER_LIST_SIZE as connection errors (GOAWAY,
every call on the connection ends) where ``h2server`` refuses only that stream, and there is no idle-stream reaper.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError, StreamClosedError, StreamIDTooLowError
from h2.settings import SettingCodes, Settings
from hyperframe.frame import GoAwayFrame

from loraplane.picker.transport.grpc import (
    GRPC_OK,
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_UNIMPLEMENTED,
    Connection,
    GrpcStatusError,
    Routes,
    StreamHandler,
    TransportLimits,
    answer,
)

log = logging.getLogger(__name__)

_RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


@dataclass
class _Call:
    handler: StreamHandler | None
    buffer: bytearray = field(default_factory=bytearray)
    #: flow-controlled bytes received but not given back (they are held in ``buffer``)
    unacked: int = 0
    headers_sent: bool = False
    pending: bytearray = field(default_factory=bytearray)
    trailers: list[tuple[bytes, bytes]] | None = None
    remote_open: bool = True


class H2LibProtocol(asyncio.Protocol):
    """One HTTP/2 connection from a gRPC client, framed by ``h2``."""

    def __init__(self, routes: Routes, connections: set[Connection], limits: TransportLimits) -> None:
        """Serve ``routes`` within ``limits`` (registered in ``connections`` while open)."""
        self.routes, self.connections, self.limits = routes, connections, limits
        self.conn = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.calls: dict[int, _Call] = {}
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Our SETTINGS (the same values as ``h2server``'s) and the connection window."""
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)
        limits = self.limits
        self.conn.local_settings = Settings(client=False, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes,
            SettingCodes.MAX_FRAME_SIZE: limits.max_frame_bytes,
            SettingCodes.INITIAL_WINDOW_SIZE: limits.max_frame_bytes,
        })
        self.conn.max_inbound_frame_size = limits.max_frame_bytes  # h2 reads it from the settings only in __init__
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(limits.connection_window_bytes - 65_535)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        """Close every open call's handler."""
        self.connections.discard(self)
        for stream_id in list(self.calls):
            self._close_handler(self.calls.pop(stream_id))
        self.transport = None

    def data_received(self, data: bytes) -> None:
        """Feed ``h2``, handle its events, write everything it has to send."""
        try:
            events = self.conn.receive_data(data)
        except ProtocolError as exc:
            log.warning("closing an HTTP/2 connection: %s", exc)
            data = self.conn.data_to_send()
            if not data:  # h2 answers a bad preface with nothing: say why, as h2server does
                data = GoAwayFrame(0, error_code=ErrorCodes.PROTOCOL_ERROR).serialize()
            if self.transport is not None:
                self.transport.write(data)
            if self.transport is not None:
                self.transport.close()
            return
        for event in events:
            try:
                self._on_event(event)
            except (StreamClosedError, StreamIDTooLowError) as exc:  # a later RST_STREAM of the same read closed it
                if (call := self.calls.pop(exc.stream_id, None)) is not None:
                    self._close_handler(call)
        self._flush()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, RequestReceived):
            self._on_request(event.stream_id, dict(event.headers).get(b":path", b"").decode("latin-1"))
        elif isinstance(event, DataReceived):
            self._on_data(event.stream_id, event.data, event.flow_controlled_length)
        elif isinstance(event, StreamEnded):
            if (call := self.calls.get(event.stream_id)) is not None:
                call.remote_open = False
                if not getattr(call.handler, "replies_pending", False):  # else the trailers follow its last push
                    self._finish(event.stream_id)
        elif isinstance(event, StreamReset):
            if (call := self.calls.pop(event.stream_id, None)) is not None:
                self._close_handler(call)
        elif isinstance(event, WindowUpdated):
            for stream_id in list(self.calls):
                self._send_pending(stream_id)
        elif isinstance(event, ConnectionTerminated) and self.transport is not None:
            self.transport.close()

    def _on_request(self, stream_id: int, path: str) -> None:
        factory = self.routes.get(path)
        call = self.calls[stream_id] = _Call(factory() if factory else None)
        if call.handler is None:
            self._finish(stream_id, GRPC_UNIMPLEMENTED, f"unknown method {path}")
            return
        bind = getattr(call.handler, "bind", None)
        if bind is not None:
            bind(functools.partial(self.push, stream_id))

    def _on_data(self, stream_id: int, data: bytes, flow_controlled: int) -> None:
        call = self.calls.get(stream_id)
        if call is None or call.handler is None:  # a call we already ended: give the window back, drop the bytes
            self.conn.acknowledge_received_data(flow_controlled, stream_id)
            return
        buffer = call.buffer
        buffer += data
        call.unacked += flow_controlled
        while len(buffer) >= 5:
            size = int.from_bytes(buffer[1:5], "big")
            if size > self.limits.max_message_bytes:
                self._finish(stream_id, GRPC_RESOURCE_EXHAUSTED, f"message of {size} bytes is larger than the "
                             f"limit of {self.limits.max_message_bytes} bytes")
                return
            if len(buffer) < 5 + size:
                break
            if buffer[0]:
                self._finish(stream_id, GRPC_UNIMPLEMENTED, "compressed messages are not supported")
                return
            message = bytes(buffer[5 : 5 + size])
            del buffer[: 5 + size]
            try:
                replies = answer(call.handler, message)
            except GrpcStatusError as exc:
                self._finish(stream_id, exc.code, exc.message)
                return
            self._send(stream_id, replies)
            if call.handler is None:
                return
        released = call.unacked - len(buffer)  # only the bytes of an unfinished message stay unacknowledged
        if released > 0:
            self.conn.acknowledge_received_data(released, stream_id)
            call.unacked -= released

    def push(self, stream_id: int, messages: list[bytes]) -> None:
        """Send messages a handler produced after ``on_message`` returned (nothing if the call is gone); the
        trailers too when the peer has half-closed and the handler has no more replies pending."""
        call = self.calls.get(stream_id)
        if call is None or call.handler is None or self.transport is None:
            return
        try:
            self._send(stream_id, messages)
            if not call.remote_open and not getattr(call.handler, "replies_pending", False):
                self._finish(stream_id)
        except (StreamClosedError, StreamIDTooLowError):
            self._close_handler(self.calls.pop(stream_id))
        self._flush()

    def _send(self, stream_id: int, messages: list[bytes]) -> None:
        call = self.calls[stream_id]
        if messages and not call.headers_sent:
            self.conn.send_headers(stream_id, _RESPONSE_HEADERS)
            call.headers_sent = True
        for message in messages:
            call.pending += b"\x00" + len(message).to_bytes(4, "big") + message
        self._send_pending(stream_id)

    def _send_pending(self, stream_id: int) -> None:
        """DATA as far as the peer's windows allow, then the trailers once nothing is left."""
        call = self.calls.get(stream_id)
        if call is None:
            return
        while call.pending:
            allowed = min(len(call.pending), self.conn.local_flow_control_window(stream_id),
                          self.conn.max_outbound_frame_size)
            if allowed <= 0:
                return
            self.conn.send_data(stream_id, bytes(call.pending[:allowed]))
            del call.pending[:allowed]
        if call.trailers is not None:
            self.conn.send_headers(stream_id, call.trailers, end_stream=True)
            del self.calls[stream_id]
            if call.remote_open:  # we ended first: the peer should stop sending
                self.conn.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def _finish(self, stream_id: int, status: int = GRPC_OK, message: str = "") -> None:
        call = self.calls[stream_id]
        self._close_handler(call)
        trailers = [(b"grpc-status", str(status).encode())]
        if message:
            trailers.append((b"grpc-message", message.encode("ascii", "replace")[:512]))
        call.trailers = trailers if call.headers_sent else [*_RESPONSE_HEADERS, *trailers]  # trailers-only
        call.headers_sent = True
        if call.unacked:
            self.conn.acknowledge_received_data(call.unacked, stream_id)
            call.unacked = 0
        call.buffer.clear()
        self._send_pending(stream_id)

    @staticmethod
    def _close_handler(call: _Call) -> None:
        if call.handler is not None:
            call.handler.on_close()
            call.handler = None

    def shutdown(self) -> None:
        """GOAWAY (no error) and close: the server is stopping."""
        if self.transport is not None:
            self.conn.close_connection()
            self._flush()
            self.transport.close()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None:
            self.transport.write(data)
