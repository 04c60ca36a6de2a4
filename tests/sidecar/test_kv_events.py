"""The KV-event tracker: vLLM's BlockStored / BlockRemoved / AllBlocksCleared batches -> the published block set."""

from __future__ import annotations

import msgpack

from loraplane.picker.prefix import PreciseIndex, PrefixHasher
from loraplane.sidecar.kv_events import KvBlockTracker

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
