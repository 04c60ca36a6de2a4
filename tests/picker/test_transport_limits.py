"""The picker's HTTP/2 transport under hostile frames: a real ``loraplane-picker`` process, raw sockets.

Each test sends crafted frames and asserts the picker's answer (RST_STREAM, GOAWAY, trailers) and, for the floods,
that the process's resident memory stays bounded (figures printed for the notes: run with ``-s``).
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2

from e2e.fixtures.processes import LOOPBACK, ManagedProcess, RedisServer, free_port, wait_for_port

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS, PADDED = 0x1, 0x4, 0x8
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x1, 0x3, 0x7, 0x8, 0xB
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH = "/grpc.health.v1.Health/Check"
IDLE_TIMEOUT_S = 2.0


@dataclass
class PickerProcess:
    process: ManagedProcess
    port: int
    health_port: int

    def rss_mib(self) -> float:
        pid = self.process.proc.pid
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


def start_picker(workdir: Path, redis: RedisServer, transport: str = "h2") -> PickerProcess:
    port, health_port = free_port(), free_port()
    args = [sys.executable, "-m", "loraplane.picker.cli", "--pool", "limits", "--redis-url", redis.url,
            "--grpc-address", f"{LOOPBACK}:{port}", "--health-address", f"{LOOPBACK}:{health_port}",
            "--metrics-address", "", "--transport", transport, "--stream-idle-timeout", str(IDLE_TIMEOUT_S),
            "--endpoint", f"pod-a={LOOPBACK}:{free_port()}"]
    process = ManagedProcess(args, workdir / f"picker-{transport}.log").start()
    wait_for_port(port, proc=process.proc, timeout=30)
    wait_for_port(health_port, proc=process.proc, timeout=30)
    return PickerProcess(process, port, health_port)


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory, redis_session: RedisServer) -> Iterator[PickerProcess]:
    served = start_picker(tmp_path_factory.mktemp("picker"), redis_session)
    yield served
    served.process.stop()


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream_id) + payload


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(body)) + body


HEALTH_MESSAGE = grpc_message(health_pb2.HealthCheckRequest(service="liveness").SerializeToString())


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes

    @property
    def code(self) -> int:
        """The error code of a RST_STREAM or GOAWAY."""
        return struct.unpack(">I", self.payload[:4] if self.kind == RST_STREAM else self.payload[4:8])[0]


@dataclass
class RawH2:
    """A raw HTTP/2 client connection: frames out as bytes, frames in as parsed."""

    sock: socket.socket
    encoder: hpack.Encoder = field(default_factory=hpack.Encoder)
    decoder: hpack.Decoder = field(default_factory=hpack.Decoder)
    inbox: bytes = b""
    closed: bool = False

    @classmethod
    def connect(cls, port: int, settings: bytes = b"") -> RawH2:
        sock = socket.create_connection((LOOPBACK, port), timeout=10)
        conn = cls(sock)
        conn.send(PREFACE + frame(SETTINGS, 0, 0, settings))
        return conn

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def headers(self, stream_id: int, path: str = PROCESS, flags: int = END_HEADERS, extra: tuple = ()) -> bytes:
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                     (":authority", "picker"), ("content-type", "application/grpc"),
                                     ("te", "trailers"), *extra])
        return frame(HEADERS, flags, stream_id, block)

    def read(self, until, timeout: float = 10.0) -> list[Frame]:  # type: ignore[no-untyped-def]
        """Frames until ``until(frames)`` is true, the connection closes, or the timeout."""
        frames: list[Frame] = []
        deadline = time.monotonic() + timeout
        while not until(frames):
            while len(self.inbox) >= 9 and len(self.inbox) >= 9 + (n := int.from_bytes(self.inbox[:3], "big")):
                kind, flags = self.inbox[3], self.inbox[4]
                sid = int.from_bytes(self.inbox[5:9], "big") & 0x7FFFFFFF
                frames.append(Frame(kind, flags, sid, self.inbox[9 : 9 + n]))
                self.inbox = self.inbox[9 + n :]
            if until(frames) or self.closed:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                break
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed = True
            self.inbox += chunk
        return frames

    def goaway(self, timeout: float = 10.0) -> Frame:
        frames = self.read(lambda fs: any(f.kind == GOAWAY for f in fs), timeout)
        return next(f for f in frames if f.kind == GOAWAY)

    def trailers_of(self, frames: list[Frame], stream_id: int) -> dict[str, str]:
        fields: dict[str, str] = {}
        for f in frames:
            if f.kind == HEADERS and f.stream_id == stream_id:
                fields.update({k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                               for k, v in self.decoder.decode(f.payload)})
        return fields

    def close(self) -> None:
        self.sock.close()


def ended(stream_id: int):  # type: ignore[no-untyped-def]
    return lambda fs: any(f.stream_id == stream_id and (f.kind == RST_STREAM or (f.flags & END_STREAM and f.kind == HEADERS))
                          for f in fs)


def health_check(conn: RawH2, stream_id: int, path: str = HEALTH) -> dict[str, str]:
    conn.send(conn.headers(stream_id, path) + frame(DATA, END_STREAM, stream_id, HEALTH_MESSAGE))
    return conn.trailers_of(conn.read(ended(stream_id)), stream_id)


def report(what: str, before: float, after: float) -> None:
    print(f"\n[picker RSS] {what}: {before:.1f} MiB before, {after:.1f} MiB after ({after - before:+.1f} MiB)")


def test_a_4_gib_declared_message_is_refused_from_its_length(picker: PickerProcess) -> None:
    conn = RawH2.connect(picker.port)
    before = picker.rss_mib()
    chunk = bytes(1 << 20)
    conn.send(conn.headers(1) + frame(DATA, 0, 1, b"\x00" + struct.pack(">I", 0xFFFFFFFF) + chunk))
    frames = conn.read(lambda fs: any(f.kind == RST_STREAM and f.stream_id == 1 for f in fs))
    trailers = conn.trailers_of(frames, 1)
    assert trailers.get("grpc-status") == "8", trailers  # RESOURCE_EXHAUSTED
    assert "larger than the limit" in trailers.get("grpc-message", "")
    assert next(f for f in frames if f.kind == RST_STREAM).code == 0  # NO_ERROR: stop sending
    for _ in range(200):  # a client that goes on anyway: 200 MiB more of the same message
        conn.send(frame(DATA, 0, 1, chunk))
    assert health_check(conn, 3).get("grpc-status") == "0"  # the connection still serves
    after = picker.rss_mib()
    report("4 GiB declared + 201 MiB sent", before, after)
    assert after - before < 32
    conn.close()


def test_a_300_mib_continuation_run_ends_the_connection(picker: PickerProcess) -> None:
    conn = RawH2.connect(picker.port)
    before = picker.rss_mib()
    conn.send(conn.headers(1, flags=0))  # no END_HEADERS: CONTINUATION frames follow
    fragment = frame(CONTINUATION, 0, 1, b"\x00" * 16_000)
    batch = fragment * 64  # ~1 MiB
    conn.send(batch)
    goaway = conn.goaway()
    assert goaway.code == ENHANCE_YOUR_CALM, goaway
    sent = len(batch)
    with pytest.raises(OSError):
        while sent < 300 << 20:
            conn.send(batch)
            sent += len(batch)
    after = picker.rss_mib()
    report(f"CONTINUATION run ({sent / 2**20:.1f} MiB accepted by the socket before it closed)", before, after)
    assert sent < 300 << 20 and after - before < 32
    conn.close()


def test_streams_beyond_the_limit_are_refused_and_idle_ones_reset(picker: PickerProcess) -> None:
    before = picker.rss_mib()
    conns = [RawH2.connect(picker.port) for _ in range(4)]
    for conn in conns:
        conn.send(b"".join(conn.headers(2 * i + 1) for i in range(300)))  # 300 streams opened, none ends
    for conn in conns:
        frames = conn.read(lambda fs: sum(f.kind == RST_STREAM for f in fs) >= 200, timeout=10)
        refused = sorted(f.stream_id for f in frames if f.kind == RST_STREAM)
        assert refused == [2 * i + 1 for i in range(100, 300)]
        assert {f.code for f in frames if f.kind == RST_STREAM} == {REFUSED_STREAM}
    held = picker.rss_mib()
    other = RawH2.connect(picker.health_port)
    assert health_check(other, 1).get("grpc-status") == "0"  # a flood on some connections starves no other
    for conn in conns:  # the 100 held streams are reset once silent for the idle timeout
        frames = conn.read(lambda fs: sum(f.kind == RST_STREAM for f in fs) >= 100, timeout=IDLE_TIMEOUT_S * 3)
        assert sorted(f.stream_id for f in frames if f.kind == RST_STREAM) == [2 * i + 1 for i in range(100)]
        assert {f.code for f in frames if f.kind == RST_STREAM} == {CANCEL}
        assert health_check(conn, 601).get("grpc-status") == "0"  # room again
    report("4 connections x 300 streams held open", before, held)
    assert held - before < 32
    for conn in [*conns, other]:
        conn.close()


def test_reset_streams_free_their_slots(picker: PickerProcess) -> None:
    conn = RawH2.connect(picker.port)
    conn.send(b"".join(conn.headers(2 * i + 1) for i in range(100)))
    conn.send(b"".join(frame(RST_STREAM, 0, 2 * i + 1, struct.pack(">I", CANCEL)) for i in range(100)))
    conn.send(b"".join(conn.headers(201 + 2 * i) for i in range(100)))
    frames = conn.read(lambda fs: False, timeout=1.0)
    assert not [f for f in frames if f.kind in (RST_STREAM, GOAWAY)]
    conn.close()


@pytest.mark.parametrize(("what", "frames"), [
    ("even stream id", lambda c: c.headers(2)),
    ("stream id going down", lambda c: c.headers(5) + c.headers(3)),
    ("DATA on an idle stream", lambda c: frame(DATA, 0, 7, HEALTH_MESSAGE)),
    ("padding longer than the frame", lambda c: c.headers(1) + frame(DATA, PADDED, 1, b"\x09abc")),
    ("RST_STREAM on stream 0", lambda c: frame(RST_STREAM, 0, 0, struct.pack(">I", 0))),
    ("WINDOW_UPDATE of 0", lambda c: frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0))),
    ("CONTINUATION without HEADERS", lambda c: frame(CONTINUATION, END_HEADERS, 1, b"")),
])
def test_protocol_violations_end_the_connection(picker: PickerProcess, what: str, frames) -> None:  # type: ignore[no-untyped-def]
    conn = RawH2.connect(picker.port)
    conn.send(frames(conn))
    assert conn.goaway().code == PROTOCOL_ERROR, what
    conn.close()


def test_window_overflow_is_a_flow_control_error(picker: PickerProcess) -> None:
    conn = RawH2.connect(picker.port)
    conn.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0x7FFFFFFF)) * 2)
    assert conn.goaway().code == FLOW_CONTROL_ERROR
    conn.close()


def test_padding_and_flow_control_windows_are_honoured(picker: PickerProcess) -> None:
    conn = RawH2.connect(picker.port, settings=struct.pack(">HI", 0x4, 0))  # a 0-byte stream window
    block = conn.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", HEALTH),
                                 (":authority", "picker"), ("content-type", "application/grpc")])
    conn.send(frame(HEADERS, END_HEADERS | PADDED, 1, b"\x04" + block + b"\x00" * 4)
              + frame(DATA, END_STREAM | PADDED, 1, b"\x08" + HEALTH_MESSAGE + b"\x00" * 8))
    held_back = conn.read(lambda fs: False, timeout=0.5)
    assert not [f for f in held_back if f.kind == DATA], "a DATA frame beyond the peer's window"
    conn.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 1 << 16)))
    frames = held_back + conn.read(ended(1))
    data = b"".join(f.payload for f in frames if f.kind == DATA)
    assert health_pb2.HealthCheckResponse.FromString(data[5:]).status == health_pb2.HealthCheckResponse.SERVING
    assert conn.trailers_of(frames, 1).get("grpc-status") == "0"
    conn.close()


def test_a_client_goaway_closes_the_connection(picker: PickerProcess) -> None:
    conn = RawH2.connect(picker.port)
    conn.send(conn.headers(1) + frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0)))
    conn.read(lambda fs: False, timeout=5)
    assert conn.closed
    conn.close()


def test_oversized_header_lists_are_refused_per_stream(picker: PickerProcess) -> None:
    conn = RawH2.connect(picker.port)
    big = tuple((f"x-filler-{i}", "v" * 1000) for i in range(20))  # ~20 KiB decoded, under the block limit
    conn.send(conn.headers(1, HEALTH, extra=big) + frame(DATA, END_STREAM, 1, HEALTH_MESSAGE))
    trailers = conn.trailers_of(conn.read(ended(1)), 1)
    assert trailers.get("grpc-status") == "8" and "header list" in trailers.get("grpc-message", ""), trailers
    assert health_check(conn, 3).get("grpc-status") == "0"
    conn.close()


def test_the_health_port_serves_health_only(picker: PickerProcess) -> None:
    conn = RawH2.connect(picker.health_port)
    assert health_check(conn, 1).get("grpc-status") == "0"
    refused = health_check(conn, 3, PROCESS)
    assert refused.get("grpc-status") == "12", refused  # UNIMPLEMENTED
    conn.close()


@pytest.fixture(scope="module")
def grpcio_picker(tmp_path_factory: pytest.TempPathFactory, redis_session: RedisServer) -> Iterator[PickerProcess]:
    served = start_picker(tmp_path_factory.mktemp("picker-grpcio"), redis_session, "grpcio")
    yield served
    served.process.stop()


def test_grpcio_transport_has_the_same_limits_and_health_only_port(grpcio_picker: PickerProcess) -> None:
    def process_call(port: int, body: bytes) -> grpc.StatusCode:
        with grpc.insecure_channel(f"{LOOPBACK}:{port}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            call = ch.stream_stream(PROCESS, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            try:
                list(call(iter([body]), timeout=10))
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    assert process_call(grpcio_picker.port, bytes(5 << 20)) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert process_call(grpcio_picker.health_port, b"") is grpc.StatusCode.UNIMPLEMENTED


def test_partial_messages_are_bounded_by_the_connection_window(picker: PickerProcess) -> None:
    """100 streams each holding an incomplete 4 MiB message: the picker holds at most its connection window, and a
    peer sending past the window is a flow-control error."""
    conn = RawH2.connect(picker.port)
    before = picker.rss_mib()
    part = b"\x00" + struct.pack(">I", (4 << 20) - 16) + bytes((1 << 20) - 5)  # 1 MiB of a just-allowed message
    conn.send(b"".join(conn.headers(2 * i + 1) for i in range(100)))
    with pytest.raises(OSError):
        for i in range(100):
            conn.send(frame(DATA, 0, 2 * i + 1, part))
    after = picker.rss_mib()
    assert conn.goaway().code == FLOW_CONTROL_ERROR
    report("100 streams x 1 MiB of unfinished 4 MiB messages (the rest refused)", before, after)
    assert after - before < 40
    conn.close()


def test_the_window_is_given_back_as_messages_complete(picker: PickerProcess) -> None:
    """24 MiB of complete 3 MiB messages in 16 KiB frames on one connection (past its 16 MiB window): each is
    answered, none is a flow-control error, because the picker gives the window back as messages complete."""
    conn = RawH2.connect(picker.port)
    padding = bytes(3 << 20)  # an unknown protobuf field (15, bytes): parsed and ignored
    body = health_pb2.HealthCheckRequest(service="liveness").SerializeToString() + b"\x7a" + _varint(len(padding)) + padding
    message = grpc_message(body)
    for stream_id in range(1, 17, 2):
        conn.send(conn.headers(stream_id, HEALTH))
        for start in range(0, len(message), 16_384):
            last = start + 16_384 >= len(message)
            conn.send(frame(DATA, END_STREAM if last else 0, stream_id, message[start : start + 16_384]))
    frames = conn.read(ended(15), timeout=30)
    assert not [f for f in frames if f.kind == GOAWAY]
    assert [conn.trailers_of(frames, s).get("grpc-status") for s in range(1, 17, 2)] == ["0"] * 8
    conn.close()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_streams_the_picker_ends_first_are_reset_and_free_their_slot(picker: PickerProcess) -> None:
    """A call that ends with an error while the client is still sending (here: an unknown health service) gets its
    trailers, then RST_STREAM NO_ERROR; 150 of them in a row on one connection are all answered, none refused."""
    conn = RawH2.connect(picker.port)
    unknown = grpc_message(health_pb2.HealthCheckRequest(service="no-such-service").SerializeToString())
    for i in range(150):
        conn.send(conn.headers(2 * i + 1, HEALTH) + frame(DATA, 0, 2 * i + 1, unknown))  # no END_STREAM
    frames = conn.read(lambda fs: sum(f.kind == RST_STREAM for f in fs) >= 150, timeout=10)
    resets = [f for f in frames if f.kind == RST_STREAM]
    assert len(resets) == 150 and {f.code for f in resets} == {0}
    assert [conn.trailers_of(frames, 2 * i + 1).get("grpc-status") for i in range(150)] == ["5"] * 150
    conn.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, conn.encoder.encode([("grpc-status", "0")])))  # late trailers
    assert health_check(conn, 301).get("grpc-status") == "0"  # ignored, not a protocol error
    conn.close()


@pytest.mark.slow
def test_a_peer_that_never_reads_is_not_read_either(picker: PickerProcess) -> None:
    """A PING flood whose ACKs are never read: the picker stops reading once its write buffer is full, so the
    flood backs up in the sender's socket instead of the picker's memory."""
    conn = RawH2.connect(picker.port)
    before = picker.rss_mib()
    pings = frame(PING, 0, 0, bytes(8)) * (1 << 16)  # 1.1 MB of PINGs per send
    conn.sock.settimeout(3)
    sent = 0
    with pytest.raises(TimeoutError):
        while sent < 400 << 20:
            conn.sock.sendall(pings)
            sent += len(pings)
    after = picker.rss_mib()
    report(f"PING flood, ACKs never read ({sent / 2**20:.0f} MiB taken before the sender blocked)", before, after)
    assert sent < 400 << 20 and after - before < 32
    conn.close()
    other = RawH2.connect(picker.port)
    assert health_check(other, 1).get("grpc-status") == "0"
    other.close()


def test_a_rapid_reset_flood_ends_the_connection(picker: PickerProcess) -> None:
    """Streams opened and reset at once, 5,000 in one write (CVE-2023-44487's pattern): GOAWAY ENHANCE_YOUR_CALM
    after the per-second allowance (1,000); 500 of them (a burst of client aborts) are fine."""
    conn = RawH2.connect(picker.port)
    conn.send(b"".join(conn.headers(2 * i + 1) + frame(RST_STREAM, 0, 2 * i + 1, struct.pack(">I", CANCEL))
                       for i in range(500)))
    assert health_check(conn, 1001).get("grpc-status") == "0"
    conn.close()
    conn = RawH2.connect(picker.port)
    conn.send(b"".join(conn.headers(2 * i + 1) + frame(RST_STREAM, 0, 2 * i + 1, struct.pack(">I", CANCEL))
                       for i in range(5000)))
    assert conn.goaway().code == ENHANCE_YOUR_CALM
    conn.close()
