"""The hand-written HTTP/2 frame layer: a small gRPC server over HTTP/2 cleartext (prior knowledge) on asyncio.

Envoy's ext_proc client needs little of HTTP/2: bidirectional streams, flow control, PING and SETTINGS. This
module implements exactly that on an ``asyncio.Protocol``: frames are parsed from each read, every reply produced
by one read goes out in one write, DATA payloads are passed on as slices of the read, and response headers and
trailers are pre-encoded HPACK literals (no dynamic table on our side). Request headers are decoded by
``hpack_decoder`` with a 0-byte table, so only ``:path`` is ever decoded. The handlers and the limits it enforces
are described in ``loraplane.picker.transport``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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
from loraplane.picker.transport.hpack_decoder import HpackDecoder, HpackError

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x1, 0x3, 0x4
SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x5, 0x6
MAX_WINDOW = (1 << 31) - 1
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x0, 0x1, 0x3, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _frame_header(kind, flags, stream_id, len(payload)) + payload


def _frame_header(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    return struct.pack(">IBBI", length, kind, flags, stream_id)[1:]


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK 'literal header field without indexing, new name', no Huffman."""
    return b"\x00" + _hpack_int(len(name)) + name + _hpack_int(len(value)) + value


def _hpack_int(n: int, prefix_bits: int = 7) -> bytes:
    limit = (1 << prefix_bits) - 1
    if n < limit:
        return bytes((n,))
    out, n = bytearray((limit,)), n - limit
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_RESPONSE_HEADERS = b"\x88" + _literal(b"content-type", b"application/grpc")  # 0x88 = indexed ":status: 200"


def _trailers(status: int, message: str = "") -> bytes:
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        block += _literal(b"grpc-message", message.encode("ascii", "replace")[:512])
    return block


_OK_TRAILERS = _trailers(GRPC_OK)


@dataclass
class _Stream:
    handler: StreamHandler | None
    last_frame_at: float = 0.0
    remote_open: bool = True
    buffer: bytearray = field(default_factory=bytearray)
    headers_sent: bool = False
    send_window: int = 65_535
    pending: bytearray = field(default_factory=bytearray)
    end_after_pending: bool = False
    trailers: bytes = _OK_TRAILERS


class GrpcH2Protocol(asyncio.Protocol):
    """One HTTP/2 connection from a gRPC client."""

    def __init__(self, routes: Routes, connections: set[Connection] | None = None,
                 limits: TransportLimits | None = None, clock: Callable[[], float] | None = None) -> None:
        """Serve ``routes`` on this connection (registered in ``connections`` while open); ``clock`` (seconds,
        monotonic) defaults to the event loop's."""
        self.routes = routes
        self.connections = connections if connections is not None else set()
        self.limits = limits or TransportLimits()
        #: the derived limits, computed once (they are read on every frame)
        self.max_frame = self.limits.max_frame_bytes
        self.connection_window = self.limits.connection_window_bytes
        self._clock = clock
        self._reaper: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.inbox = bytearray()
        self.outbox: list[bytes | memoryview] = []
        self.preface_seen = False
        # we ask for a 0-byte HPACK table: then only the headers we read need decoding (see hpack_lite)
        self.decoder = HpackDecoder(wanted=frozenset({b":path"}))
        self.streams: dict[int, _Stream] = {}
        self.peer_initial_window = 65_535
        self.peer_max_frame = 16_384
        self.conn_send_window = 65_535
        #: DATA bytes received, bytes held in partial messages, bytes the peer has been given back (WINDOW_UPDATE)
        self.received = self.buffered = self.acked = 0
        self.header_block: tuple[int, int, bytearray] | None = None  # (stream, flags, fragments) awaiting CONTINUATION
        self.last_stream_id = 0
        #: the latest streams we reset (RST_STREAM sent): trailers the peer sent before it saw the reset are ignored
        self.reset_ids: dict[int, None] = {}
        self._peer_resets = 0
        self._peer_resets_since = 0.0
        self.closed = False

    # --- asyncio.Protocol ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Send our SETTINGS: large windows and frames, so the peer rarely waits on us."""
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's
        assert self.transport is not None
        self.connections.add(self)
        limits = self.limits
        settings = struct.pack(">HIHIHIHIHI", SETTINGS_HEADER_TABLE_SIZE, 0, SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW,
                               SETTINGS_MAX_FRAME_SIZE, limits.max_frame_bytes,
                               SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams,
                               SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_header_list_bytes)
        window_update = struct.pack(">I", limits.connection_window_bytes - 65_535)
        self.transport.write(_frame(SETTINGS, 0, 0, settings) + _frame(WINDOW_UPDATE, 0, 0, window_update))
        self._schedule_reaper()

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def _schedule_reaper(self) -> None:
        interval = max(0.05, self.limits.stream_idle_timeout_s / 4)
        self._reaper = asyncio.get_running_loop().call_later(interval, self._reap_idle)

    def _reap_idle(self) -> None:
        """Reset streams that have been silent for longer than the idle timeout."""
        if self.closed:
            return
        horizon = self._now() - self.limits.stream_idle_timeout_s
        for stream_id, stream in list(self.streams.items()):
            if stream.last_frame_at < horizon:
                self._reset(stream_id, CANCEL)
        self._flush()
        self._schedule_reaper()

    def _reset(self, stream_id: int, code: int) -> None:
        """RST_STREAM ``code`` and forget the stream."""
        self.outbox.append(_frame(RST_STREAM, 0, stream_id, struct.pack(">I", code)))
        self.reset_ids[stream_id] = None
        if len(self.reset_ids) > 4 * self.limits.max_concurrent_streams:
            del self.reset_ids[next(iter(self.reset_ids))]
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.remote_open = False
        self._drop(stream_id)

    def pause_writing(self) -> None:
        """The peer reads our answers slower than it sends (a PING flood that never reads its ACKs, say): stop
        reading its frames until our write buffer drains, so nothing it sends grows it."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        """Our write buffer drained: read the peer's frames again."""
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        """Close every open stream's handler."""
        self.closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        self.connections.discard(self)
        for stream_id in list(self.streams):
            self._drop(stream_id)

    def data_received(self, data: bytes) -> None:
        """Parse every complete frame, then write all replies at once."""
        try:
            self._parse(data)
        except _ConnectionError as exc:
            log.warning("closing an HTTP/2 connection: %s", exc)
            self.outbox.append(_frame(GOAWAY, 0, 0, struct.pack(">II", 0, exc.code) + str(exc).encode()[:200]))
            self._flush()
            if self.transport is not None:
                self.transport.close()
            return
        self._flush()

    # --- frames -----------------------------------------------------------------------------------------------

    def _parse(self, data: bytes) -> None:
        """Handle the complete frames in ``data`` (after any partial frame kept from earlier reads).

        Frames are parsed straight from the read when nothing was pending (the usual case), and DATA payloads are
        passed on as memoryview slices: a 64 KiB message is copied once on its way in, not five times.
        """
        if self.inbox:
            self.inbox += data
            data = bytes(self.inbox)
            self.inbox.clear()
        if not self.preface_seen:
            if len(data) < len(PREFACE):
                self.inbox += data
                return
            if data[: len(PREFACE)] != PREFACE:
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 prior-knowledge connection")
            data = data[len(PREFACE) :]
            self.preface_seen = True
        offset, size = 0, len(data)
        view = memoryview(data)
        max_frame = self.max_frame
        while size - offset >= 9:
            length = int.from_bytes(data[offset : offset + 3], "big")
            if length > max_frame:
                raise _ConnectionError(FRAME_SIZE_ERROR, "frame larger than our SETTINGS_MAX_FRAME_SIZE")
            end = offset + 9 + length
            if size < end:
                break
            kind, flags = data[offset + 3], data[offset + 4]
            stream_id = int.from_bytes(data[offset + 5 : offset + 9], "big") & 0x7FFFFFFF
            if kind == DATA and self.header_block is None:
                self._on_data(stream_id, flags, view[offset + 9 : end])
            else:
                self._on_frame(kind, flags, stream_id, data[offset + 9 : end])
            offset = end
        if offset < size:
            self.inbox += data[offset:]

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.header_block is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == HEADERS:
            self._on_headers(stream_id, flags, payload)
        elif kind == CONTINUATION:
            if self.header_block is None or self.header_block[0] != stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
            self.header_block[2].extend(payload)
            if len(self.header_block[2]) > self.limits.max_header_block_bytes:
                raise _ConnectionError(ENHANCE_YOUR_CALM, "header block larger than "
                                       f"{self.limits.max_header_block_bytes} bytes")
            if flags & END_HEADERS:
                sid, first_flags, block = self.header_block
                self.header_block = None
                self._on_header_block(sid, first_flags, bytes(block))
        elif kind == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self.outbox.append(_frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == RST_STREAM:
            if stream_id == 0 or len(payload) != 4:
                raise _ConnectionError(PROTOCOL_ERROR if stream_id == 0 else FRAME_SIZE_ERROR, "bad RST_STREAM")
            if (stream := self.streams.get(stream_id)) is not None:
                stream.remote_open = False
                self._count_peer_reset()
            self._drop(stream_id)
        elif kind == GOAWAY and self.transport is not None:
            self.transport.close()
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored, as the spec allows

    def _count_peer_reset(self) -> None:
        now = self._now()
        if now - self._peer_resets_since >= 1.0:
            self._peer_resets, self._peer_resets_since = 0, now
        self._peer_resets += 1
        if self._peer_resets > self.limits.max_peer_resets_per_s:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "too many streams reset by the peer")

    def _on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = value
        self.outbox.append(_frame(SETTINGS, ACK, 0))
        self._send_pending()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE must be 4 bytes")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if increment == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        if stream_id == 0:
            self.conn_send_window += increment
            if self.conn_send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window above 2^31-1")
        elif (stream := self.streams.get(stream_id)) is not None:
            stream.send_window += increment
            if stream.send_window > MAX_WINDOW:
                self._reset(stream_id, FLOW_CONTROL_ERROR)
        self._send_pending()

    def _on_headers(self, stream_id: int, flags: int, frame_payload: bytes) -> None:
        if stream_id == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = _strip_padding(flags, memoryview(frame_payload))
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if len(payload) > self.limits.max_header_block_bytes:
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"header block larger than {self.limits.max_header_block_bytes} bytes")
        if flags & END_HEADERS:
            self._on_header_block(stream_id, flags, bytes(payload))
        else:
            self.header_block = (stream_id, flags, bytearray(payload))

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        # decoded even for a stream that is refused: the HPACK table must follow every block
        try:
            headers = self.decoder.decode(block)
        except (HpackError, IndexError) as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"header compression error: {exc}") from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            stream.last_frame_at = self._now()
            if flags & END_STREAM:
                self._half_closed(stream_id, stream)
            return
        if stream_id <= self.last_stream_id:
            if stream_id in self.reset_ids:  # trailers of a stream we reset, sent before the peer saw it
                return
            raise _ConnectionError(PROTOCOL_ERROR, f"stream id {stream_id} is not above {self.last_stream_id}")
        if not stream_id & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"even stream id {stream_id} from a client")
        self.last_stream_id = stream_id
        if len(self.streams) >= self.limits.max_concurrent_streams:
            self._reset(stream_id, REFUSED_STREAM)
            return
        if self.decoder.last_list_size > self.limits.max_header_list_bytes:
            self.streams[stream_id] = _Stream(None, send_window=self.peer_initial_window)
            self._end_early(stream_id, flags, _trailers(GRPC_RESOURCE_EXHAUSTED, "header list larger than "
                                                        f"{self.limits.max_header_list_bytes} bytes"))
            return
        path = next((v for k, v in headers if k == b":path"), b"").decode("latin-1")
        factory = self.routes.get(path)
        handler = factory() if factory else None
        self.streams[stream_id] = _Stream(handler, last_frame_at=self._now(), send_window=self.peer_initial_window)
        bind = getattr(handler, "bind", None)
        if bind is not None:  # the handler may answer later too
            bind(functools.partial(self.push, stream_id))
        if factory is None:
            self._end_early(stream_id, flags, _trailers(GRPC_UNIMPLEMENTED, f"unknown method {path}"))
            return
        if flags & END_STREAM:
            self.streams[stream_id].remote_open = False
            self._finish(stream_id)

    def _end_early(self, stream_id: int, flags: int, trailers: bytes) -> None:
        """Answer a stream the transport refuses with ``trailers`` at once."""
        if flags & END_STREAM:
            self.streams[stream_id].remote_open = False
        self._finish(stream_id, trailers)

    def _on_data(self, stream_id: int, flags: int, payload: memoryview) -> None:
        self.received += len(payload)
        if self.received - self.acked > self.connection_window:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        stream = self.streams.get(stream_id)
        if stream is None or stream.handler is None:
            if stream_id == 0 or (stream is None and stream_id > self.last_stream_id):
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            _strip_padding(flags, payload)
            if flags & END_STREAM and stream is not None:
                stream.remote_open = False
            return  # a stream we already finished or reset: ignore late data
        stream.last_frame_at = self._now()
        payload = _strip_padding(flags, payload)
        buffer = stream.buffer
        if buffer:  # the rest of a message split across frames
            buffer += payload
            self.buffered += len(payload)
            payload = memoryview(b"")
        limit = self.limits.max_message_bytes
        while True:
            source = buffer or payload
            if len(source) >= 5 and (size := int.from_bytes(source[1:5], "big")) > limit:
                # refused from its declared length: nothing of it is kept, the rest of it is ignored as it comes
                self._discard_buffer(stream)
                self._end_early(stream_id, flags, _trailers(GRPC_RESOURCE_EXHAUSTED, f"message of {size} bytes is "
                                                            f"larger than the limit of {limit} bytes"))
                return
            if len(source) < 5 or len(source) < 5 + size:
                break
            if source[0]:
                self._finish(stream_id, _trailers(GRPC_UNIMPLEMENTED, "compressed messages are not supported"))
                return
            if source is buffer:
                with memoryview(buffer) as view:
                    message = bytes(view[5 : 5 + size])
                del buffer[: 5 + size]
                self.buffered -= 5 + size
            else:
                message = bytes(payload[5 : 5 + size])  # the only copy of a message that came in one frame
                payload = payload[5 + size :]
            try:
                replies = answer(stream.handler, message)
            except GrpcStatusError as exc:
                self._finish(stream_id, _trailers(exc.code, exc.message))
                return
            self._send_messages(stream_id, stream, replies)
            if stream.handler is None:
                return
        if payload:
            buffer += payload  # the start of a message that continues in a later frame
            self.buffered += len(payload)
        if flags & END_STREAM:
            self._half_closed(stream_id, stream)

    def _half_closed(self, stream_id: int, stream: _Stream) -> None:
        """The peer sends no more messages: end the call, unless its handler still has replies to push (a request
        held in the flow-control queue); its trailers then follow the push that leaves none pending."""
        stream.remote_open = False
        if not getattr(stream.handler, "replies_pending", False):
            self._finish(stream_id)

    # --- sending ----------------------------------------------------------------------------------------------

    def _send_messages(self, stream_id: int, stream: _Stream, messages: Iterable[bytes]) -> None:
        for message in messages:
            if not stream.headers_sent:
                self.outbox.append(_frame(HEADERS, END_HEADERS, stream_id, _RESPONSE_HEADERS))
                stream.headers_sent = True
            prefix = b"\x00" + len(message).to_bytes(4, "big")
            if stream.pending or len(message) + 5 > min(stream.send_window, self.conn_send_window):
                stream.pending += prefix + message  # flow control holds it back: sent as windows open
            else:
                self._send_now(stream_id, stream, prefix, message)
        self._send_stream(stream_id, stream)

    def push(self, stream_id: int, messages: list[bytes]) -> None:
        """Send messages a handler produced after ``on_message`` returned (nothing if the stream is gone); the
        trailers too when the peer has half-closed and the handler has no more replies pending."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.handler is None or self.closed:
            return
        self._send_messages(stream_id, stream, messages)
        if not stream.remote_open and not getattr(stream.handler, "replies_pending", False):
            self._finish(stream_id)
        self._flush()

    def _send_now(self, stream_id: int, stream: _Stream, prefix: bytes, message: bytes) -> None:
        """DATA frames for one message the windows allow, as slices of it: the only copy is the final join."""
        limit = self.peer_max_frame
        first = min(len(message), limit - len(prefix))
        view = memoryview(message)
        self.outbox += (_frame_header(DATA, 0, stream_id, len(prefix) + first), prefix, view[:first])
        for start in range(first, len(message), limit):
            chunk = view[start : start + limit]
            self.outbox += (_frame_header(DATA, 0, stream_id, len(chunk)), chunk)
        stream.send_window -= len(prefix) + len(message)
        self.conn_send_window -= len(prefix) + len(message)

    def _send_stream(self, stream_id: int, stream: _Stream) -> None:
        pending = stream.pending
        while pending:
            allowed = min(len(pending), stream.send_window, self.conn_send_window, self.peer_max_frame)
            if allowed <= 0:
                return
            self.outbox.append(_frame(DATA, 0, stream_id, bytes(pending[:allowed])))
            del pending[:allowed]
            stream.send_window -= allowed
            self.conn_send_window -= allowed
        if stream.end_after_pending:
            self.outbox.append(_frame(HEADERS, END_HEADERS | END_STREAM, stream_id, stream.trailers))
            self._drop(stream_id)

    def _send_pending(self) -> None:
        for stream_id, stream in list(self.streams.items()):
            if stream.pending or stream.end_after_pending:
                self._send_stream(stream_id, stream)

    def _finish(self, stream_id: int, trailers: bytes = _OK_TRAILERS) -> None:
        """End the call: trailers (after any data still waiting on flow control), then forget the stream."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if stream.handler is not None:
            stream.handler.on_close()
            stream.handler = None
        if not stream.headers_sent and not stream.pending:
            trailers = b"\x88" + _literal(b"content-type", b"application/grpc") + trailers  # trailers-only
        stream.trailers = trailers
        stream.end_after_pending = True
        self._send_stream(stream_id, stream)

    def _discard_buffer(self, stream: _Stream) -> None:
        self.buffered -= len(stream.buffer)
        stream.buffer.clear()

    def _drop(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            return
        self._discard_buffer(stream)
        if stream.remote_open and not self.closed:  # our trailers went out first: tell the peer to stop sending
            stream.remote_open = False
            self._reset(stream_id, NO_ERROR)
        if stream.handler is not None:
            stream.handler.on_close()
            stream.handler = None

    def shutdown(self) -> None:
        """GOAWAY (no error) and close: the server is stopping."""
        if self.transport is not None and not self.closed:
            self.transport.write(_frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0)))
            self.transport.close()

    def _flush(self) -> None:
        released = self.received - self.buffered - self.acked  # bytes received and no longer held
        if released >= min(1 << 20, self.connection_window // 4):
            self.outbox.append(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", released)))
            self.acked += released
        if self.outbox and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.outbox))
        self.outbox.clear()


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _strip_padding(flags: int, payload: memoryview) -> memoryview:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise _ConnectionError(PROTOCOL_ERROR, "bad padding")
    return payload[1 : len(payload) - payload[0]]
