"""The HTTP/2 transport frame by frame, over a real loopback socket, with the ``h2`` package as an independent client
(and raw frames where a well-behaved client cannot send what is tested).

The tests marked with ``LAYERS`` run against both frame layers (``hand``: the picker's, ``h2lib``: the ``h2``
package's); the limits the two answer differently run against the hand-written one, the picker's default.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import h2.events as ev
import hpack
import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import Frame, GoAwayFrame, HeadersFrame, RstStreamFrame

from loraplane.picker.transport import (
    FRAME_LAYERS,
    GrpcH2Server,
    GrpcStatusError,
    TransportLimits,
    start_server,
)
from loraplane.picker.transport.h2server import GrpcH2Protocol

LOOPBACK = "127.0.0.1"
ECHO, HOLD, FAIL, LATER = "/test.Echo/Call", "/test.Echo/Hold", "/test.Echo/Fail", "/test.Echo/Later"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
LIMITS = TransportLimits(max_message_bytes=1 << 20, max_header_list_bytes=4096, max_concurrent_streams=4)
LAYERS = pytest.mark.parametrize("layer", FRAME_LAYERS)


@dataclass
class Calls:
    """What the handlers saw: open handlers, messages, closes."""

    open: int = 0
    messages: list[bytes] = field(default_factory=list)
    closed: int = 0
    #: the ``Later`` handlers, in the order their calls opened
    later: list[Later] = field(default_factory=list)


class Echo:
    def __init__(self, calls: Calls, answer: bool = True) -> None:
        self.calls, self.answer = calls, answer
        calls.open += 1

    def on_message(self, message: bytes) -> list[bytes]:
        self.calls.messages.append(message)
        return [message] if self.answer else []

    def on_close(self) -> None:
        self.calls.open -= 1
        self.calls.closed += 1


class Failing(Echo):
    def on_message(self, message: bytes) -> list[bytes]:
        raise GrpcStatusError(5, "no such thing")


class Later(Echo):
    """Answers nothing at once and has replies pending until the test pushes its last (a request held in a queue)."""

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls, answer=False)
        calls.later.append(self)
        self.replies_pending = False
        self.push: Callable[[list[bytes]], None] | None = None

    def bind(self, push: Callable[[list[bytes]], None]) -> None:
        self.push = push

    def on_message(self, message: bytes) -> list[bytes]:
        self.replies_pending = True
        return super().on_message(message)

    def reply(self, messages: list[bytes], last: bool = True) -> None:
        self.replies_pending = not last
        assert self.push is not None
        self.push(messages)


@dataclass
class Served:
    server: GrpcH2Server
    calls: Calls

    @property
    def port(self) -> int:
        return self.server.port

    def buffered_bytes(self) -> int:
        """Bytes the hand-written layer holds for its peers: partial frames and partial messages."""
        total = 0
        for conn in self.server.connections:
            assert isinstance(conn, GrpcH2Protocol)
            total += len(conn.inbox) + sum(len(s.buffer) + len(s.pending) for s in conn.streams.values())
        return total


async def serve(layer: str, limits: TransportLimits = LIMITS) -> Served:
    calls = Calls()
    routes = {ECHO: lambda: Echo(calls), HOLD: lambda: Echo(calls, answer=False), FAIL: lambda: Failing(calls),
              LATER: lambda: Later(calls)}
    server = await start_server(routes, LOOPBACK, 0, reuse_port=False, limits=limits, frame_layer=layer)  # type: ignore[arg-type]
    return Served(server, calls)


@pytest.fixture(params=FRAME_LAYERS)
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    s = await serve(request.param)
    yield s
    await s.server.close(grace=0.5)


@pytest.fixture
async def hand() -> AsyncIterator[Served]:
    s = await serve("hand")
    yield s
    await s.server.close(grace=0.5)


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


def request_headers(path: str = ECHO, extra: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "picker"),
            ("content-type", "application/grpc"), ("te", "trailers"), *extra]


class Client:
    """An ``h2`` client connection over asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: H2Connection) -> None:
        self.reader, self.writer, self.conn = reader, writer, conn
        self.seen: list[ev.Event] = []
        self.eof = False

    @classmethod
    async def open(cls, port: int, settings: dict[int, int] | None = None) -> Client:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        conn = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        conn.initiate_connection()
        if settings:
            conn.update_settings(settings)
        client = cls(reader, writer, conn)
        await client.flush()
        await client.until(lambda: any(isinstance(e, ev.RemoteSettingsChanged) for e in client.seen))
        return client

    async def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def until(self, done: Callable[[], bool], seconds: float = 5.0) -> None:
        """Read and feed events until ``done()`` (or the connection ends, or the timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not done() and not self.eof:
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 16), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                return
            self.seen += self.conn.receive_data(data)
            await self.flush()

    async def wait(self, seconds: float) -> None:
        await self.until(lambda: False, seconds)

    def data(self, stream_id: int) -> bytes:
        return b"".join(e.data for e in self.seen if isinstance(e, ev.DataReceived) and e.stream_id == stream_id)

    def trailers(self, stream_id: int) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        for e in self.seen:
            if isinstance(e, ev.TrailersReceived | ev.ResponseReceived) and e.stream_id == stream_id:
                out.update(e.headers)
        return out

    def ended(self, stream_id: int) -> bool:
        return any(isinstance(e, ev.StreamEnded | ev.StreamReset) and e.stream_id == stream_id for e in self.seen)

    async def call(self, stream_id: int, body: bytes, path: str = ECHO) -> None:
        self.conn.send_headers(stream_id, request_headers(path))
        data, size = grpc_message(body), self.conn.max_outbound_frame_size
        for start in range(0, len(data), size):
            self.conn.send_data(stream_id, data[start : start + size], end_stream=start + size >= len(data))
        await self.flush()

    def close(self) -> None:
        self.writer.close()


@LAYERS
async def test_concurrent_calls_are_answered_on_their_own_streams(layer: str) -> None:
    served = await serve(layer)
    client = await Client.open(served.port)
    for i in range(4):
        await client.call(2 * i + 1, f"message {i}".encode() * 100)
    await client.until(lambda: all(client.ended(2 * i + 1) for i in range(4)))
    for i in range(4):
        assert client.data(2 * i + 1)[5:] == f"message {i}".encode() * 100
        assert client.trailers(2 * i + 1)[b"grpc-status"] == b"0"
    assert served.calls.open == 0 and served.calls.closed == 4
    client.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_our_data_waits_for_the_peers_window(layer: str) -> None:
    """A client with a 0-byte stream window gets the headers and no DATA; each WINDOW_UPDATE lets exactly that
    many bytes through, until the whole reply and its trailers are in."""
    served = await serve(layer)
    client = await Client.open(served.port, {SettingCodes.INITIAL_WINDOW_SIZE: 0})
    body = bytes(range(256)) * 64  # 16 KiB
    await client.call(1, body)
    await client.wait(0.3)
    assert client.data(1) == b"" and not client.ended(1), "DATA beyond a 0-byte window"
    granted = 0
    for step in (1000, 5000, 2000):
        client.conn.increment_flow_control_window(step, stream_id=1)
        await client.flush()
        granted += step
        await client.until(lambda: len(client.data(1)) >= granted, seconds=2)  # noqa: B023
        await client.wait(0.1)
        assert len(client.data(1)) == granted
    client.conn.increment_flow_control_window(len(body) + 5 - granted, stream_id=1)
    await client.flush()
    await client.until(lambda: client.ended(1))
    assert client.data(1) == grpc_message(body) and client.trailers(1)[b"grpc-status"] == b"0"
    client.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_the_receive_window_is_given_back_as_messages_complete(layer: str) -> None:
    """12 MiB of 900 KiB messages on one stream, sent by a client that honours our windows: it never blocks for
    good, because each complete message gives its bytes back."""
    served = await serve(layer)
    client = await Client.open(served.port)
    message = grpc_message(bytes(900 << 10))
    client.conn.send_headers(1, request_headers())
    sent, total = 0, 12 << 20
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while sent < total and loop.time() < deadline:
        window = min(client.conn.local_flow_control_window(1), client.conn.max_outbound_frame_size)
        if window <= 0:
            await client.until(lambda: client.conn.local_flow_control_window(1) > 0, seconds=2)
            continue
        offset = sent % len(message)
        chunk = message[offset : offset + window]
        client.conn.send_data(1, chunk)
        sent += len(chunk)
        await client.flush()
        await client.until(lambda: False, seconds=0)
    assert sent >= total, f"blocked after {sent} bytes"
    assert len(served.calls.messages) >= total // len(message)
    client.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_padded_data_is_unpadded(layer: str) -> None:
    served = await serve(layer)
    client = await Client.open(served.port)
    client.conn.send_headers(1, request_headers())
    client.conn.send_data(1, grpc_message(b"padded"), end_stream=True, pad_length=200)
    await client.flush()
    await client.until(lambda: client.ended(1))
    assert served.calls.messages == [b"padded"] and client.data(1) == grpc_message(b"padded")
    client.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_ping_is_acknowledged_with_its_payload(layer: str) -> None:
    served = await serve(layer)
    client = await Client.open(served.port)
    client.conn.ping(b"12345678")
    await client.flush()
    await client.until(lambda: any(isinstance(e, ev.PingAckReceived) for e in client.seen))
    assert [e.ping_data for e in client.seen if isinstance(e, ev.PingAckReceived)] == [b"12345678"]
    client.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_a_client_reset_closes_the_handler_and_frees_the_slot(layer: str) -> None:
    served = await serve(layer)
    client = await Client.open(served.port)
    for i in range(4):
        client.conn.send_headers(2 * i + 1, request_headers(HOLD))
        client.conn.send_data(2 * i + 1, grpc_message(b"half")[:3])
    await client.flush()
    await client.wait(0.2)
    assert served.calls.open == 4
    for i in range(4):
        client.conn.reset_stream(2 * i + 1, ErrorCodes.CANCEL)
    await client.flush()
    await client.wait(0.2)
    assert served.calls.open == 0 and served.calls.closed == 4
    await client.call(9, b"after")  # the 4 slots are free again
    await client.until(lambda: client.ended(9))
    assert client.trailers(9)[b"grpc-status"] == b"0"
    client.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_a_reset_right_behind_the_end_of_a_call_leaves_the_connection_serving(layer: str) -> None:
    """Envoy ends an ext_proc call and resets it in one write: the call's trailers cannot go out, and nothing else
    on the connection suffers."""
    served = await serve(layer)
    raw = await Raw.open(served.port)
    await raw.send(frame(HEADERS, END_HEADERS, 1, raw.block()) + frame(DATA, END_STREAM, 1, grpc_message(b"a"))
                   + frame(RST_STREAM, 0, 1, struct.pack(">I", ErrorCodes.CANCEL)))
    await raw.send(frame(HEADERS, END_HEADERS, 3, raw.block()) + frame(DATA, END_STREAM, 3, grpc_message(b"b")))
    await raw.read(ends(3))
    assert served.calls.messages == [b"a", b"b"] and served.calls.open == 0 and not raw.eof
    raw.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_a_half_closed_call_gets_the_replies_its_handler_pushes_later_then_its_trailers(layer: str) -> None:
    """The client's END_STREAM only means no more messages (gRPC bidi semantics, as grpcio serves it): a handler
    with replies pending keeps the call open, and the trailers follow its last push."""
    served = await serve(layer)
    client = await Client.open(served.port)
    await client.call(1, b"held", path=LATER)  # END_STREAM on the last DATA frame
    await client.wait(0.3)
    assert not client.ended(1) and client.data(1) == b"" and served.calls.open == 1
    (later,) = served.calls.later
    later.reply([b"first"], last=False)
    await client.until(lambda: len(client.data(1)) >= len(grpc_message(b"first")))
    await client.wait(0.2)
    assert not client.ended(1), "the call ended while its handler still had replies pending"
    later.reply([b"second", b"third"])
    await client.until(lambda: client.ended(1))
    assert client.data(1) == grpc_message(b"first") + grpc_message(b"second") + grpc_message(b"third")
    assert client.trailers(1)[b"grpc-status"] == b"0"
    assert served.calls.open == 0 and served.calls.closed == 1
    assert not [e for e in client.seen if isinstance(e, ev.StreamReset)]  # the client had ended: nothing to stop
    await client.call(3, b"next")  # the connection goes on serving
    await client.until(lambda: client.ended(3))
    assert client.data(3) == grpc_message(b"next")
    client.close()
    await served.server.close(grace=0.5)


@LAYERS
@pytest.mark.parametrize("how", ["reset", "connection-closed"])
async def test_a_half_closed_call_with_replies_pending_ends_when_the_client_goes(layer: str, how: str) -> None:
    """A client that resets the call, or closes the connection, while its handler still owes replies: the handler
    is closed once, and its late push sends nothing."""
    served = await serve(layer)
    client = await Client.open(served.port)
    await client.call(1, b"held", path=LATER)
    await client.wait(0.2)
    (later,) = served.calls.later
    if how == "reset":
        client.conn.reset_stream(1, ErrorCodes.CANCEL)
        await client.flush()
    else:
        client.close()
    for _ in range(50):
        if served.calls.closed:
            break
        await asyncio.sleep(0.02)
    assert served.calls.open == 0 and served.calls.closed == 1
    later.reply([b"too late"])
    if how == "reset":
        await client.wait(0.2)
        assert client.data(1) == b"" and not client.eof
        client.close()
    assert served.calls.closed == 1
    await served.server.close(grace=0.5)


@LAYERS
async def test_a_handler_error_ends_its_call_with_trailers_and_a_reset(layer: str) -> None:
    served = await serve(layer)
    client = await Client.open(served.port)
    client.conn.send_headers(1, request_headers(FAIL))
    client.conn.send_data(1, grpc_message(b"x"))  # no END_STREAM: the server ends first
    await client.flush()
    await client.until(lambda: client.ended(1))
    await client.wait(0.2)
    assert client.trailers(1)[b"grpc-status"] == b"5" and client.trailers(1)[b"grpc-message"] == b"no such thing"
    resets = [e for e in client.seen if isinstance(e, ev.StreamReset)]
    assert [(e.stream_id, e.error_code) for e in resets] == [(1, ErrorCodes.NO_ERROR)]
    client.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_server_shutdown_sends_goaway_no_error(layer: str) -> None:
    served = await serve(layer)
    client = await Client.open(served.port)
    await client.wait(0.1)  # the server reads our SETTINGS ACK (unread bytes at close would make it a TCP reset)
    await served.server.close(grace=0.5)
    await client.until(lambda: any(isinstance(e, ev.ConnectionTerminated) for e in client.seen))
    terminated = next(e for e in client.seen if isinstance(e, ev.ConnectionTerminated))
    assert terminated.error_code == ErrorCodes.NO_ERROR
    client.close()


@LAYERS
async def test_a_client_goaway_closes_the_connection(layer: str) -> None:
    served = await serve(layer)
    client = await Client.open(served.port)
    client.conn.close_connection()
    await client.flush()
    await asyncio.wait_for(client.reader.read(), 3)  # reads to EOF: a TimeoutError if the server kept it open
    client.close()
    await served.server.close(grace=0.5)


# --- raw frames: what a well-behaved client does not send --------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x7, 0x9
END_STREAM, END_HEADERS, PADDED = 0x1, 0x4, 0x8


class Raw:
    """A raw connection: bytes out, hyperframe frames in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.inbox = b""
        self.frames: list[Frame] = []
        self.eof = False

    @classmethod
    async def open(cls, port: int, preface: bytes = PREFACE + frame(SETTINGS, 0, 0)) -> Raw:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        raw = cls(reader, writer)
        await raw.send(preface)
        return raw

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def block(self, path: str = ECHO, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
        return self.encoder.encode(request_headers(path, extra))

    async def read(self, done: Callable[[list[Frame]], bool], seconds: float = 5.0) -> list[Frame]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not done(self.frames) and not self.eof:
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 16), max(0.0, deadline - loop.time()))
            except (TimeoutError, ConnectionResetError):
                break
            self.eof = not data
            self.inbox += data
            while len(self.inbox) >= 9:
                parsed, length = Frame.parse_frame_header(memoryview(self.inbox[:9]))
                if len(self.inbox) < 9 + length:
                    break
                parsed.parse_body(memoryview(self.inbox[9 : 9 + length]))
                self.frames.append(parsed)
                self.inbox = self.inbox[9 + length :]
        return self.frames

    async def goaway(self) -> GoAwayFrame:
        frames = await self.read(lambda fs: any(isinstance(f, GoAwayFrame) for f in fs))
        return next(f for f in frames if isinstance(f, GoAwayFrame))

    def resets(self) -> dict[int, int]:
        return {f.stream_id: f.error_code for f in self.frames if isinstance(f, RstStreamFrame)}

    def close(self) -> None:
        self.writer.close()


def ends(stream_id: int) -> Callable[[list[Frame]], bool]:
    return lambda fs: any(f.stream_id == stream_id and (isinstance(f, RstStreamFrame) or (
        isinstance(f, HeadersFrame) and "END_STREAM" in f.flags)) for f in fs)


@LAYERS
async def test_a_bad_preface_ends_the_connection(layer: str) -> None:
    served = await serve(layer)
    raw = await Raw.open(served.port, preface=b"GET / HTTP/1.1\r\nhost: picker\r\n\r\n" + bytes(16))
    assert (await raw.goaway()).error_code == ErrorCodes.PROTOCOL_ERROR
    await raw.read(lambda fs: False, seconds=2)
    assert raw.eof
    raw.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_a_header_block_split_over_continuation_frames(layer: str) -> None:
    served = await serve(layer)
    raw = await Raw.open(served.port)
    block = raw.block(extra=(("x-long", "v" * 300),))
    third = len(block) // 3
    await raw.send(frame(HEADERS, 0, 1, block[:third]) + frame(CONTINUATION, 0, 1, block[third : 2 * third])
                   + frame(CONTINUATION, END_HEADERS, 1, block[2 * third :])
                   + frame(DATA, END_STREAM, 1, grpc_message(b"continued")))
    await raw.read(ends(1))
    assert served.calls.messages == [b"continued"]
    raw.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_a_frame_between_headers_and_continuation_is_a_protocol_error(layer: str) -> None:
    served = await serve(layer)
    raw = await Raw.open(served.port)
    block = raw.block()
    await raw.send(frame(HEADERS, 0, 1, block[:5]) + frame(DATA, 0, 1, b"x") + frame(CONTINUATION, END_HEADERS, 1, block[5:]))
    assert (await raw.goaway()).error_code == ErrorCodes.PROTOCOL_ERROR
    raw.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_padded_headers_are_unpadded(layer: str) -> None:
    served = await serve(layer)
    raw = await Raw.open(served.port)
    block = raw.block()
    await raw.send(frame(HEADERS, END_HEADERS | PADDED, 1, b"\x10" + block + bytes(16))
                   + frame(DATA, END_STREAM | PADDED, 1, b"\x03" + grpc_message(b"pad") + bytes(3)))
    await raw.read(ends(1))
    assert served.calls.messages == [b"pad"]
    raw.close()
    await served.server.close(grace=0.5)


@LAYERS
@pytest.mark.parametrize(("what", "frames"), [
    ("an even client stream id", lambda r: frame(HEADERS, END_HEADERS, 2, r.block())),
    ("a stream id going down", lambda r: frame(HEADERS, END_HEADERS, 5, r.block()) + frame(HEADERS, END_HEADERS, 3, r.block())),
    ("padding longer than the frame", lambda r: frame(HEADERS, END_HEADERS, 1, r.block()) + frame(DATA, PADDED, 1, b"\x09abc")),
    ("RST_STREAM on stream 0", lambda r: frame(RST_STREAM, 0, 0, bytes(4))),
])
async def test_stream_id_and_framing_violations_end_the_connection(layer: str, what: str, frames: Callable[[Raw], bytes]) -> None:
    served = await serve(layer)
    raw = await Raw.open(served.port)
    await raw.send(frames(raw))
    assert (await raw.goaway()).error_code == ErrorCodes.PROTOCOL_ERROR, what
    raw.close()
    await served.server.close(grace=0.5)


@LAYERS
async def test_a_frame_over_the_advertised_size_is_a_frame_size_error(layer: str) -> None:
    served = await serve(layer)
    raw = await Raw.open(served.port)
    await raw.send(frame(HEADERS, END_HEADERS, 1, raw.block()) + frame(DATA, 0, 1, bytes(LIMITS.max_frame_bytes + 1)))
    assert (await raw.goaway()).error_code == ErrorCodes.FRAME_SIZE_ERROR
    raw.close()
    await served.server.close(grace=0.5)


async def test_streams_past_the_limit_are_refused_and_the_others_served(hand: Served) -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS is advertised; a client that opens more gets RST_STREAM REFUSED_STREAM for
    each stream past it, and the streams within it still work."""
    client = await Client.open(hand.port)
    assert client.conn.remote_settings.max_concurrent_streams == LIMITS.max_concurrent_streams
    client.close()
    raw = await Raw.open(hand.port)
    await raw.send(b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, raw.block()) for i in range(10)))
    await raw.read(lambda fs: len(raw.resets()) >= 6)
    assert raw.resets() == {2 * i + 1: ErrorCodes.REFUSED_STREAM for i in range(4, 10)}
    await raw.send(b"".join(frame(DATA, END_STREAM, 2 * i + 1, grpc_message(b"in")) for i in range(4)))
    await raw.read(ends(7))
    assert hand.calls.messages == [b"in"] * 4 and hand.calls.open == 0
    raw.close()


async def test_a_header_list_over_the_limit_is_refused_for_its_stream(hand: Served) -> None:
    raw = await Raw.open(hand.port)
    big = tuple((f"x-filler-{i}", "v" * 500) for i in range(10))  # ~5 KiB decoded, over the 4 KiB limit
    await raw.send(frame(HEADERS, END_HEADERS, 1, raw.block(extra=big)) + frame(DATA, END_STREAM, 1, grpc_message(b"x")))
    await raw.read(ends(1))
    trailers = next(f for f in raw.frames if isinstance(f, HeadersFrame))
    fields = {str(k): str(v) for k, v in hpack.Decoder().decode(trailers.data)}
    assert fields["grpc-status"] == "8" and "header list" in fields["grpc-message"]
    assert hand.calls.messages == []
    raw.close()


async def test_a_flood_of_partial_messages_is_bounded_by_the_connection_window(hand: Served) -> None:
    """A client that ignores our windows: it opens every stream it may and sends unfinished messages until it is
    stopped. What the server holds never passes one connection window (plus a frame), and the flood ends with
    GOAWAY FLOW_CONTROL_ERROR."""
    raw = await Raw.open(hand.port)
    window = LIMITS.connection_window_bytes
    await raw.send(b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, raw.block(HOLD)) for i in range(4)))
    part = b"\x00" + struct.pack(">I", LIMITS.max_message_bytes) + bytes(16_000)
    reading = asyncio.create_task(raw.read(lambda fs: any(isinstance(f, GoAwayFrame) for f in fs), seconds=10))
    most = 0
    for n in range(4 * window // len(part)):
        if raw.writer.is_closing():
            break
        try:
            await raw.send(frame(DATA, 0, 2 * (n % 4) + 1, part[5:] if n >= 4 else part))
        except ConnectionError:
            break
        most = max(most, hand.buffered_bytes())
        if n % 16 == 0:
            await asyncio.sleep(0)
    await reading
    assert (await raw.goaway()).error_code == ErrorCodes.FLOW_CONTROL_ERROR
    assert 0 < most <= window + LIMITS.max_frame_bytes, most
    raw.close()


async def test_an_oversized_declared_message_is_refused_before_it_is_buffered(hand: Served) -> None:
    raw = await Raw.open(hand.port)
    await raw.send(frame(HEADERS, END_HEADERS, 1, raw.block())
                   + frame(DATA, 0, 1, b"\x00" + struct.pack(">I", 0xFFFFFFFF) + bytes(60_000)))
    await raw.read(ends(1))
    assert raw.resets() == {1: ErrorCodes.NO_ERROR} and hand.buffered_bytes() == 0
    raw.close()
