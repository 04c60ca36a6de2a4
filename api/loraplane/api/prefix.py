"""Prefix-cache blocks: the hash scheme the picker and the sidecars share, and a pod's published ``KvBlockSet``.

A block's hash chains ``blake2b-128(parent || block bytes)`` from a root that names the served name and the artifact
digest, so the same text under another revision hashes differently. Token blocks are hashed as little-endian
uint32 token ids; the picker hashes a prompt's tokens the same way the sidecar hashes the token ids vLLM reports
in its KV-cache events, so equal hashes mean the runtime holds that prefix for that revision.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable

from pydantic import Field

from loraplane.api.base import PayloadModel
from loraplane.api.runtime import SCHEMA_VERSION

#: Names the hash scheme; bumped when it changes (a reader ignores sets of another scheme).
PREFIX_HASH_SCHEME = "loraplane-prefix/1"
#: The most block hashes one ``KvBlockSet`` may carry (the sidecar keeps the most recently stored ones).
MAX_PUBLISHED_BLOCKS = 65_536


@functools.lru_cache(maxsize=4096)
def prefix_root_hash(served_name: str | None, digest: str | None) -> bytes:
    """The chain's root for a revision (``None``, ``None``: the base model); memoised (it is on the picker's request
    path once per request)."""
    material = "\x1f".join((PREFIX_HASH_SCHEME, served_name or "", digest or "")).encode()
    return hashlib.blake2b(material, digest_size=16).digest()


def chain_block_hash(parent: bytes, block: bytes) -> bytes:
    """One block's hash from its parent's (or the root) and its bytes."""
    return hashlib.blake2b(parent + block, digest_size=16).digest()


def chain(root: bytes, blocks: Iterable[bytes]) -> list[bytes]:
    """The chained hash of every block, starting from ``root`` (``chain_block_hash`` inlined: this loop is on the
    picker's request path)."""
    hashes, parent, blake2b = [], root, hashlib.blake2b
    for block in blocks:
        parent = blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


def token_block_bytes(tokens: Iterable[int]) -> bytes:
    """One block of token ids as the bytes that are hashed (little-endian uint32)."""
    return b"".join(int(t).to_bytes(4, "little") for t in tokens)


class AdapterBlocks(PayloadModel):
    """The cached blocks of one revision (or of the base model: ``served_name`` None) on one pod."""

    served_name: str | None = None
    digest: str | None = Field(default=None, description="artifact digest the sidecar vouches for; None: unknown")
    block_hashes: list[str] = Field(default_factory=list, description="hex chained hashes (PREFIX_HASH_SCHEME)")


class KvBlockSet(PayloadModel):
    """A pod's prefix-cache blocks as its runtime reported them (vLLM KV-cache events), written by its sidecar."""

    schema_version: int = SCHEMA_VERSION
    hash_scheme: str = PREFIX_HASH_SCHEME
    pool: str
    pod: str
    block_size: int = Field(gt=0, description="tokens per block (the runtime's --block-size)")
    heartbeat_at: float = Field(description="unix seconds")
    ttl_seconds: float = Field(default=5.0, gt=0)
    adapters: list[AdapterBlocks] = Field(default_factory=list)
    dropped_blocks: int = Field(default=0, ge=0, description="blocks left out to stay within MAX_PUBLISHED_BLOCKS")

    def is_stale(self, now: float) -> bool:
        """True when the set is older than its TTL."""
        return now - self.heartbeat_at > self.ttl_seconds

    def by_name(self) -> dict[str | None, AdapterBlocks]:
        """The entries keyed by served name."""
        return {a.served_name: a for a in self.adapters}
