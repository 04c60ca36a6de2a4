"""Ascend backend: vLLM-Ascend's ``torch.ops._C_ascend.{bgmv,sgmv}_{shrink,expand}`` NPU ops.

The ops' limits (vLLM-Ascend): float16/bfloat16 only, shrink needs ``d_in > rank``, expand supports ranks
8/16/32/64 only; vLLM-Ascend itself falls back to torch ops for ranks >= 128. Outside those limits, or when the ops
are not registered (no torch_npu / vllm-ascend), this backend computes with the torch backend instead and counts
it in ``fallbacks``. Decode-like plans and gathered plans use BGMV (a per-token slot index); contiguous prefill
plans use SGMV over the batch's runs of rows in row order. The ops want vLLM's layouts (A ``[L, r, d_in]``,
B ``[L, d_out_slice, r]``, contiguous), which are cached per slot-store version.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from loraplane.kernels.plan import BatchPlan
from loraplane.kernels.slots import LoraSlots
from loraplane.kernels.torch_backend import TorchBackend

OP_DTYPES = (torch.float16, torch.bfloat16)
EXPAND_RANKS = (8, 16, 32, 64)
MAX_OP_RANK = 128  # exclusive, as in vLLM-Ascend


def ascend_ops() -> Any | None:
    """``torch.ops._C_ascend`` when vLLM-Ascend's LoRA ops are registered in this process, else None."""
    try:
        import torch_npu  # noqa: F401
        import vllm_ascend.vllm_ascend_C  # noqa: F401
    except ImportError:
        return None
    ops = torch.ops._C_ascend
    return ops if hasattr(ops, "bgmv_shrink") and hasattr(ops, "sgmv_expand") else None


class AscendBackend:
    """Runs the plan through the four vLLM-Ascend ops, one shrink and one expand per output slice."""

    name = "ascend"

    def __init__(self, ops: Any | None = None) -> None:
        self._ops: Any = ops if ops is not None else ascend_ops()
        self._fallback = TorchBackend()
        self._weights: weakref.WeakKeyDictionary[LoraSlots, tuple[int, list[torch.Tensor], list[torch.Tensor]]] = (
            weakref.WeakKeyDictionary()
        )
        self.fallbacks = 0

    def supports(self, dtype: torch.dtype, slots: LoraSlots) -> bool:
        """Whether the NPU ops can run this layer (else the torch backend does)."""
        rank = slots.rank_pad
        return (
            self._ops is not None
            and dtype in OP_DTYPES
            and rank < MAX_OP_RANK
            and rank in EXPAND_RANKS
            and slots.d_in > rank
        )

    def shrink(self, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> torch.Tensor:
        """See :func:`loraplane.kernels.ops.shrink`."""
        if plan.no_lora or not self.supports(x.dtype, slots):
            self.fallbacks += not plan.no_lora
            return self._fallback.shrink(x, slots, plan)
        lora_a, _ = self._vllm_layout(slots)
        x = x.contiguous()
        indices = _Indices(plan, x.device)
        pieces = []
        for a in lora_a:
            t = torch.zeros(plan.num_tokens, slots.rank_pad, dtype=torch.float32, device=x.device)
            if indices.segmented:
                self._ops.sgmv_shrink(x, a, indices.lora, indices.seq_len, t, 1.0)
            else:
                self._ops.bgmv_shrink(x, a, indices.lora, t, 1.0)
            pieces.append(t)
        return torch.cat(pieces, dim=1)

    def expand(self, y: torch.Tensor, t: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """See :func:`loraplane.kernels.ops.expand`."""
        if plan.no_lora or not self.supports(y.dtype, slots):
            self.fallbacks += not plan.no_lora
            self._fallback.expand(y, t, slots, plan)
            return
        _, lora_b = self._vllm_layout(slots)
        indices = _Indices(plan, y.device)
        rank = slots.rank_pad
        for index, (b, offset, width) in enumerate(zip(lora_b, slots.slice_offsets, slots.out_slices, strict=True)):
            t_slice = t[:, index * rank : (index + 1) * rank].contiguous()
            if indices.segmented:
                out = self._ops.sgmv_expand(t_slice, b, indices.lora, indices.seq_len, y, offset, width)
            else:
                out = self._ops.bgmv_expand(t_slice, b, indices.lora, y, offset, width)
            if isinstance(out, torch.Tensor) and out.data_ptr() != y.data_ptr():
                y.copy_(out)  # the op returned its result instead of adding in place

    def apply(self, y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """See :func:`loraplane.kernels.ops.apply_lora` (shrink then expand: the ops have no fused form)."""
        if plan.no_lora or not self.supports(x.dtype, slots):
            self.fallbacks += not plan.no_lora
            self._fallback.apply(y, x, slots, plan)
            return
        self.expand(y, self.shrink(x, slots, plan), slots, plan)

    def _vllm_layout(self, slots: LoraSlots) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per slice A ``[L, rank_pad, d_in]`` and B ``[L, width, rank_pad]``, contiguous, cached per version."""
        cached = self._weights.get(slots)
        if cached is not None and cached[0] == slots.version:
            return cached[1], cached[2]
        rank = slots.rank_pad
        lora_a = [
            slots.lora_a[:, index * rank : (index + 1) * rank, : slots.d_in].contiguous()
            for index in range(slots.n_slices)
        ]
        lora_b = [
            slots.lora_b[:, :, offset : offset + width].transpose(1, 2).contiguous()
            for offset, width in zip(slots.slice_offsets, slots.out_slices, strict=True)
        ]
        self._weights[slots] = (slots.version, lora_a, lora_b)
        return lora_a, lora_b


class _Indices:
    """The ops' index arguments: SGMV runs (row order, -1 for rows without LoRA) or BGMV per-token slots."""

    def __init__(self, plan: BatchPlan, device: torch.device) -> None:
        self.segmented = plan.contiguous and plan.mode == "prefill"
        if not self.segmented:
            self.lora = plan.token_slots.to(device=device, dtype=torch.long)
            self.seq_len = self.lora
            return
        slots, lengths, row = [], [], 0
        for seg in sorted(plan.segments, key=lambda s: s.row):
            if seg.row > row:
                slots.append(-1)
                lengths.append(seg.row - row)
            slots.append(seg.slot)
            lengths.append(seg.rows)
            row = seg.row + seg.rows
        if row < plan.num_tokens:
            slots.append(-1)
            lengths.append(plan.num_tokens - row)
        self.lora = torch.tensor(slots, dtype=torch.long, device=device)
        self.seq_len = torch.tensor(lengths, dtype=torch.long, device=device)
