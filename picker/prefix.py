"""Prefix-cache signal: chained hashes of a prompt's prefix blocks, and indexes that say how much of it each pod holds.

A prompt (the completion ``prompt``, or chat ``messages`` rendered by a chat template) is cut into full blocks of
``block_size`` UTF-8 bytes or tokens; block ``i``'s hash covers the served name, the artifact digest and every block up
to ``i``, so equal hashes mean an equal prefix for the same revision (a prefix cached for ``v17`` is never a hit for
``v18``). Runtimes cache only full blocks, so a trailing partial block is not hashed.

Two indexes answer ``match(endpoints, request)`` (matched prefix length per endpoint, in blocks):
- :class:`ApproximateIndex` remembers where the picker routed each prefix (a bounded LRU per pod with a TTL);
- :class:`PreciseIndex` holds the block sets the sidecars publish from vLLM's KV-cache events
  (``loraplane.api.KvBlockSet``), hashed the same way in the token domain.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import ValidationError

from loraplane.api import PREFIX_HASH_SCHEME, SCHEMA_VERSION, KvBlockSet, keys, prefix_root_hash
from loraplane.api.prefix import chain, token_block_bytes

#: A prefix block's chained hash (16 bytes).
BlockHash = bytes
IntArray = np.ndarray[Any, np.dtype[np.int64]]
Tokenizer = Callable[[str], Sequence[int]]
ChatTemplate = Callable[[Sequence[Mapping[str, Any]]], str]


def plain_chat_template(messages: Sequence[Mapping[str, Any]]) -> str:
    """A stable rendering of chat messages (role and text, one per line) that keeps earlier turns a prefix of later
    ones; use the runtime's own template where the hashes must equal the runtime's (precise mode)."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        parts.append(f"<|{message.get('role', '')}|>\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def prompt_text(document: Mapping[str, Any], chat_template: ChatTemplate = plain_chat_template) -> str | None:
    """The text a runtime would prefill for an OpenAI request body: ``prompt`` (a string) or the rendered
    ``messages``; None when the body has neither (or a token-id or batched prompt)."""
    prompt = document.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = document.get("messages")
    if isinstance(messages, list) and all(isinstance(m, Mapping) for m in messages):
        return chat_template(messages)
    return None


@dataclass(frozen=True, slots=True)
class PrefixRequest:
    """One request's prefix blocks: their chained hashes (at most ``max_blocks``) and the block size."""

    hashes: tuple[BlockHash, ...]
    block_size: int
    unit: Literal["bytes", "tokens"]


@dataclass(frozen=True)
class PrefixHasher:
    """Cuts a prompt into blocks of ``block_size`` UTF-8 bytes (64 bytes: about 16 tokens of English text), or of
    ``block_size`` tokens when a ``tokenizer`` is given, and hashes them keyed by served name and digest.
    ``max_blocks`` bounds the work per request (a longer prefix matches at most that many blocks)."""

    block_size: int = 64
    max_blocks: int = 1024
    tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate = plain_chat_template

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_blocks < 1:
            raise ValueError("block_size and max_blocks must be >= 1")

    def blocks(self, text: str) -> list[bytes]:
        """The prompt's full blocks, as the bytes that are hashed."""
        size, limit = self.block_size, self.block_size * self.max_blocks
        if self.tokenizer is None:
            data = text.encode()[:limit]
            return [data[i:i + size] for i in range(0, len(data) - size + 1, size)]
        tokens = list(self.tokenizer(text))[:limit]
        return [token_block_bytes(tokens[i:i + size]) for i in range(0, len(tokens) - size + 1, size)]

    def hash_text(self, served_name: str | None, digest: str | None, text: str) -> PrefixRequest:
        """The request's prefix blocks for a prompt text."""
        unit: Literal["bytes", "tokens"] = "bytes" if self.tokenizer is None else "tokens"
        hashes = chain(prefix_root_hash(served_name, digest), self.blocks(text))
        return PrefixRequest(tuple(hashes), self.block_size, unit)

    def hash_request(self, served_name: str | None, digest: str | None,
                     document: Mapping[str, Any]) -> PrefixRequest | None:
        """The request's prefix blocks for an OpenAI request body (None when it has no text prompt)."""
        text = prompt_text(document, self.chat_template)
        return None if text is None else self.hash_text(served_name, digest, text)


class PrefixMatcher(Protocol):
    """What a prefix scorer calls: matched prefix length (blocks) of ``request`` on each of ``endpoints``."""

    def match(self, endpoints: Sequence[str], request: PrefixRequest) -> IntArray:
        """One count per endpoint: how many leading blocks of the request the endpoint holds."""
        ...


def _leading_run(hashes: Sequence[BlockHash], held: Callable[[BlockHash], bool]) -> int:
    for i, h in enumerate(hashes):
        if not held(h):
            return i
    return len(hashes)


class ApproximateIndex:
    """Where requests were routed: per pod, a bounded LRU of block hashes (``capacity`` per pod), each expiring
    ``ttl_s`` after it was last routed there. ``max_pods`` bounds the pods remembered (least recently routed go)."""

    def __init__(self, capacity: int = 65_536, ttl_s: float = 600.0, max_pods: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1 or ttl_s <= 0 or max_pods < 1:
            raise ValueError("capacity and max_pods must be >= 1, ttl_s > 0")
        self.capacity, self.ttl_s, self.max_pods = capacity, ttl_s, max_pods
        self._clock = clock
        self._pods: collections.OrderedDict[str, collections.OrderedDict[BlockHash, float]] = (
            collections.OrderedDict())

    def record(self, pod: str, request: PrefixRequest) -> None:
        """The request was routed to ``pod``: its blocks are (about to be) cached there."""
        blocks = self._pods.pop(pod, None)
        if blocks is None:
            blocks = collections.OrderedDict()
        self._pods[pod] = blocks
        while len(self._pods) > self.max_pods:
            self._pods.popitem(last=False)
        expires = self._clock() + self.ttl_s
        for h in request.hashes:
            blocks[h] = expires
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def forget(self, pod: str) -> None:
        """Drop everything recorded for ``pod`` (it left the pool or its runtime restarted)."""
        self._pods.pop(pod, None)

    def blocks(self, pod: str) -> int:
        """How many block hashes are remembered for ``pod`` (expired ones included until they are looked at)."""
        return len(self._pods.get(pod, ()))

    def match(self, endpoints: Sequence[str], request: PrefixRequest) -> IntArray:
        """Leading blocks of ``request`` routed to each endpoint within the TTL."""
        now = self._clock()
        out = np.zeros(len(endpoints), dtype=np.int64)
        for i, pod in enumerate(endpoints):
            blocks = self._pods.get(pod)
            if not blocks:
                continue

            def held(h: BlockHash, blocks: collections.OrderedDict[BlockHash, float] = blocks) -> bool:
                expires = blocks.get(h)
                if expires is None:
                    return False
                if expires <= now:
                    del blocks[h]
                    return False
                return True

            out[i] = _leading_run(request.hashes, held)
        return out


class PreciseIndex:
    """The pods' published ``KvBlockSet``s (the sidecar's view of vLLM's KV-cache events) as a ``PrefixMatcher``.

    A set counts only while fresh (``heartbeat_at + ttl_seconds`` ahead of ``wall_clock``) and only for requests
    hashed with its block size in tokens.
    """

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall_clock = wall_clock
        self._sets: dict[str, tuple[KvBlockSet, frozenset[BlockHash]]] = {}

    def update(self, block_set: KvBlockSet) -> None:
        """Replace the pod's block set."""
        hashes = frozenset(bytes.fromhex(h) for entry in block_set.adapters for h in entry.block_hashes)
        self._sets[block_set.pod] = (block_set, hashes)

    def forget(self, pod: str) -> None:
        """Drop the pod's block set."""
        self._sets.pop(pod, None)

    async def refresh(self, redis: Any, pool: str, pods: Sequence[str]) -> None:
        """Read the pods' published sets (``keys.kv_blocks``) from a redis.asyncio client: a missing, invalid or
        foreign set (another pool, pod, schema or hash scheme) drops what was held for that pod."""
        raw = await redis.mget([keys.kv_blocks(pool, pod) for pod in pods]) if pods else []
        for pod, value in zip(pods, raw, strict=True):
            block_set = _parse_block_set(value)
            if block_set is None or (block_set.pool, block_set.pod) != (pool, pod):
                self.forget(pod)
            else:
                self.update(block_set)

    def match(self, endpoints: Sequence[str], request: PrefixRequest) -> IntArray:
        """Leading blocks of ``request`` each endpoint's runtime reported cached."""
        now = self._wall_clock()
        out = np.zeros(len(endpoints), dtype=np.int64)
        for i, pod in enumerate(endpoints):
            entry = self._sets.get(pod)
            if entry is None:
                continue
            block_set, hashes = entry
            fresh = block_set.heartbeat_at + block_set.ttl_seconds > now
            if fresh and request.unit == "tokens" and request.block_size == block_set.block_size:
                out[i] = _leading_run(request.hashes, hashes.__contains__)
        return out


def _parse_block_set(raw: bytes | str | None) -> KvBlockSet | None:
    if raw is None:
        return None
    try:
        block_set = KvBlockSet.from_json(raw)
    except ValidationError:
        return None
    ok = block_set.schema_version == SCHEMA_VERSION and block_set.hash_scheme == PREFIX_HASH_SCHEME
    return block_set if ok else None


def bench_hashing(body_bytes: int = 64 * 1024, block_size: int = 64, repeats: int = 50,
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Time hashing a chat body of ``body_bytes`` (byte blocks, the picker's request-path work; ``max_blocks``
    high enough to hash all of it), median of ``repeats``."""
    import orjson

    text = ("You are a claims assistant. Answer briefly and cite the policy section. " * 1024)[:body_bytes]
    document = orjson.loads(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}))
    hasher = PrefixHasher(block_size=block_size, max_blocks=body_bytes // block_size + 1)
    times, request = [], None
    for _ in range(repeats):
        start = clock()
        request = hasher.hash_request("claims@v18", "sha256:" + "0" * 64, document)
        times.append(clock() - start)
    assert request is not None
    return {"benchmark": "prefix-hash", "body_bytes": body_bytes, "block_size": block_size, "unit": "bytes",
            "blocks": len(request.hashes), "repeats": repeats,
            "median_ms": round(float(np.median(times)) * 1000, 3), "p99_ms": round(float(np.quantile(times, 0.99)) * 1000, 3)}


if __name__ == "__main__":
    import json

    print(json.dumps(bench_hashing()))
