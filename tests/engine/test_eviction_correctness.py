"""Twenty adapters through 2 slots and a 4-entry host cache: evictions must never change or mislabel an answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import pytest

from loraplane.api import ADAPTER_DIGEST_HEADER, SERVED_ADAPTER_HEADER
from loraplane.engine.app import EngineOptions
from tests.engine.helpers import EngineProcess, GeneratedAdapter, completion, inprocess

pytestmark = pytest.mark.slow
REQUESTS = 48
CONCURRENCY = 8


def _traffic(adapters: list[GeneratedAdapter]) -> list[tuple[GeneratedAdapter, str]]:
    """A stride through the adapters (every one comes back after others pushed it out), distinct prompts."""
    return [(adapters[(k * 7) % len(adapters)], f"request {k}: hello") for k in range(REQUESTS)]


async def _serve_under_pressure(url: str, traffic: list[tuple[GeneratedAdapter, str]]) -> list[httpx.Response]:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for adapter in {a.name: a for a, _ in traffic}.values():
            loaded = await http.post("/v1/load_lora_adapter",
                                     json={"lora_name": adapter.name, "lora_path": adapter.path.name})
            assert loaded.status_code == 200, loaded.text

        async def one(adapter: GeneratedAdapter, prompt: str) -> httpx.Response:
            async with gate:
                return await http.post("/v1/completions", json=completion(adapter.name, prompt, return_token_ids=True))

        responses = await asyncio.gather(*[one(a, p) for a, p in traffic])
        listing = (await http.get("/admin/adapters")).json()
    evictions = sum(a["evictions"] for a in listing["adapters"])
    reloads = sum(a["loads"] for a in listing["adapters"]) - len(listing["adapters"])
    assert evictions > 0 and reloads > 0, "the trace must force evictions and reloads from disk"
    return list(responses)


async def _reference(adapter_root: Path, traffic: list[tuple[GeneratedAdapter, str]]) -> dict[tuple[str, str], list[int]]:
    """Each request served by an engine holding only that adapter (load, serve its requests, unload)."""
    options = EngineOptions(max_loras=1, max_cpu_loras=1, adapter_root=adapter_root, allow_runtime_lora_updating=True)
    expected: dict[tuple[str, str], list[int]] = {}
    async with inprocess(options) as (built, http):
        for adapter in {a.name: a for a, _ in traffic}.values():
            await http.post("/v1/load_lora_adapter", json={"lora_name": adapter.name, "lora_path": adapter.path.name})
            assert list(built.engine.tiers.registered) == [adapter.name]
            for a, prompt in traffic:
                if a is adapter:
                    body = (await http.post("/v1/completions", json=completion(a.name, prompt, return_token_ids=True))).json()
                    expected[(a.name, prompt)] = body["choices"][0]["token_ids"]
            await http.post("/v1/unload_lora_adapter", json={"lora_name": adapter.name})
    return expected


async def test_evictions_never_change_or_mislabel_answers(
    tiny_adapters: list[GeneratedAdapter], adapter_root: Path,
    start_engine: Callable[[Sequence[str]], EngineProcess],
) -> None:
    traffic = _traffic(tiny_adapters)
    engine = start_engine(["--max-loras", "2", "--max-cpu-loras", "4", "--max-num-seqs", "8",
                           "--enable-lora-runtime-updating", "--adapter-root", str(adapter_root)])
    responses = await _serve_under_pressure(engine.url, traffic)
    expected = await _reference(adapter_root, traffic)
    outputs = set()
    for (adapter, prompt), response in zip(traffic, responses, strict=True):
        assert response.status_code == 200, response.text
        assert response.headers[SERVED_ADAPTER_HEADER] == adapter.name
        assert response.headers[ADAPTER_DIGEST_HEADER] == adapter.digest
        assert response.json()["model"] == adapter.name
        tokens = response.json()["choices"][0]["token_ids"]
        assert tokens == expected[(adapter.name, prompt)], (adapter.name, prompt)
        outputs.add(tuple(tokens))
    assert len(outputs) > len(tiny_adapters) // 2, "adapters must produce distinct answers for the test to mean anything"
