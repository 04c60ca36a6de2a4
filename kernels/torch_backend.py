"""The reference backend: vectorised torch ops, any device.

One matmul pair per active slot (segment), never a loop over rows. A plan whose segments are consecutive input rows
is computed in place on row slices; otherwise the LoRA rows are gathered once, computed, and scattered back once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraplane.kernels.plan import BatchPlan, Segment
from loraplane.kernels.slots import LoraSlots

#: ``exact``: each segment multiplies only its adapter's own rank (S-LoRA's MBGMV); ``padded``: the slot rank.
RANK_MODES = ("exact", "padded")


class TorchBackend:
    """Shrink / expand / fused delta with torch matmuls, one pair per active slot."""

    name = "torch"

    def __init__(self, rank_mode: str = "exact") -> None:
        if rank_mode not in RANK_MODES:
            raise ValueError(f"rank_mode must be one of {RANK_MODES}")
        self.rank_mode = rank_mode

    def shrink(self, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> torch.Tensor:
        """``t[T, n_slices * rank_pad]`` (float32) = x A^T per row's slot; rows without LoRA are zero."""
        out = torch.zeros(plan.num_tokens, slots.lora_a.shape[1], dtype=torch.float32, device=x.device)
        if plan.no_lora:
            return out
        a_all = slots.lora_a[:, :, : slots.d_in]

        def segment(dst: torch.Tensor, src: torch.Tensor, seg: Segment) -> None:
            dst.copy_(_mm_f32(src, a_all[seg.slot].t()))

        _per_segment(plan, x, out, segment, accumulate=False)
        return out

    def expand(self, y: torch.Tensor, t: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """``y[:, slice] += t[:, slice ranks] B_slice^T`` per row's slot; rows without LoRA untouched."""
        if plan.no_lora:
            return

        def segment(dst: torch.Tensor, src: torch.Tensor, seg: Segment) -> None:
            self._expand_segment(dst, src, slots, seg.slot)

        _per_segment(plan, t, y, segment, accumulate=True)

    def apply(self, y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """Fused ``y += x A^T B^T`` per row's slot; the [rows x r] intermediate lives only per segment."""
        if plan.no_lora:
            return
        a_all = slots.lora_a[:, :, : slots.d_in]
        single = slots.n_slices == 1

        def segment(dst: torch.Tensor, src: torch.Tensor, seg: Segment) -> None:
            rank = self._rank(slots, seg.slot)
            if rank == 0:
                return
            a = a_all[seg.slot, :rank] if single else a_all[seg.slot]
            if src.dtype == torch.float32 and single:
                dst.addmm_(torch.mm(src, a.t()), slots.lora_b[seg.slot, :rank, : slots.d_out])
                return
            self._expand_segment(dst, _mm_f32(src, a.t()), slots, seg.slot)

        _per_segment(plan, x, y, segment, accumulate=True)

    def _rank(self, slots: LoraSlots, slot: int) -> int:
        rank = slots.ranks[slot]
        return rank if self.rank_mode == "exact" or rank == 0 else slots.rank_pad

    def _expand_segment(self, dst: torch.Tensor, t: torch.Tensor, slots: LoraSlots, slot: int) -> None:
        rank = self._rank(slots, slot)
        if rank == 0:
            return
        for index, (offset, width) in enumerate(zip(slots.slice_offsets, slots.out_slices, strict=True)):
            first = index * slots.rank_pad
            b = slots.slice_b(slot, index, rank)
            out = dst[:, offset : offset + width]
            if dst.dtype == torch.float32:
                out.addmm_(t[:, first : first + rank], b)
            else:
                out.add_(torch.mm(t[:, first : first + rank], b.float()).to(dst.dtype))


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in float32."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b)
    return torch.mm(a.float(), b.float())


def _per_segment(
    plan: BatchPlan,
    src: torch.Tensor,
    dst: torch.Tensor,
    segment: Callable[[torch.Tensor, torch.Tensor, Segment], None],
    accumulate: bool,
) -> None:
    """Run ``segment(dst_rows, src_rows, seg)`` for every segment, on row slices or through one gather/scatter."""
    if plan.contiguous:
        for seg in plan.segments:
            rows = slice(seg.row, seg.row + seg.rows)
            segment(dst[rows], src[rows], seg)
        return
    index = plan.sorted_tokens.to(src.device)
    gathered = src.index_select(0, index)
    dst_sorted = torch.zeros(index.numel(), dst.shape[1], dtype=dst.dtype, device=dst.device)
    for seg in plan.segments:
        segment(dst_sorted[seg.start : seg.end], gathered[seg.start : seg.end], seg)
    if accumulate:
        dst.index_add_(0, index, dst_sorted)
    else:
        dst.index_copy_(0, index, dst_sorted)
