"""vLLM's KV-cache events -> this pod's prefix-cache block set (``loraplane.api.KvBlockSet``) for the picker.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}'``
publishes ZMQ multipart messages ``(topic, seq: 8 bytes big-endian, payload)``; the payload is a msgpack
``[ts, events, data_parallel_rank]`` whose events are maps tagged ``"type"``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``lora_name``), ``BlockRemoved``
(``block_hashes``) and ``AllBlocksCleared``. vLLM's own block hashes cannot be recomputed outside vLLM (its seed and
extra keys are its own), so each stored block is re-hashed in loraplane's scheme (``loraplane.api.prefix``) from its
token ids, chained through its parent, keyed by the served name (vLLM's ``lora_name``: the name the sidecar loaded)
and the artifact digest the sidecar vouches for. The picker hashes a prompt's tokens the same way.

A gap in the sequence numbers (messages dropped past vLLM's high-water mark, or a vLLM restart: the sequence starts
again at 0) may have lost removals: the set is cleared and learnt again from the next stores.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from loraplane.api import MAX_PUBLISHED_BLOCKS, AdapterBlocks, KvBlockSet, prefix_root_hash
from loraplane.api.prefix import chain_block_hash, token_block_bytes

log = logging.getLogger(__name__)

#: vLLM's block hash: bytes, or an int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.
VllmHash = bytes | int


@dataclass(frozen=True, slots=True)
class _Block:
    ours: bytes
    served_name: str | None


class KvBlockTracker:
    """The blocks vLLM holds now, re-hashed in loraplane's scheme; at most ``max_blocks`` (the oldest stored go)."""

    def __init__(self, pool: str, pod: str, max_blocks: int = MAX_PUBLISHED_BLOCKS, ttl_s: float = 5.0,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if not 1 <= max_blocks <= MAX_PUBLISHED_BLOCKS:
            raise ValueError(f"max_blocks must be in [1, {MAX_PUBLISHED_BLOCKS}]")
        self.pool, self.pod, self.max_blocks, self.ttl_s = pool, pod, max_blocks, ttl_s
        self._wall_clock = wall_clock
        self._blocks: collections.OrderedDict[VllmHash, _Block] = collections.OrderedDict()
        self._digests: dict[str, str | None] = {}
        self.block_size: int | None = None
        self.last_seq: int | None = None
        self.dropped = 0
        self.unchained = 0
        self.resets = 0

    def set_digests(self, digests: Mapping[str, str | None]) -> None:
        """The artifact digest this sidecar vouches for, per served name (from its report rows)."""
        self._digests = dict(digests)

    def clear(self) -> None:
        """vLLM holds nothing (all cleared, restarted, or events were lost)."""
        self._blocks.clear()

    def message(self, seq: int, payload: bytes) -> None:
        """Apply one published batch; a sequence gap clears the set first."""
        if self.last_seq is not None and seq != self.last_seq + 1:
            log.warning("KV events: sequence %d after %d (lost or restarted): clearing the block set", seq,
                        self.last_seq)
            self.resets += 1
            self.clear()
        self.last_seq = seq
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            raise ValueError("KV event batch is not [ts, events, ...]")
        for event in batch[1]:
            self.event(event)

    def event(self, event: Any) -> None:
        """Apply one decoded event (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; others are ignored)."""
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            for h in event.get("block_hashes") or ():
                self._blocks.pop(h, None)
        elif kind == "AllBlocksCleared":
            self.clear()

    def _stored(self, event: Mapping[str, Any]) -> None:
        size = int(event["block_size"])
        self.block_size = size
        served_name = event.get("lora_name")
        parent_vllm = event.get("parent_block_hash")
        if parent_vllm is None:
            parent = prefix_root_hash(served_name, self._digests.get(served_name) if served_name else None)
        else:
            known = self._blocks.get(parent_vllm)
            if known is None or known.served_name != served_name:
                self.unchained += len(event["block_hashes"])  # its prefix is unknown here: it can never be matched
                return
            parent = known.ours
        tokens = event["token_ids"]
        for i, h in enumerate(event["block_hashes"]):
            parent = chain_block_hash(parent, token_block_bytes(tokens[i * size:(i + 1) * size]))
            self._blocks[h] = _Block(parent, served_name)
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.dropped += 1

    def __len__(self) -> int:
        return len(self._blocks)

    def block_set(self) -> KvBlockSet:
        """The set to publish (one entry per served name, base model blocks under ``None``)."""
        grouped: dict[str | None, list[str]] = {}
        for block in self._blocks.values():
            grouped.setdefault(block.served_name, []).append(block.ours.hex())
        adapters = [AdapterBlocks(served_name=name, digest=self._digests.get(name) if name else None,
                                  block_hashes=hashes)
                    for name, hashes in sorted(grouped.items(), key=lambda kv: kv[0] or "")]
        return KvBlockSet(pool=self.pool, pod=self.pod, block_size=self.block_size or 1,
                          heartbeat_at=self._wall_clock(), ttl_seconds=self.ttl_s, adapters=adapters,
                          dropped_blocks=self.dropped)


def _check_endpoint(endpoint: str) -> None:
    if not endpoint.startswith(("ipc://", "tcp://")) or "*" in endpoint:
        raise ValueError(f"KV events endpoint {endpoint!r}: give the endpoint of vLLM's --kv-events-config "
                         "(ipc://PATH, or tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557), not a wildcard")


async def subscribe(endpoint: str, tracker: KvBlockTracker, stop: asyncio.Event,
                    on_change: Callable[[], None] | None = None, topic: str = "") -> None:
    """Subscribe to vLLM's publisher at ``endpoint`` and apply every batch until ``stop`` is set.

    vLLM binds its PUB socket to ``ipc://`` and wildcard endpoints and connects it to a ``tcp://HOST:PORT`` one, so
    this SUB socket does the other: it connects to ``ipc://PATH`` and binds ``tcp://HOST:PORT`` (keep HOST loopback:
    the events carry the prompts' token ids). A batch that does not decode is logged and skipped (the set is cleared:
    it may have held removals).
    """
    _check_endpoint(endpoint)
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt_string(zmq.SUBSCRIBE, topic)
    if endpoint.startswith("tcp://"):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)
    try:
        while not stop.is_set():
            if not await socket.poll(timeout=500):
                continue
            frames = await socket.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("KV events: unexpected message of %d frames", len(frames))
                continue
            try:
                tracker.message(int.from_bytes(frames[1], "big", signed=True), frames[2])
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                log.warning("KV events: unreadable batch, clearing the block set: %r", exc)
                tracker.clear()
            if on_change is not None:
                on_change()
    finally:
        with contextlib.suppress(zmq.ZMQError):
            socket.close(linger=0)
