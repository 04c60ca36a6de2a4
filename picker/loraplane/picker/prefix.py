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
import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
from prometheus_client import Counter
from pydantic import Field, model_validator

from loraplane.api import (
    PREFIX_HASH_SCHEME,
    ApiModel,
    KvBlockSet,
    keys,
    prefix_root_hash,
    read_payload_or_none,
)
from loraplane.api.prefix import chain, token_block_bytes
from loraplane.picker.lifecycle import InFlightRequest, PluginRuntime, RequestPlugin
from loraplane.picker.plugins import Cycle, PluginKind, PluginType, SchedulingRequest, register
from loraplane.picker.snapshot import FloatArray, PoolSnapshot

if TYPE_CHECKING:
    from loraplane.picker.scheduler import EndpointPickerConfig

log = logging.getLogger(__name__)

#: A prefix block's chained hash: 16 bytes for token blocks (the scheme shared with the sidecars), a 64-bit integer
#: for byte blocks (``byte_block_hashes``: only this process compares them).
BlockHash = bytes | int
IntArray = np.ndarray[Any, np.dtype[np.int64]]
Tokenizer = Callable[[str], Sequence[int]]
ChatTemplate = Callable[[Sequence[Mapping[str, Any]]], str]


_U64 = 1 << 64
_BASE = 0xC2B2AE3D27D4EB4F
_BASE_INVERSE = pow(_BASE, -1, _U64)
#: the most blocks one prompt is hashed into (``PrefixCacheParameters.max_blocks`` is at most this)
MAX_BLOCKS = 65_536
_SHIFT = np.uint64(33)
_MIX1, _MIX2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


def _power_table(base: int, count: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    powers, value = [], 1
    for _ in range(count):
        powers.append(value)
        value = value * base % _U64
    return np.asarray(powers, dtype=np.uint64)


@functools.lru_cache(maxsize=8)
def _power_tables(count: int) -> tuple[np.ndarray[Any, np.dtype[np.uint64]], np.ndarray[Any, np.dtype[np.uint64]]]:
    return _power_table(_BASE, count), _power_table(_BASE_INVERSE, count)


def _powers(n: int) -> tuple[np.ndarray[Any, np.dtype[np.uint64]], np.ndarray[Any, np.dtype[np.uint64]]]:
    """``B^i`` and ``B^-i`` mod 2^64 for i < n: views of tables of the next power of two (at least 1,024)."""
    up, down = _power_tables(max(1024, 1 << (n - 1).bit_length()))
    return up[:n], down[:n]


@functools.lru_cache(maxsize=16)
def _word_keys(count: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.asarray([(0x9E3779B97F4A7C15 * (2 * k + 1)) % _U64 | 1 for k in range(count)], dtype=np.uint64)


#: a prompt's first this many blocks are hashed one by one in Python (~0.2 us a block), the rest in numpy (a dozen
#: calls, ~12 us whatever the count): a short prompt never pays numpy's fixed cost
PYTHON_BLOCKS = 16


@functools.lru_cache(maxsize=4096)
def _root_seed(root: bytes) -> int:
    return int.from_bytes(root[:8], "little")


def byte_block_hashes(root: bytes, data: bytes, size: int) -> tuple[int, ...]:
    """64-bit hashes of every full ``size``-byte block of ``data`` (at most ``MAX_BLOCKS``), each covering ``root``
    and every block up to it. The first ``PYTHON_BLOCKS`` chain Python's hash of (previous hash, block bytes)
    (SipHash, keyed per process: only this process compares them, and no client can aim a collision at them); the
    rest chain on from the last of those in numpy (``_numpy_chain``). Not a cryptographic hash: a collision can only
    make a request look cached where it is not."""
    n = min(len(data) // size, MAX_BLOCKS)
    h, hashes = _root_seed(root), []
    for start in range(0, min(n, PYTHON_BLOCKS) * size, size):
        h = hash((h, data[start:start + size]))
        hashes.append(h)
    if n > PYTHON_BLOCKS:
        hashes += _numpy_chain(h % _U64, data[PYTHON_BLOCKS * size:n * size], size)
    return tuple(hashes)


def _numpy_chain(seed: int, data: bytes, size: int) -> list[int]:
    """The chained hashes of ``data``'s ``size``-byte blocks after one whose hash is ``seed``, in a dozen in-place
    numpy operations: block j's 8-byte words, weighted by fixed odd keys and summed, give ``d_j``, spread by
    MurmurHash3's 64-bit finaliser; block i's hash is the polynomial ``seed B^(i+1) + sum_{j<=i} d_j B^(i-j)``
    mod 2^64, from one cumulative sum."""
    n = len(data) // size
    if size % 8:
        padded = np.zeros((n, size + 8 - size % 8), dtype=np.uint8)
        padded[:, :size] = np.frombuffer(data, np.uint8, n * size).reshape(n, size)
        words = padded.view(np.uint64)
    else:
        words = np.frombuffer(data, np.uint64, n * size // 8).reshape(n, size // 8)
    x = words @ _word_keys(words.shape[1])  # uint64 arithmetic wraps: mod 2^64
    x ^= x >> _SHIFT
    x *= _MIX1
    x ^= x >> _SHIFT
    x *= _MIX2
    x ^= x >> _SHIFT
    up, down = _powers(n)
    x *= down
    x[0] = (x.item(0) + seed * _BASE) % _U64  # B^0 = 1: the seed enters every prefix sum
    x.cumsum(out=x)
    x *= up
    result: list[int] = x.tolist()
    return result


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

    def hash_text(self, served_name: str | None, digest: str | None, text: str) -> PrefixRequest:
        """The request's prefix blocks for a prompt text: byte blocks as ``byte_block_hashes`` (the picker's own),
        token blocks in the scheme the sidecars share (``loraplane.api.prefix``)."""
        root, size, limit = prefix_root_hash(served_name, digest), self.block_size, self.block_size * self.max_blocks
        if self.tokenizer is None:
            data = text[:limit].encode()[:limit]  # a character is at least one byte: encode no more than needed
            return PrefixRequest(byte_block_hashes(root, data, size), size, "bytes")
        tokens = list(self.tokenizer(text))[:limit]
        blocks = [token_block_bytes(tokens[i:i + size]) for i in range(0, len(tokens) - size + 1, size)]
        return PrefixRequest(tuple(chain(root, blocks)), size, "tokens")

    def hash_request(self, served_name: str | None, digest: str | None,
                     document: Mapping[str, Any]) -> PrefixRequest | None:
        """The request's prefix blocks for an OpenAI request body (None when it has no text prompt)."""
        text = prompt_text(document, self.chat_template)
        return None if text is None else self.hash_text(served_name, digest, text)


class PrefixMatcher(Protocol):
    """What a prefix scorer calls: the endpoints holding leading blocks of ``request``."""

    def matches(self, request: PrefixRequest) -> dict[str, int]:
        """Endpoint -> how many leading blocks of the request it holds (endpoints holding none are left out)."""
        ...


def _vector(runs: Mapping[str, int], endpoints: Sequence[str]) -> IntArray:
    return np.fromiter((runs.get(e, 0) for e in endpoints), np.int64, len(endpoints))


class _Routing:
    """One prefix routed to a pod (keyed by its last block): its block hashes, when it expires, how many of its
    leading blocks the LRU has not yet reached (``left``) and how many blocks it is the latest routing of (``owned``:
    the rest were routed again since, by a longer prompt or a newer routing)."""

    __slots__ = ("expires", "hashes", "left", "owned")

    def __init__(self, expires: float, hashes: tuple[BlockHash, ...]) -> None:
        self.expires, self.hashes, self.left, self.owned = expires, hashes, len(hashes), 0


class _PodBlocks:
    """One pod's remembered blocks: hash -> its latest routing there, the routings least recently routed first,
    and how many hashes they still reference (``slots``: owned, or superseded and not yet reached by the LRU)."""

    __slots__ = ("owner", "routings", "slots")

    def __init__(self) -> None:
        self.owner: dict[BlockHash, _Routing] = {}
        self.routings: collections.OrderedDict[BlockHash, _Routing] = collections.OrderedDict()
        self.slots = 0


class ApproximateIndex:
    """Where requests were routed: per pod, a bounded LRU of block hashes (``capacity`` per pod), each expiring
    ``ttl_s`` after it was last routed there. ``max_pods`` bounds the pods remembered (least recently routed go).

    The LRU evicts from the least recently routed prefix, its last block first, so under pressure a prefix loses its
    tail before its head (as a runtime's cache does); a block routed again since belongs to the newer routing and
    stays. Only first blocks are indexed by hash (the pods they were routed to): a match looks up the request's
    first block, then walks the blocks in each of those pods' own map, so it costs the matched prefix, not the pool.
    Recording costs a few C-level passes over the request's hashes and evicts block by block only what it owns
    (an OrderedDict of blocks cost ~1 us a block in moves and pops).
    """

    def __init__(self, capacity: int = 65_536, ttl_s: float = 600.0, max_pods: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1 or ttl_s <= 0 or max_pods < 1:
            raise ValueError("capacity and max_pods must be >= 1, ttl_s > 0")
        self.capacity, self.ttl_s, self.max_pods = capacity, ttl_s, max_pods
        self._clock = clock
        #: pod -> its blocks, least recently routed pod first
        self._pods: collections.OrderedDict[str, _PodBlocks] = collections.OrderedDict()
        #: first block hash -> the pods it was routed to
        self._first: dict[BlockHash, set[str]] = {}

    def record(self, pod: str, request: PrefixRequest) -> None:
        """The request was routed to ``pod``: its blocks are (about to be) cached there."""
        hashes = request.hashes
        if not hashes:
            return
        blocks = self._pods.get(pod)
        if blocks is None:
            blocks = self._pods[pod] = _PodBlocks()
            while len(self._pods) > self.max_pods:
                self.forget(next(iter(self._pods)))
        else:
            self._pods.move_to_end(pod)
        routing = blocks.routings.get(hashes[-1])
        if routing is None:  # a new prefix here
            routing = blocks.routings[hashes[-1]] = _Routing(0.0, hashes)
            blocks.slots += len(hashes)
        else:  # the same prefix again: it becomes the most recent, whole again
            blocks.routings.move_to_end(hashes[-1])
            if routing.owned == routing.left == len(hashes):  # it still owns every block: only its expiry moves
                routing.expires = self._clock() + self.ttl_s
                return
            blocks.slots += len(hashes) - routing.left
            routing.left = len(hashes)
        routing.expires = self._clock() + self.ttl_s
        owner = blocks.owner
        previous = set(map(owner.get, hashes))  # C-level passes: most prompts are new here ({None})
        if len(previous) > 1 or None not in previous:  # some blocks were routed here before: their owners lose them
            for earlier, count in collections.Counter(map(owner.get, hashes)).items():
                if earlier is not None:
                    earlier.owned -= count
        owner.update(zip(hashes, itertools.repeat(routing)))
        routing.owned = len(hashes)
        pods = self._first.get(hashes[0])
        if pods is None:
            self._first[hashes[0]] = {pod}
        else:
            pods.add(pod)
        self._evict(pod, blocks)

    def _evict(self, pod: str, blocks: _PodBlocks) -> None:
        """While the pod is over its bounds: evict the least recently routed prefix's blocks, last first, skipping
        those a newer routing owns; a prefix that owns no block any more goes whole. Over the routings' or
        references' bound, the least recently routed prefixes go whole."""
        owner, routings = blocks.owner, blocks.routings
        excess = len(owner) - self.capacity
        while excess > 0:
            oldest = next(iter(routings.values()))
            hashes, left = oldest.hashes, oldest.left
            if oldest.owned == left:  # it owns all it has left (the common case): its tail goes in one C-level pass
                count = min(excess, left)
                collections.deque(map(owner.__delitem__, hashes[left - count:left]), maxlen=0)
                left -= count
                oldest.owned -= count
                excess -= count
            while oldest.owned and excess > 0:
                left -= 1
                h = hashes[left]
                if owner.get(h) is oldest:
                    del owner[h]
                    oldest.owned -= 1
                    excess -= 1
            blocks.slots -= oldest.left - left
            oldest.left = left
            if not oldest.owned:
                self._drop_oldest(pod, blocks)
        while len(routings) > self.capacity or blocks.slots > 2 * self.capacity:
            self._drop_oldest(pod, blocks)

    def _drop_oldest(self, pod: str, blocks: _PodBlocks) -> None:
        """Forget the least recently routed prefix and the blocks it still owns."""
        oldest = blocks.routings.popitem(last=False)[1]
        blocks.slots -= oldest.left
        owner = blocks.owner
        for h in oldest.hashes[:oldest.left] if oldest.owned else ():
            if owner.get(h) is oldest:
                del owner[h]
        if oldest.hashes[0] not in owner:
            self._unfirst(pod, oldest.hashes[0])

    def _unfirst(self, pod: str, h: BlockHash) -> None:
        pods = self._first.get(h)
        if pods is not None:
            pods.discard(pod)
            if not pods:
                del self._first[h]

    def forget(self, pod: str) -> None:
        """Drop everything recorded for ``pod`` (it left the pool or its runtime restarted)."""
        blocks = self._pods.pop(pod, None)
        for routing in blocks.routings.values() if blocks is not None else ():
            self._unfirst(pod, routing.hashes[0])

    def blocks(self, pod: str) -> int:
        """How many block hashes are remembered for ``pod`` (expired ones included until they are looked at)."""
        blocks = self._pods.get(pod)
        return 0 if blocks is None else len(blocks.owner)

    def matches(self, request: PrefixRequest) -> dict[str, int]:
        """Pod -> leading blocks of ``request`` routed there within the TTL (an expired block met is dropped)."""
        if not request.hashes:
            return {}
        now = self._clock()
        hashes, runs = request.hashes, {}
        for pod in list(self._first.get(hashes[0], ())):
            owner = self._pods[pod].owner
            last = owner.get(hashes[-1])
            if last is not None and last.owned == len(hashes) and last.expires > now and last.hashes == hashes:
                runs[pod] = len(hashes)  # this prompt routed here whole, every block still its own: all match
                continue
            owners = list(map(owner.get, hashes))  # C-level passes, then a check per distinct routing (a few)
            n = owners.index(None) if None in owners else len(owners)
            for routing in set(owners[:n]):
                if routing is not None and routing.expires <= now:  # (no None before n)
                    n = min(n, owners.index(routing))
            if n < len(hashes):
                expired = owners[n]
                if expired is not None:  # met expired: dropped
                    del owner[hashes[n]]
                    expired.owned -= 1
                if n == 0:
                    self._unfirst(pod, hashes[0])
            if n:
                runs[pod] = n
        return runs

    def match(self, endpoints: Sequence[str], request: PrefixRequest) -> IntArray:
        """``matches`` as one count per endpoint of ``endpoints``."""
        return _vector(self.matches(request), endpoints)


class PreciseIndex:
    """The pods' published ``KvBlockSet``s (the sidecar's view of vLLM's KV-cache events) as a ``PrefixMatcher``.

    A set counts only while fresh (``heartbeat_at + ttl_seconds`` ahead of ``wall_clock``) and only for requests
    hashed with its block size in tokens.
    """

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall_clock = wall_clock
        self._sets: dict[str, tuple[KvBlockSet, frozenset[BlockHash]]] = {}
        self._holders: dict[BlockHash, set[str]] = {}

    def update(self, block_set: KvBlockSet) -> None:
        """Replace the pod's block set."""
        hashes = frozenset(bytes.fromhex(h) for entry in block_set.adapters for h in entry.block_hashes)
        old = self._sets.get(block_set.pod)
        self._sets[block_set.pod] = (block_set, hashes)
        pod = block_set.pod
        for h in old[1] - hashes if old is not None else ():
            self._unhold(pod, h)
        for h in hashes - old[1] if old is not None else hashes:
            self._holders.setdefault(h, set()).add(pod)

    def _unhold(self, pod: str, h: BlockHash) -> None:
        pods = self._holders.get(h)
        if pods is not None:
            pods.discard(pod)
            if not pods:
                del self._holders[h]

    def forget(self, pod: str) -> None:
        """Drop the pod's block set."""
        old = self._sets.pop(pod, None)
        for h in old[1] if old is not None else ():
            self._unhold(pod, h)

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

    def matches(self, request: PrefixRequest) -> dict[str, int]:
        """Pod -> leading blocks of ``request`` its runtime reported cached (fresh sets of the request's block
        size in tokens only)."""
        if request.unit != "tokens" or not request.hashes:
            return {}
        now = self._wall_clock()
        runs = {}
        for pod in self._holders.get(request.hashes[0], ()):
            block_set, held = self._sets[pod]
            if block_set.block_size != request.block_size or block_set.heartbeat_at + block_set.ttl_seconds <= now:
                continue
            runs[pod] = len(list(itertools.takewhile(held.__contains__, request.hashes)))
        return runs

    def match(self, endpoints: Sequence[str], request: PrefixRequest) -> IntArray:
        """``matches`` as one count per endpoint of ``endpoints``."""
        return _vector(self.matches(request), endpoints)


def _parse_block_set(raw: bytes | str | None) -> KvBlockSet | None:
    block_set = read_payload_or_none(KvBlockSet, raw, log)
    return block_set if block_set is not None and block_set.hash_scheme == PREFIX_HASH_SCHEME else None


# --- the scorer plugin -------------------------------------------------------------------------------------------


class PrefixCacheParameters(ApiModel):
    """``prefix-cache-scorer``: how prompts are cut into blocks and where the blocks' whereabouts come from."""

    #: approximate: where this picker routed each prefix; precise: what the pods' runtimes report cached
    #: (``KvBlockSet`` from vLLM's KV-cache events, read from Redis; needs ``unit: tokens``)
    mode: Literal["approximate", "precise"] = "approximate"
    #: bytes or tokens per block; in precise mode the runtime's ``--block-size``
    block_size: int = Field(default=64, ge=1)
    unit: Literal["bytes", "tokens"] = "bytes"
    #: the model's ``tokenizer.json`` (``unit: tokens``): prompts are tokenised as the runtime does, BOS included
    tokenizer: str | None = None
    #: the most blocks hashed per request (a longer prompt matches at most this many): 256, GIE's prefix plugin
    #: default (16 KiB of 64-byte blocks)
    max_blocks: int = Field(default=256, ge=1, le=MAX_BLOCKS)
    #: approximate mode: block hashes remembered per pod, their TTL after the last routing there, pods remembered
    lru_capacity: int = Field(default=65_536, ge=1)
    ttl_seconds: float = Field(default=600.0, gt=0)
    max_pods: int = Field(default=4096, ge=1)
    #: converts byte blocks to tokens for the saved prefill (this score's and the ``predicted-ttft-scorer``'s)
    bytes_per_token: float = Field(default=4.0, gt=0)
    #: None: the score is the share of the prefix an endpoint holds (llm-d's prefix scorer). A number: the score is
    #: the prefill the endpoint's match saves, ``matched tokens x prefillSecondsPerToken``, over
    #: ``fullScoreSeconds`` (at most 1), so a long prompt's hit outweighs a short one's: with this scorer's weight
    #: equal to the ``prefill-queue-scorer``'s and ``fullScoreSeconds = capacity x`` the seconds one request
    #: awaiting its first token adds to the wait of those behind it, a pod holding the prefix wins over one with
    #: ``k`` fewer such requests exactly when the prefill it saves exceeds ``k`` such waits
    prefill_seconds_per_token: float | None = Field(default=None, gt=0)
    full_score_seconds: float = Field(default=1.0, gt=0)
    #: with ``prefillSecondsPerToken``: the least score per matched share, so a short prompt's hit, which saves
    #: little prefill, still scores ``shareFloor x`` its share (and still outweighs the light load scorers)
    share_floor: float = Field(default=0.0, ge=0, le=1)
    #: score only endpoints below saturation (as tier affinity); false: every endpoint, as llm-d's prefix scorer
    below_saturation_only: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> PrefixCacheParameters:
        if self.unit == "tokens" and not self.tokenizer:
            raise ValueError("unit: tokens needs a tokenizer (the model's tokenizer.json)")
        if self.mode == "precise" and self.unit != "tokens":
            raise ValueError("mode: precise needs unit: tokens (runtimes report token blocks)")
        return self


def precise_parameters(block_size: int, tokenizer: str | Path) -> dict[str, object]:
    """``prefix-cache-scorer`` parameters for precise mode against a runtime with ``--block-size block_size`` and
    KV-cache events on (``EndpointPickerConfig.with_parameters("prefix-cache-scorer", **precise_parameters(...))``)."""
    return {"mode": "precise", "unit": "tokens", "blockSize": block_size, "tokenizer": str(tokenizer)}


def _load_tokenizer(path: str) -> Tokenizer:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(path)
    return lambda text: tokenizer.encode(text).ids


class PrefixCacheScorer:
    """``prefix-cache-scorer``: the share of a request's prefix blocks each endpoint holds, or with
    ``prefillSecondsPerToken`` the prefill that share saves (in [0, 1], on endpoints below saturation only, like tier
    affinity, unless ``belowSaturationOnly: false``), for the same served name and digest.

    How a caller feeds it (the picker does all of this; the simulator and tests call the same methods):

    1. hash once per request from the parsed body: ``Scheduler.read_body(request, document)`` (the director's
       prepare stage; this plugin's ``read_body``, a ``BodyReader``), or ``hash_text`` / any ``PrefixRequest``
       passed as ``SchedulingRequest(..., prefix=prefix)``; a request without one gets no prefix score;
    2. ``Scheduler.schedule`` runs its prepare-data stage (``prepare``: ``cycle_match``) once per cycle, which fills
       ``Cycle.prefix_hit`` / ``Cycle.prefix_tokens``, read by this score, the ``predicted-ttft-scorer``'s saved
       prefill and the decision's prefill estimate;
    3. after the decision, ``routed(prefix, endpoint_address)``: the approximate index learns where the prefix went
       (the picker's lifecycle does it in ``pre_request``: this plugin's ``request_hooks``, ``PrefixRouting``; it
       also counts the metrics);
    4. precise mode: the pods' block sets go into ``index`` (a ``PreciseIndex``: ``refresh`` from Redis, the
       picker's state sync does it; or ``update(KvBlockSet)``).

    Approximate mode keys pods by address (what routing returns), precise mode by pod name (what sidecars publish).
    """

    def __init__(self, params: PrefixCacheParameters, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.params = params
        tokenizer = _load_tokenizer(params.tokenizer) if params.unit == "tokens" and params.tokenizer else None
        self.hasher = PrefixHasher(params.block_size, params.max_blocks, tokenizer)
        self.index: ApproximateIndex | PreciseIndex = (
            PreciseIndex(wall_clock) if params.mode == "precise"
            else ApproximateIndex(params.lru_capacity, params.ttl_seconds, params.max_pods, clock))
        self._tokens_per_block = params.block_size / (params.bytes_per_token if params.unit == "bytes" else 1.0)
        #: the last cycle's match (the request, the snapshot, matched blocks per endpoint), for ``routed``
        self._last: tuple[PrefixRequest, PoolSnapshot, IntArray] | None = None

    @property
    def precise_index(self) -> PreciseIndex | None:
        """The index the pods' published block sets go into (precise mode), else None."""
        return self.index if isinstance(self.index, PreciseIndex) else None

    def hash_request(self, served_name: str | None, digest: str | None,
                     document: Mapping[str, Any]) -> PrefixRequest | None:
        """The request's prefix blocks from its parsed body (None: no text prompt)."""
        return self.hasher.hash_request(served_name, digest, document)

    def hash_text(self, served_name: str | None, digest: str | None, text: str) -> PrefixRequest:
        """The prefix blocks of a prompt text."""
        return self.hasher.hash_text(served_name, digest, text)

    def read_body(self, request: SchedulingRequest, document: Mapping[str, Any]) -> SchedulingRequest:
        """``BodyReader``: the request with its prompt's prefix blocks (none: no text prompt)."""
        return replace(request, prefix=self.hash_request(request.served_name, request.digest, document))

    def prepare(self, request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> None:
        """The prepare-data stage (``DataPreparer``): a request with a hashed prefix is matched over the whole pool
        once per cycle (``cycle_match``)."""
        if request.prefix is not None:
            self.cycle_match(request.prefix, pool, cycle)

    def request_hooks(self, runtime: PluginRuntime) -> RequestPlugin:
        """``RequestHooks``: learn where each request went, and count the prefix metrics (``PrefixRouting``)."""
        return PrefixRouting(self, runtime)

    def cycle_match(self, prefix: PrefixRequest, pool: PoolSnapshot, cycle: Cycle) -> None:
        """Match ``prefix`` over the whole pool once; set ``cycle.prefix_hit`` and ``cycle.prefix_tokens``."""
        runs = self.index.matches(prefix)
        total = len(prefix.hashes)
        cycle.prefix_tokens = total * self._tokens_per_block
        if not runs:  # no endpoint holds any of it (most requests of a new session)
            blocks = pool.memo(_NO_BLOCKS, lambda: np.zeros(pool.size, dtype=np.int64))
            self._last = (prefix, pool, blocks)
            cycle.prefix_hit = pool.memo(_NO_HIT, lambda: np.zeros(pool.size))
            return
        blocks = np.zeros(pool.size, dtype=np.int64)
        by_key = pool.index_by_address if isinstance(self.index, ApproximateIndex) else _index_by_name(pool)
        for key, count in runs.items():
            i = by_key.get(key)
            if i is not None:
                blocks[i] = count
        self._last = (prefix, pool, blocks)
        cycle.prefix_hit = np.multiply(blocks, 1.0 / total, dtype=np.float64)

    def __call__(self, request: SchedulingRequest, _pool: PoolSnapshot, cycle: Cycle) -> FloatArray | None:
        """The scorer, where the endpoint is below saturation: ``cycle.prefix_hit`` (the share held), or with
        ``prefillSecondsPerToken`` the prefill seconds the match saves over ``fullScoreSeconds`` (at least
        ``shareFloor x`` the share), at most 1."""
        hit = cycle.prefix_hit
        if request.prefix is None or hit is None or not np.count_nonzero(hit):
            return None
        score = hit * cycle.unsaturated if self.params.below_saturation_only else hit.copy()
        seconds = self.params.prefill_seconds_per_token
        if seconds is None:
            return score
        score *= max(cycle.prefix_tokens * seconds / self.params.full_score_seconds, self.params.share_floor)
        return np.minimum(score, 1.0, out=score)

    def routed(self, prefix: PrefixRequest, endpoint: str) -> int | None:
        """``prefix`` was sent to ``endpoint`` (an address): recorded there in approximate mode. Returns the blocks
        the last cycle matched there, once (None when that cycle was for another request or was reported already)."""
        if isinstance(self.index, ApproximateIndex):
            self.index.record(endpoint, prefix)
        last, self._last = self._last, None
        if last is None or last[0] is not prefix:
            return None
        i = last[1].index_by_address.get(endpoint)
        return 0 if i is None else int(last[2][i])


_NAMES, _NO_BLOCKS, _NO_HIT = object(), object(), object()


def _index_by_name(pool: PoolSnapshot) -> dict[str, int]:
    return pool.memo(_NAMES, lambda: {e.name: i for i, e in enumerate(pool.endpoints)})


class PrefixRouting(RequestPlugin):
    """The prefix scorer's ``pre_request`` hook: tell it where the request went, and count the prefix metrics
    (``loraplane_picker_prefix_blocks_total{state}``: ``hashed`` blocks of routed requests, ``matched`` of them held
    at the chosen endpoint; ``loraplane_picker_prefix_requests_total{hit}``)."""

    def __init__(self, scorer: PrefixCacheScorer, runtime: PluginRuntime) -> None:
        self.scorer = scorer
        self.blocks = Counter("loraplane_picker_prefix_blocks", "Prefix blocks of routed requests: hashed, and "
                              "matched at the chosen endpoint", ["state"], registry=runtime.registry)
        self.requests = Counter("loraplane_picker_prefix_requests", "Routed requests with a hashed prefix, by "
                                "whether the chosen endpoint held some of it", ["hit"], registry=runtime.registry)
        self._hashed, self._matched = self.blocks.labels("hashed"), self.blocks.labels("matched")
        self._hit, self._miss = self.requests.labels("true"), self.requests.labels("false")

    def pre_request(self, request: InFlightRequest) -> None:
        """Record the routing; count hashed and matched blocks (once per decision: not again when Envoy reports
        that another endpoint served it)."""
        prefix = request.scheduling.prefix
        if prefix is None or request.endpoint is None:
            return
        matched = self.scorer.routed(prefix, request.endpoint)
        if matched is None:
            return
        self._hashed.inc(len(prefix.hashes))
        self._matched.inc(matched)
        (self._hit if matched else self._miss).inc()


register("prefix-cache-scorer", PluginType(PluginKind.SCORER, PrefixCacheParameters, PrefixCacheScorer))


def without_prefix_scorer(config: EndpointPickerConfig) -> EndpointPickerConfig:
    """``config`` with the prefix scorer taken out of every profile (no hashing, no prefix signal)."""
    data = config.model_dump(by_alias=True)
    refs = {p["name"] or p["type"] for p in data["plugins"] if p["type"] == "prefix-cache-scorer"}
    for profile in data["schedulingProfiles"]:
        profile["plugins"] = [ref for ref in profile["plugins"] if ref["pluginRef"] not in refs]
    return type(config).model_validate(data)
