"""Prefix caching in the simulated pods, and the prefix blocks routers hash.

vLLM caches a prompt's KV in blocks of ``BLOCK_TOKENS`` tokens keyed by a chained hash of the blocks before it and
the LoRA adapter (its LoRA id is part of the hash), so a block is a hit only for the same adapter and the same
tokens before it. A trace with prefix structure (``Trace.has_prefixes``) says where each prompt's tokens come from:

- the first ``prefix_tokens`` of a request in prefix group ``g`` are the group's shared text (a tenant's system
  prompt): block ``j`` of that part is the same for every request of ``(adapter, g)``;
- the rest belongs to its session: every turn starts with the previous turn's prompt and answer, so block ``j``
  is the same for every turn of ``(adapter, session)``; a request without a session has blocks nobody shares.

So a request's blocks are two runs, the group's ``[0, g)`` and its session's ``[g, n)``, each identified by a
*segment* (adapter + group, adapter + session, or the request alone). Each pod's cache (``PrefixCache``) keeps, per
segment, how many of its leading blocks are cached, least recently used first: evicting a segment's blocks from its
tail is what vLLM's free-block queue does (a freed sequence's last blocks go first), and it keeps every match a
leading run, so a lookup and an update cost O(1) instead of O(blocks).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from loraplane.picker.prefix import ApproximateIndex, PrefixRequest
from loraplane.sim.profile import Profile
from loraplane.sim.trace import Trace

if TYPE_CHECKING:
    from loraplane.picker.prefix import PrefixCacheScorer

#: vLLM's default KV-cache block size on GPUs (``--block-size 16``); runtimes cache and match only full blocks
BLOCK_TOKENS = 16


class PrefixLayout:
    """Where each request's prompt blocks come from: its group segment and how many blocks of its prompt lie in
    the group's shared prefix, and its session segment (a segment of its own without a session)."""

    def __init__(self, trace: Trace, block_tokens: int = BLOCK_TOKENS) -> None:
        if trace.prefix_group is None or trace.prefix_tokens is None or trace.session is None:
            raise ValueError("the trace has no prefix structure")
        self.block_tokens = block_tokens
        n_adapters = max(1, len(trace.adapters))
        groups = max(trace.prefix_group, default=-1) + 1
        sessions = max(trace.session, default=-1) + 1
        self._group_seg: list[int] = []
        self._tail_seg: list[int] = []
        self._group_blocks: list[int] = []
        self.input_tokens = trace.input_tokens
        self.output_tokens = trace.output_tokens
        for rid, (a, g, shared, s) in enumerate(
            zip(trace.adapter, trace.prefix_group, trace.prefix_tokens, trace.session, strict=True)
        ):
            self._group_seg.append(g * n_adapters + a if g >= 0 else -1)
            self._group_blocks.append(min(shared, trace.input_tokens[rid]) // block_tokens if g >= 0 else 0)
            # sessions after the groups; requests without one after the sessions (never shared)
            self._tail_seg.append(groups * n_adapters + (s * n_adapters + a if s >= 0 else sessions * n_adapters + rid))

    def prompt_blocks(self, rid: int) -> int:
        """Full blocks of request ``rid``'s prompt."""
        return self.input_tokens[rid] // self.block_tokens

    def segments(self, rid: int) -> tuple[int, int, int]:
        """(group segment or -1, blocks of the prompt in the group's prefix, tail segment)."""
        return self._group_seg[rid], self._group_blocks[rid], self._tail_seg[rid]

    def request(self, rid: int, max_blocks: int = 1024) -> PrefixRequest:
        """The request's prefix blocks as a router hashes them (chained in effect: a block's identity covers its
        segment, which fixes every token before it): at most ``max_blocks``."""
        group, in_group, tail = self.segments(rid)
        n = min(self.prompt_blocks(rid), max_blocks)
        hashes = [_block_hash(group, j) for j in range(min(in_group, n))]
        hashes += [_block_hash(tail, j) for j in range(min(in_group, n), n)]
        return PrefixRequest(tuple(hashes), self.block_tokens, "tokens")


def _block_hash(segment: int, block: int) -> bytes:
    return (segment << 20 | block).to_bytes(16, "little", signed=True)


class PrefixCache:
    """One pod's cached prefix blocks: per segment the number of leading blocks held, least recently used first."""

    def __init__(self) -> None:
        self._held: collections.OrderedDict[int, int] = collections.OrderedDict()
        #: blocks held over all segments
        self.blocks = 0

    def held(self, segment: int) -> int:
        """Leading blocks of ``segment`` cached here."""
        return self._held.get(segment, 0)

    def touch(self, segment: int, blocks: int) -> None:
        """Hold at least ``blocks`` leading blocks of ``segment``, now the most recently used."""
        have = self._held.pop(segment, 0)
        keep = max(have, blocks)
        if keep:
            self._held[segment] = keep
        self.blocks += keep - have

    def trim(self, limit: int) -> int:
        """Evict least recently used blocks (a segment's last blocks first) until at most ``limit`` are held;
        returns how many were evicted."""
        evicted = 0
        held = self._held
        while self.blocks > limit and held:
            segment, count = next(iter(held.items()))
            drop = min(count, self.blocks - limit)
            if drop == count:
                del held[segment]
            else:
                held[segment] = count - drop
            self.blocks -= drop
            evicted += drop
        return evicted


class PodPrefixCaches:
    """The simulator's prefix-cache model: one ``PrefixCache`` per pod over the trace's ``PrefixLayout``.

    A cache may hold the KV blocks that no running request has reserved: the profile's KV capacity in blocks minus
    the pod's reservations (a running request's prompt blocks count in both, so the model caches somewhat less than
    vLLM would, alike for every policy). An admitted request's matched tokens are not prefilled (vLLM always
    computes the last prompt token); its prompt blocks are cached from admission on, its answer's full blocks when
    it finishes (its next turn starts with them)."""

    def __init__(self, trace: Trace, profile: Profile, pods: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.layout = PrefixLayout(trace, block_tokens)
        self.block_tokens = block_tokens
        self.capacity_blocks = profile.kv_capacity_tokens // block_tokens
        self.caches = [PrefixCache() for _ in range(pods)]
        self.evicted = 0

    def match(self, pod: int, rid: int) -> int:
        """Prompt tokens of ``rid`` that ``pod`` would serve from its cache now."""
        cache, layout = self.caches[pod], self.layout
        group, in_group, tail = layout.segments(rid)
        blocks = layout.prompt_blocks(rid)
        in_group = min(in_group, blocks)
        matched = min(cache.held(group), in_group) if in_group else 0
        if matched == in_group:
            matched += min(cache.held(tail), blocks - in_group)
        return min(matched * self.block_tokens, max(0, layout.input_tokens[rid] - 1))

    def admitted(self, pod: int, rid: int, kv_reserved: int) -> None:
        """``rid`` was admitted on ``pod``: its prompt blocks are cached there."""
        group, in_group, tail = self.layout.segments(rid)
        blocks = self.layout.prompt_blocks(rid)
        cache = self.caches[pod]
        cache.touch(tail, blocks - min(in_group, blocks))
        if in_group:
            cache.touch(group, min(in_group, blocks))
        self._trim(cache, kv_reserved)

    def finished(self, pod: int, rid: int, kv_reserved: int) -> None:
        """``rid`` finished on ``pod``: the full blocks of its prompt and answer stay cached there."""
        layout = self.layout
        _group, in_group, tail = layout.segments(rid)
        total = (layout.input_tokens[rid] + layout.output_tokens[rid]) // self.block_tokens
        cache = self.caches[pod]
        cache.touch(tail, total - min(in_group, total))
        self._trim(cache, kv_reserved)

    def _trim(self, cache: PrefixCache, kv_reserved: int) -> None:
        self.evicted += cache.trim(max(0, self.capacity_blocks - math.ceil(kv_reserved / self.block_tokens)))


class PickerPrefixSignal:
    """Feeds the picker's own ``prefix-cache-scorer`` in the simulator, as the picker does: each request's prefix
    blocks (``request``: one block of the scorer's ``blockSize`` in its ``unit`` is taken as its tokens' worth,
    ``blockSize / bytesPerToken`` tokens for byte blocks, and blocks of one segment are equal exactly when their
    tokens are) and, after the decision, where it went (``routed``: the approximate index learns it). The index is
    rebuilt with the scorer's parameters on the simulator's clock (its TTL counts simulated seconds)."""

    def __init__(self, scorer: PrefixCacheScorer, trace: Trace, clock: Callable[[], float]) -> None:
        params = scorer.params
        if params.mode != "approximate":
            raise ValueError("the simulator runs the prefix-cache scorer in approximate mode only")
        scorer.index = ApproximateIndex(params.lru_capacity, params.ttl_seconds, params.max_pods, clock)
        tokens = params.block_size / params.bytes_per_token if params.unit == "bytes" else params.block_size
        self.layout = PrefixLayout(trace, max(1, round(tokens)))
        self._scorer = scorer
        self._max_blocks = params.max_blocks

    def request(self, rid: int) -> PrefixRequest:
        """Request ``rid``'s prefix blocks, as the scorer's hasher would cut them."""
        return self.layout.request(rid, self._max_blocks)

    def routed(self, prefix: PrefixRequest, address: str) -> None:
        """The request was sent to ``address``."""
        self._scorer.routed(prefix, address)
