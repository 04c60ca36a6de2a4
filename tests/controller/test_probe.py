"""The health probe over real HTTP against a server that answers right or in each wrong way."""

from __future__ import annotations

import asyncio
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
from loraplane.controller.probe import HealthProber
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
