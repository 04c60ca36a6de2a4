"""vLLM's KV block pool with automatic prefix caching, as bookkeeping only (no tensors).

Blocks of ``block_size`` tokens. A free block keeps its hash (its KV stays valid) until it is handed out again;
the free queue hands out blocks never used before first (vLLM's queue starts with every block in id order), then
freed ones, least recently freed first. A request frees its blocks tail first, so the end of a sequence goes
before its head. A full block's hash chains the previous block's hash, its token ids and the LoRA name (vLLM's
``hash_block_tokens`` with the adapter as an extra key): a prefix is shared only by requests of the same
adapter name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class Block:
    """One KV block: how many requests hold it, and its hash while its tokens are cached."""

    __slots__ = ("hash", "index", "ref_cnt")

    def __init__(self, index: int) -> None:
        self.index = index
        self.ref_cnt = 0
        self.hash: int | None = None


def chain_hashes(parent: int | None, tokens: Sequence[int], block_size: int, lora_name: str | None,
                 start: int, stop: int) -> list[int]:
    """Hashes of the full blocks ``start`` .. ``stop - 1`` of ``tokens``, chained from ``parent`` (the hash of
    block ``start - 1``, None for the first block)."""
    hashes = []
    for block in range(start, stop):
        parent = hash((parent, tuple(tokens[block * block_size:(block + 1) * block_size]), lora_name))
        hashes.append(parent)
    return hashes


class BlockPool:
    """``num_blocks`` blocks; with ``caching`` off, freed blocks keep nothing."""

    def __init__(self, num_blocks: int, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self._fresh = 0  # blocks 0 .. _fresh - 1 have been handed out at least once
        self._freed: OrderedDict[int, Block] = OrderedDict()  # free blocks used before, least recently freed first
        self._cached: dict[int, Block] = {}

    @property
    def num_free(self) -> int:
        """Blocks a request can get now (cached ones included: they are evicted when handed out)."""
        return self.num_blocks - self._fresh + len(self._freed)

    @property
    def usage(self) -> float:
        """Blocks in use / all blocks (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[Block]:
        """``n`` blocks for a request (ValueError when fewer are free); a cached block handed out loses its hash."""
        if n > self.num_free:
            raise ValueError(f"{n} KV blocks asked for, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._fresh < self.num_blocks:
                block = Block(self._fresh)
                self._fresh += 1
            else:
                _, block = self._freed.popitem(last=False)
                if block.hash is not None:
                    if self._cached.get(block.hash) is block:
                        del self._cached[block.hash]
                    block.hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """A request takes cached blocks (its prefix hit): free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._freed[block.index]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """A request lets go of ``blocks``: tail first to the end of the free queue."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._freed[block.index] = block

    def evictable(self, blocks: Iterable[Block]) -> int:
        """How many of ``blocks`` sit in the free queue (taking them uses up free blocks)."""
        return sum(block.ref_cnt == 0 for block in blocks)

    def longest_hit(self, hashes: Sequence[int]) -> list[Block]:
        """The cached blocks of the longest prefix of ``hashes``."""
        hit = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def cache(self, block: Block, block_hash: int) -> None:
        """``block`` is full: its tokens can be found by ``block_hash`` (the first block with a hash keeps it)."""
        if self.caching and block.hash is None:
            block.hash = block_hash
            self._cached.setdefault(block_hash, block)
