"""The Ascend backend drives vLLM-Ascend's op schemas (test-registered on CPU) and falls back where they cannot run."""

from __future__ import annotations

import torch

from loraplane.kernels import BatchPlanner, LoraSlots, lora_delta

from .ascend_ops import CALLS, AscendTestBackend


def _slots(max_rank: int, dtype: torch.dtype, d_in: int = 40) -> LoraSlots:
    generator = torch.Generator().manual_seed(0)
    slots = LoraSlots(3, max_rank, d_in, (24,), dtype=dtype)
    for slot in range(3):
        rank = max_rank - slot
        slots.load(slot, [torch.randn(rank, d_in, generator=generator)], [torch.randn(24, rank, generator=generator)], 0.5)
    return slots


def test_decode_uses_bgmv_and_contiguous_prefill_uses_sgmv() -> None:
    backend = AscendTestBackend()
    slots = _slots(16, torch.float16)
    planner = BatchPlanner(64, 3)
    x = torch.randn(30, 40).half()
    CALLS.clear()
    lora_delta(x[:5], slots, planner.plan([2, -1, 0, 2, 1]), backend=backend)
    assert CALLS == {"bgmv_shrink": 1, "bgmv_expand": 1}
    CALLS.clear()
    lora_delta(x, slots, planner.plan([-1] * 2 + [1] * 12 + [0] * 16), backend=backend)
    assert CALLS == {"sgmv_shrink": 1, "sgmv_expand": 1}
    assert backend.fallbacks == 0


def test_outside_the_ops_limits_falls_back_to_torch_with_the_same_result() -> None:
    backend = AscendTestBackend()
    plan = BatchPlanner(64, 3).plan([0, 1, 2, -1])
    x = torch.randn(4, 40)
    CALLS.clear()
    for slots in (_slots(16, torch.float32), _slots(48, torch.float16), _slots(128, torch.float16, d_in=160)):
        inputs = x if slots.d_in == 40 else torch.randn(4, slots.d_in)
        inputs = inputs.to(slots.dtype)
        torch.testing.assert_close(
            lora_delta(inputs, slots, plan, backend=backend), lora_delta(inputs, slots, plan, backend="torch")
        )
    assert not CALLS
    assert backend.fallbacks == 3
