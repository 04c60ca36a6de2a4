"""The KV-event tracker: vLLM's BlockStored / BlockRemoved / AllBlocksCleared batches -> the published block set."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis
import zmq

from e2e.fixtures.processes import free_port
from loraplane.api import KvBlockSet, TargetState, Tier, keys
from loraplane.picker.prefix import PreciseIndex, PrefixHasher
from loraplane.sidecar.artifacts import ArtifactSources, SourceConfig
from loraplane.sidecar.bus import RedisBus
from loraplane.sidecar.cache import DiskCache, StageTimings
from loraplane.sidecar.drivers import make_driver
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.kv_events import KvBlockTracker
from loraplane.sidecar.metrics import SidecarMetrics
from loraplane.sidecar.reconcile import Reconciler
from loraplane.sidecar.service import Sidecar, SidecarConfig
from tests.sidecar.adapters import sha256_of, target_for, write_weights

D17 = "sha256:" + "1" * 64
TOKENS = [256, *range(65, 65 + 15)]  # BOS and 15 letters: 4 blocks of 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], lora: str | None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 4, "lora_id": 1 if lora else None, "medium": "GPU", "lora_name": lora}


def batch(*events: dict) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


def tracker() -> KvBlockTracker:
    t = KvBlockTracker("pool-a", "pod-0", max_blocks=6, wall_clock=lambda: 100.0)
    t.set_digests({"claims@v17": D17})
    return t


def matched(t: KvBlockTracker, served_name: str | None, digest: str | None) -> int:
    index = PreciseIndex(wall_clock=lambda: 100.0)
    index.update(t.block_set())
    request = PrefixHasher(block_size=4, tokenizer=lambda _: TOKENS).hash_text(served_name, digest, "")
    return int(index.match(["pod-0"], request)[0])


def test_stored_blocks_are_rehashed_like_the_picker_hashes_tokens() -> None:
    t = tracker()
    t.message(7, batch(stored([11, 12], None, TOKENS[:8], "claims@v17")))
    t.message(8, batch(stored([13], 12, TOKENS[8:12], "claims@v17")))
    assert matched(t, "claims@v17", D17) == 3
    assert matched(t, "claims@v18", None) == 0 and matched(t, "claims@v17", None) == 0
    assert [a.served_name for a in t.block_set().adapters] == ["claims@v17"]
    t.message(9, batch({"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}))
    assert matched(t, "claims@v17", D17) == 1  # the chain breaks where a block went
    t.message(10, batch({"type": "AllBlocksCleared"}))
    assert len(t) == 0


def test_unknown_parents_gaps_and_bounds() -> None:
    t = tracker()
    t.message(1, batch(stored([21], 99, TOKENS[:4], None)))
    assert len(t) == 0 and t.unchained == 1  # its prefix was never seen: it could not be matched
    t.message(2, batch(stored([31, 32, 33, 34], None, TOKENS, None)))
    assert matched(t, None, None) == 4
    t.message(2 + 5, batch(stored([41], None, TOKENS[:4], "claims@v17")))  # messages were lost
    assert t.resets == 1 and len(t) == 1
    t.message(8, batch(stored([51, 52, 53, 54, 55, 56, 57], None, TOKENS + TOKENS[:12], None)))
    assert len(t) == 6 and t.dropped == 2 and t.block_set().dropped_blocks == 2


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_sidecar_publishes_the_block_set_with_its_reports_digests(tmp_path: Path, redis_srv,
                                                                       transport: str) -> None:
    """The wiring: the sidecar subscribes to the publisher, keys blocks by its report rows' digests, writes the set.
    vLLM binds an ipc:// endpoint and connects to a tcp:// one: the sidecar does the other."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    weights = write_weights(artifacts / "w.safetensors")
    target = target_for(f"file://{weights}", sha256_of(weights), tier=Tier.DISK)
    cache = DiskCache(tmp_path / "cache", 1 << 30, ArtifactSources(SourceConfig(file_roots=(artifacts,))))
    cache.fetch(target, keep=(), timings=StageTimings())
    endpoint = f"ipc://{tmp_path / 'kv.sock'}" if transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    publisher = zmq.Context.instance().socket(zmq.PUB)  # as vLLM's publisher does
    if transport == "ipc":
        publisher.bind(endpoint)
    else:
        publisher.connect(endpoint)
    driver = make_driver("engine", f"http://127.0.0.1:{free_port()}", RuntimeInfo(base_model=""))
    bus = RedisBus(redis_srv.url, "pool-a", "pod-0")
    sidecar = Sidecar(SidecarConfig("pool-a", "pod-0", "10.0.0.1:8000", "engine", heartbeat_s=0.1,
                                    kv_events_endpoint=endpoint),
                      Reconciler(driver, cache, SidecarMetrics()), bus)
    client = aioredis.Redis.from_url(redis_srv.url)
    stop = asyncio.Event()
    state = TargetState(pool="pool-a", pod="pod-0", generation=1, adapters=[target], updated_at=time.time())
    await client.set(keys.target_state("pool-a", "pod-0"), state.to_json())
    running = asyncio.create_task(sidecar.run(stop))
    try:
        published, seq = None, 0
        async with asyncio.timeout(20):
            while published is None or target.served_name not in published.by_name():
                seq += 1  # resent until the SUB socket has connected (a PUB drops what it sends before)
                publisher.send_multipart([b"", seq.to_bytes(8, "big"),
                                          batch(stored([11], None, TOKENS[:4], target.served_name))])
                await asyncio.sleep(0.2)
                raw = await client.get(keys.kv_blocks("pool-a", "pod-0"))
                published = KvBlockSet.from_json(raw) if raw else None
        assert published.by_name()[target.served_name].digest == target.artifact.digest
        assert await client.pttl(keys.kv_blocks("pool-a", "pod-0")) > 0
    finally:
        stop.set()
        await running
        publisher.close(linger=0)
        await driver.close()
        await bus.close()
        await client.aclose()
