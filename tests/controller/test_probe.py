"""The health probe over real HTTP against a server that answers right or in each wrong way."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from e2e.fixtures.processes import free_port
from loraplane.api import ADAPTER_DIGEST_HEADER, SERVED_ADAPTER_HEADER
from loraplane.controller.probe import ATTEMPTS, HealthProber
from tests.controller.world import digest, revision

CONTENT = digest(777)


def _app() -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.json()
        how = request.headers.get("x-test-mode", "")
        model = body["model"]

        async def stream() -> AsyncIterator[bytes]:
            if how == "slow":
                await asyncio.sleep(0.3)
            if how.startswith("vllm"):  # vLLM: no headers, each event names the model that answered
                named = "other@v9" if how == "vllm-wrong-name" else model
                yield f'data: {{"model": "{named}", "choices": [{{"text": "ok"}}]}}\n\n'.encode()
                yield b"data: [DONE]\n\n"
                return
            yield b'data: {"choices": [{"text": "ok"}]}\n\n'

        headers = {SERVED_ADAPTER_HEADER: "other@v9" if how == "wrong-name" else model,
                   ADAPTER_DIGEST_HEADER: digest(1) if how == "wrong-digest" else CONTENT}
        if how.startswith("vllm"):
            headers = {}
        return StreamingResponse(stream(), status_code=500 if how == "error" else 200, headers=headers)

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture
async def address() -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn only exposes a flag)
        await asyncio.sleep(0.01)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    await task


@pytest.mark.parametrize(
    ("mode", "ok", "needle"),
    [
        ("", True, "200 from claims@v1"),
        ("error", False, "HTTP 500"),
        ("wrong-name", False, "answered by 'other@v9'"),
        ("wrong-digest", False, "is not the verified"),
        ("slow", False, "over the 100 ms bound"),
    ],
)
async def test_probe_checks_status_identity_digest_and_ttft(address: str, mode: str, ok: bool, needle: str) -> None:
    rev = revision("v1", n=1, rollout={"healthProbe": {"ttftBoundMs": 100}})
    async with httpx.AsyncClient(headers={"x-test-mode": mode}) as client:
        result = await HealthProber(client).probe(rev, address, CONTENT)
    assert result.ok is ok and needle in result.message, result


async def test_without_a_reported_content_digest_the_digest_is_not_checked(address: str) -> None:
    rev = revision("v1", n=1)
    async with httpx.AsyncClient(headers={"x-test-mode": "wrong-digest"}) as client:
        result = await HealthProber(client).probe(rev, address, None)
    assert result.ok and "digest not reported by the sidecar" in result.message


@pytest.mark.parametrize(("mode", "ok"), [("vllm", True), ("vllm-wrong-name", False)])
async def test_a_runtime_without_identity_headers_is_checked_by_the_model_its_stream_names(
        address: str, mode: str, ok: bool) -> None:
    rev = revision("v1", n=1)
    async with httpx.AsyncClient(headers={"x-test-mode": mode}) as client:
        result = await HealthProber(client).probe(rev, address, CONTENT)
    assert result.ok is ok, result
    assert "no digest stamped by the runtime" in result.message if ok else "answered by 'other@v9'" in result.message


async def test_unreachable_pod_fails_the_probe() -> None:
    rev = revision("v1", n=1, rollout={"healthProbe": {"timeoutSeconds": 2}})
    async with httpx.AsyncClient() as client:
        result = await HealthProber(client).probe(rev, f"127.0.0.1:{free_port()}", CONTENT)
    assert not result.ok and "request failed" in result.message


class _ClosesReusedConnections:
    """An HTTP/1.1 server that answers the first request on each connection (vLLM's stream, kept alive) and resets
    the connection when a second one comes on it: what a client sees when it reuses a kept-alive connection just as
    the server's idle timeout closes it (uvicorn's 5 s under vLLM, httpx's own 5 s keep-alive)."""

    def __init__(self) -> None:
        self.requests = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length))
                self.requests += 1
                if answered:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, no FIN
                    writer.transport.abort()
                    return
                event = f'data: {{"model": "{body["model"]}", "choices": [{{"text": "ok"}}]}}\n\ndata: [DONE]\n\n'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(event), event.encode()))
                await writer.drain()
                answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def test_a_kept_alive_connection_closed_under_the_probe_is_not_a_failed_probe() -> None:
    """The pod's server resets the kept-alive connection the second probe reuses, before any response byte: the
    probe goes again on a new connection and passes (it used to fail the gate: ``request failed: ReadError``)."""
    server = _ClosesReusedConnections()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    address = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    rev = revision("v1", n=1)
    try:
        async with httpx.AsyncClient() as client:
            prober = HealthProber(client)
            first = await prober.probe(rev, address, None)
            second = await prober.probe(rev, address, None)
    finally:
        listener.close()
        await listener.wait_closed()
    assert first.ok and first.status == 200, first
    assert second.ok, second
    # the second probe: its reused connection reset, then one more send on a connection of its own
    assert (server.requests, server.connections) == (3, 2)


async def test_a_pod_that_never_answers_fails_after_the_bounded_resends() -> None:
    rev = revision("v1", n=1, rollout={"healthProbe": {"timeoutSeconds": 30}})
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async with httpx.AsyncClient() as client:
        result = await HealthProber(client, sleep=sleep).probe(rev, f"127.0.0.1:{free_port()}", CONTENT)
    assert not result.ok and result.status is None
    assert f"request failed ({ATTEMPTS} attempts): ConnectError" in result.message, result
    assert slept == [0.1, 0.2]


async def test_an_answer_is_never_sent_again(address: str) -> None:
    """A response that began (here a 500) is the probe's verdict: no resend."""
    rev = revision("v1", n=1)
    async with httpx.AsyncClient(headers={"x-test-mode": "error"}) as client:
        result = await HealthProber(client, sleep=_no_sleep).probe(rev, address, CONTENT)
    assert not result.ok and result.status == 500 and result.message == "HTTP 500"


async def _no_sleep(seconds: float) -> None:
    raise AssertionError(f"no resend expected, slept {seconds}")
