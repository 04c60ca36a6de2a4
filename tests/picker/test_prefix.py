"""Prefix hashing and the approximate / precise indexes (loraplane.picker.prefix)."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.api import AdapterBlocks, KvBlockSet, keys
from loraplane.picker.prefix import (
    PYTHON_BLOCKS,
    ApproximateIndex,
    PreciseIndex,
    PrefixHasher,
    PrefixRequest,
    prompt_text,
)

D17, D18 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
SYSTEM = "You are a claims assistant for ACME. Cite the policy section in every answer. " * 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chat(*turns: str) -> dict:
    return {"model": "claims", "messages": [{"role": "system", "content": SYSTEM}]
            + [{"role": "user", "content": t} for t in turns]}


def test_hashes_are_stable_and_chained() -> None:
    hasher = PrefixHasher(block_size=16)
    a = hasher.hash_text("claims@v17", D17, "x" * 70)
    assert len(a.hashes) == 4  # full blocks only: 70 bytes = 4 blocks of 16 and a partial one
    assert a == hasher.hash_text("claims@v17", D17, "x" * 64 + "yz")  # the partial block does not count
    b = hasher.hash_text("claims@v17", D17, "x" * 16 + "y" + "x" * 47)
    assert a.hashes[0] == b.hashes[0] and len(set(a.hashes[1:]) & set(b.hashes[1:])) == 0  # chained: later differ
    # past the blocks hashed in Python the chain goes on in numpy: still a prefix chain, for every block size
    for size in (16, 13):
        hasher = PrefixHasher(block_size=size)
        text = "".join(f"{i:0{size}d}" for i in range(PYTHON_BLOCKS + 20))
        full = hasher.hash_text("claims@v17", D17, text)
        assert len(full.hashes) == PYTHON_BLOCKS + 20 == len(set(full.hashes))
        shorter = hasher.hash_text("claims@v17", D17, text[:size * (PYTHON_BLOCKS + 5)])
        assert full.hashes[:PYTHON_BLOCKS + 5] == shorter.hashes
        changed = hasher.hash_text("claims@v17", D17, text[:size * (PYTHON_BLOCKS + 3)] + "!" + text[size * (PYTHON_BLOCKS + 3) + 1:])
        cut = PYTHON_BLOCKS + 3  # the first block that differs
        assert changed.hashes[:cut] == full.hashes[:cut] and not set(changed.hashes[cut:]) & set(full.hashes[cut:])
        assert not set(hasher.hash_text("claims@v18", D18, text).hashes) & set(full.hashes)
    odd = PrefixHasher(block_size=13)  # blocks that are not whole 8-byte words
    long, short = odd.hash_text(None, None, SYSTEM), odd.hash_text(None, None, SYSTEM[:130] + "!")
    assert long.hashes[:10] == short.hashes[:10] and len(set(long.hashes)) == len(long.hashes)


def test_revision_and_digest_are_part_of_the_key() -> None:
    hasher = PrefixHasher(block_size=16)
    text = SYSTEM
    v17 = hasher.hash_text("claims@v17", D17, text)
    assert not set(v17.hashes) & set(hasher.hash_text("claims@v18", D18, text).hashes)
    assert not set(v17.hashes) & set(hasher.hash_text("claims@v17", D18, text).hashes)  # same name, other bytes
    assert not set(v17.hashes) & set(hasher.hash_text(None, None, text).hashes)  # the base model


def test_multi_turn_chat_keeps_its_prefix() -> None:
    hasher = PrefixHasher(block_size=32)
    first = hasher.hash_request("claims@v17", D17, chat("my car was hit"))
    second = hasher.hash_request("claims@v17", D17, chat("my car was hit", "what do I file?"))
    assert first is not None and second is not None
    assert second.hashes[:len(first.hashes)] == first.hashes
    assert hasher.hash_request("m", None, {"prompt": [1, 2, 3]}) is None
    assert prompt_text({"prompt": "abc"}) == "abc"


def test_token_blocks_and_bounds() -> None:
    hasher = PrefixHasher(block_size=4, max_blocks=3, tokenizer=lambda s: [ord(c) for c in s])
    request = hasher.hash_text(None, None, "a" * 100)
    assert request.unit == "tokens" and len(request.hashes) == 3
    with pytest.raises(ValueError):
        PrefixHasher(block_size=0)


def test_approximate_index_matches_routed_prefixes_per_pod() -> None:
    index = ApproximateIndex(capacity=1000, ttl_s=60, clock=Clock())
    hasher = PrefixHasher(block_size=32)
    first = hasher.hash_request("claims@v17", D17, chat("my car was hit"))
    second = hasher.hash_request("claims@v17", D17, chat("my car was hit", "what do I file?"))
    other_revision = hasher.hash_request("claims@v18", D18, chat("my car was hit", "what do I file?"))
    assert first and second and other_revision
    index.record("pod-a", first)
    matched = index.match(["pod-a", "pod-b"], second)
    assert matched.tolist() == [len(first.hashes), 0]
    assert index.match(["pod-a"], other_revision).tolist() == [0]


def test_ttl_expires_and_routing_refreshes() -> None:
    clock = Clock()
    index = ApproximateIndex(ttl_s=10, clock=clock)
    request = PrefixHasher(block_size=16).hash_text("claims@v17", D17, SYSTEM)
    index.record("pod-a", request)
    clock.now += 9
    index.record("pod-a", request)  # routed again: the TTL starts again
    clock.now += 9
    assert index.match(["pod-a"], request).tolist() == [len(request.hashes)]
    clock.now += 2
    assert index.match(["pod-a"], request).tolist() == [0]
    assert index.blocks("pod-a") == len(request.hashes) - 1  # an expired entry is dropped once looked at


def test_lru_bounds_per_pod_and_pods() -> None:
    hasher = PrefixHasher(block_size=16)
    index = ApproximateIndex(capacity=8, max_pods=2, clock=Clock())
    old = hasher.hash_text("a@v1", None, "o" * 16 * 6)
    new = hasher.hash_text("a@v1", None, "n" * 16 * 6)
    index.record("pod-a", old)
    index.record("pod-a", new)
    assert index.blocks("pod-a") == 8
    assert index.match(["pod-a"], new).tolist() == [6]
    # the least recently routed prefix lost 4 blocks, its tail first: its head still matches
    assert index.match(["pod-a"], old).tolist() == [2]
    index.record("pod-b", new)
    index.record("pod-c", new)
    assert index.match(["pod-a", "pod-b", "pod-c"], new).tolist() == [0, 6, 6]  # pod-a was least recently routed
    index.forget("pod-b")
    assert index.match(["pod-b"], new).tolist() == [0]


def test_lru_keeps_blocks_a_newer_routing_shares() -> None:
    hasher = PrefixHasher(block_size=16)
    index = ApproximateIndex(capacity=9, clock=Clock())
    first = hasher.hash_text("a@v1", None, "s" * 48 + "a" * 48)  # 6 blocks
    second = hasher.hash_text("a@v1", None, "s" * 48 + "b" * 48)  # shares the first 3
    index.record("pod-a", first)
    index.record("pod-a", second)
    assert index.blocks("pod-a") == 9
    index.record("pod-a", hasher.hash_text("a@v1", None, "c" * 48))  # 3 more: the oldest routing's 3 own blocks go
    assert index.blocks("pod-a") == 9
    assert index.match(["pod-a"], second).tolist() == [6]  # the shared head now belongs to the newer routing
    assert index.match(["pod-a"], first).tolist() == [3]
    index.record("pod-a", hasher.hash_text("a@v1", None, "d" * 16))  # next: the second routing's tail
    assert index.match(["pod-a"], second).tolist() == [5]
    index.forget("pod-a")
    assert index.blocks("pod-a") == 0 and index.match(["pod-a"], second).tolist() == [0]


def test_routing_one_prompt_again_and_again_keeps_memory_bounded() -> None:
    hasher = PrefixHasher(block_size=16)
    index = ApproximateIndex(capacity=64, clock=Clock())
    for _ in range(1000):  # each routing a fresh hash tuple of the same 8 blocks (as each request hashes its own)
        index.record("pod-a", hasher.hash_text("a@v1", None, "s" * 128))
    held = index._pods["pod-a"]
    assert index.blocks("pod-a") == 8 and len(held.routings) == 1 and held.slots == 8
    for turn in range(1, 200):  # a session that grows: each turn supersedes the last one's blocks
        index.record("pod-a", hasher.hash_text("a@v1", None, "s" * 128 + "t" * 16 * turn))
        assert sum(r.left for r in held.routings.values()) == held.slots <= 2 * 64
        assert sum(r.owned for r in held.routings.values()) == index.blocks("pod-a") <= 64
    # the last turn (207 blocks) kept its head: the LRU took tails first
    assert index.match(["pod-a"], hasher.hash_text("a@v1", None, "s" * 128 + "t" * 16 * 199)).tolist() == [64]


def test_precise_index_reads_published_block_sets() -> None:
    clock = Clock()
    hasher = PrefixHasher(block_size=4, tokenizer=lambda s: [ord(c) for c in s])
    request = hasher.hash_text("claims@v17", D17, "abcdefghijkl")
    published = KvBlockSet(pool="pool-a", pod="pod-a", block_size=4, heartbeat_at=clock.now, ttl_seconds=5,
                           adapters=[AdapterBlocks(served_name="claims@v17", digest=D17,
                                                   block_hashes=[h.hex() for h in request.hashes[:2]])])
    index = PreciseIndex(wall_clock=clock)
    index.update(published)
    assert index.match(["pod-a", "pod-b"], request).tolist() == [2, 0]
    assert index.match(["pod-a"], PrefixHasher(block_size=8, tokenizer=lambda s: [ord(c) for c in s])
                       .hash_text("claims@v17", D17, "abcdefghijkl")).tolist() == [0]  # other block size
    assert index.match(["pod-a"], PrefixHasher(block_size=4).hash_text("claims@v17", D17, "abcdefghijkl")
                       ).tolist() == [0]  # byte blocks never match a runtime's token blocks
    clock.now += 6
    assert index.match(["pod-a"], request).tolist() == [0]  # stale


async def test_precise_index_refresh_reads_redis_and_drops_foreign_sets(redis_srv) -> None:
    hasher = PrefixHasher(block_size=4, tokenizer=lambda s: [ord(c) for c in s])
    request = hasher.hash_text(None, None, "abcdefgh")
    blocks = [AdapterBlocks(block_hashes=[h.hex() for h in request.hashes])]
    client = aioredis.Redis.from_url(redis_srv.url)
    index = PreciseIndex()
    try:
        good = KvBlockSet(pool="pool-a", pod="pod-0", block_size=4, heartbeat_at=time.time(), adapters=blocks)
        await client.set(keys.kv_blocks("pool-a", "pod-0"), good.to_json())
        foreign = good.model_copy(update={"pod": "pod-9"})  # a set written under another pod's key
        await client.set(keys.kv_blocks("pool-a", "pod-1"), foreign.to_json())
        other_scheme = good.model_copy(update={"pod": "pod-2", "hash_scheme": "other/2"})
        await client.set(keys.kv_blocks("pool-a", "pod-2"), other_scheme.to_json())
        await client.set(keys.kv_blocks("pool-a", "pod-3"), b"{not json")
        pods = ["pod-0", "pod-1", "pod-2", "pod-3", "pod-4"]
        await index.refresh(client, "pool-a", pods)
        assert index.match(pods, request).tolist() == [2, 0, 0, 0, 0]
        await client.delete(keys.kv_blocks("pool-a", "pod-0"))
        await index.refresh(client, "pool-a", pods)
        assert index.match(pods, request).tolist() == [0, 0, 0, 0, 0]  # gone from Redis: forgotten
    finally:
        await client.aclose()


def _held_runs(index: ApproximateIndex, request: PrefixRequest, now: float) -> dict[str, int]:
    """Pod -> leading blocks of ``request`` held there unexpired, read block by block from the index's own maps."""
    runs = {}
    for pod, held in index._pods.items():
        n = 0
        while n < len(request.hashes) and (r := held.owner.get(request.hashes[n])) is not None and r.expires > now:
            n += 1
        if n:
            runs[pod] = n
    return runs


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["record", "match"]), st.sampled_from(["pod-a", "pod-b"]),
                          st.sampled_from(["", "s", "ss", "st"]), st.integers(1, 12), st.integers(0, 4)), max_size=40))
def test_matches_are_the_unexpired_leading_blocks_each_pod_holds(steps: list[tuple[str, str, str, int, int]]) -> None:
    clock = Clock()
    hasher = PrefixHasher(block_size=4)
    index = ApproximateIndex(capacity=24, ttl_s=5, clock=clock)
    for action, pod, head, blocks, wait in steps:
        request = hasher.hash_text("a@v1", None, (head * 16 + "x" * 4 * blocks)[: 4 * blocks])  # each a new tuple
        clock.now += wait
        if action == "record":
            index.record(pod, request)
        else:
            assert index.matches(request) == _held_runs(index, request, clock.now)
