"""The reference backend: vectorised torch ops, any device.

One matmul pair per segment (an active slot, or a long run of one slot's rows), never a loop over rows. A plan
whose segments are consecutive input rows is computed in place on row slices; otherwise the LoRA rows are gathered
once into a reused workspace, computed, and scattered back once.
"""

from __future__ import annotations

import weakref

import torch

from loraplane.kernels.plan import BatchPlan
from loraplane.kernels.slots import LoraSlots

#: On one CPU thread, a segment whose rows of ``y`` span at least ``MIN_BLOCKS`` blocks of ``Y_BLOCK_BYTES`` is
#: added block by block, each block first read by one streaming reduction: the K=rank GEMM stalls on memory when it
#: reads ``y`` cold and not when it finds the block in cache (measured: docs/kernels.md). Shorter segments gain
#: nothing from it (their rows are usually still cached) and pay the extra calls.
Y_BLOCK_BYTES = 512 * 1024
MIN_BLOCKS = 2

#: ``exact``: each segment multiplies only its adapter's own rank (S-LoRA's MBGMV); ``padded``: the slot rank.
RANK_MODES = ("exact", "padded")

#: Per slot, or None when empty: ``A^T [d_in, ranks]`` and per output slice ``(columns of t, columns of y,
#: B^T [rank, width])``.
_SlotViews = tuple[torch.Tensor, list[tuple[slice, slice, torch.Tensor]]] | None


class TorchBackend:
    """Shrink / expand / fused delta with torch matmuls, one pair per segment (not thread-safe: workspaces)."""

    name = "torch"

    def __init__(self, rank_mode: str = "exact") -> None:
        if rank_mode not in RANK_MODES:
            raise ValueError(f"rank_mode must be one of {RANK_MODES}")
        self.rank_mode = rank_mode
        self._views_cache: weakref.WeakKeyDictionary[LoraSlots, tuple[int, list[_SlotViews]]] = (
            weakref.WeakKeyDictionary()
        )
        self._workspace: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}

    def shrink(self, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> torch.Tensor:
        """``t[T, n_slices * rank_pad]`` (float32) = x A^T per row's slot; rows without LoRA are zero."""
        out = torch.zeros(plan.num_tokens, slots.lora_a.shape[1], dtype=torch.float32, device=x.device)
        if plan.no_lora:
            return out
        a_all = slots.lora_a[:, :, : slots.d_in]
        src, dst = self._operands(plan, x, out, out.shape[1])
        for seg in plan.segments:
            rows = _rows(plan, seg.start, seg.row, seg.rows)
            dst[rows] = _mm_f32(src[rows], a_all[seg.slot].t())
        if not plan.contiguous:
            out.index_copy_(0, plan.sorted_tokens.to(out.device), dst)
        return out

    def expand(self, y: torch.Tensor, t: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """``y[:, slice] += t[:, slice ranks] B_slice^T`` per row's slot; rows without LoRA untouched."""
        if plan.no_lora:
            return
        views = self._views(slots)
        src, dst = self._operands(plan, t, y, y.shape[1])
        block = _block_rows(y)
        for seg in plan.segments:
            slot_views = views[seg.slot]
            if slot_views is not None:
                rows = _rows(plan, seg.start, seg.row, seg.rows)
                _expand_rows(dst[rows], src[rows], slot_views[1], block)
        self._scatter(plan, y, dst)

    def apply(self, y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """Fused ``y += x A^T B^T`` per segment; the [rows x r] intermediate lives only per segment."""
        if plan.no_lora:
            return
        views = self._views(slots)
        src, dst = self._operands(plan, x, y, y.shape[1])
        single = slots.n_slices == 1 and x.dtype == torch.float32
        block = _block_rows(y)
        for seg in plan.segments:
            slot_views = views[seg.slot]
            if slot_views is None:
                continue
            a_t, slices = slot_views
            rows = _rows(plan, seg.start, seg.row, seg.rows)
            if single:  # the hot path: two BLAS calls on row slices
                _, columns, b = slices[0]
                _add_product(dst[rows, columns], torch.mm(src[rows], a_t), b, block)
            else:
                _expand_rows(dst[rows], _mm_f32(src[rows], a_t), slices, block)
        self._scatter(plan, y, dst)

    def _operands(
        self, plan: BatchPlan, src: torch.Tensor, dst: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The row source and destination the segments index: the tensors themselves, or gathered workspaces."""
        if plan.contiguous:
            return src, dst
        n = plan.num_lora_tokens
        index = plan.sorted_tokens.to(src.device)  # a no-op once the engine moved the plan (plan.to)
        gathered = self._buffer(src.device, src.dtype, 0, n * src.shape[1]).view(n, src.shape[1])
        torch.index_select(src, 0, index, out=gathered)
        scratch = self._buffer(dst.device, dst.dtype, 1, n * width).view(n, width)
        return gathered, scratch.zero_()

    @staticmethod
    def _scatter(plan: BatchPlan, y: torch.Tensor, dst: torch.Tensor) -> None:
        if not plan.contiguous:
            y.index_add_(0, plan.sorted_tokens.to(y.device), dst)

    def _buffer(self, device: torch.device, dtype: torch.dtype, which: int, numel: int) -> torch.Tensor:
        """A grow-only workspace (fresh large allocations cost page faults on every call)."""
        key = (device, dtype, which)
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._workspace[key] = buffer
        return buffer[:numel]

    def _views(self, slots: LoraSlots) -> list[_SlotViews]:
        """Per-slot operand views at this backend's rank, cached per slots version."""
        cached = self._views_cache.get(slots)
        if cached is not None and cached[0] == slots.version:
            return cached[1]
        views: list[_SlotViews] = []
        for slot in range(slots.num_slots):
            rank = slots.ranks[slot] if self.rank_mode == "exact" else slots.rank_pad * (slots.ranks[slot] > 0)
            if rank == 0:
                views.append(None)
                continue
            if slots.n_slices == 1:
                a_t = slots.lora_a[slot, :rank, : slots.d_in].t()
            else:  # shrink every slice at once (padded ranks); expand reads each slice's first `rank` columns
                a_t = slots.lora_a[slot, :, : slots.d_in].t()
            slices = []
            for index, (offset, width) in enumerate(zip(slots.slice_offsets, slots.out_slices, strict=True)):
                first = index * slots.rank_pad if slots.n_slices > 1 else 0
                slices.append((slice(first, first + rank), slice(offset, offset + width), slots.slice_b(slot, index, rank)))
            views.append((a_t, slices))
        self._views_cache[slots] = (slots.version, views)
        return views


def _rows(plan: BatchPlan, start: int, row: int, count: int) -> slice:
    """A segment's rows in the operands: input rows when contiguous, gathered positions otherwise."""
    first = row if plan.contiguous else start
    return slice(first, first + count)


def _expand_rows(
    dst: torch.Tensor, t: torch.Tensor, slices: list[tuple[slice, slice, torch.Tensor]], block: int
) -> None:
    """``dst[:, columns] += t[:, ranks] B^T`` for each output slice, float32 accumulate, one rounding."""
    for ranks, columns, b in slices:
        out = dst[:, columns]
        if dst.dtype == torch.float32:
            _add_product(out, t[:, ranks], b, block)
        else:
            out.add_(torch.mm(t[:, ranks], b.float()).to(dst.dtype))


def _block_rows(y: torch.Tensor) -> int:
    """Rows of ``y`` per cache-sized block when long segments go block by block (CPU, one thread), else 0."""
    if not y.is_cpu or torch.get_num_threads() > 1:  # more threads split a block differently per op
        return 0
    return max(1, Y_BLOCK_BYTES // (y.shape[1] * y.element_size()))


def _add_product(out: torch.Tensor, t: torch.Tensor, b: torch.Tensor, block: int) -> None:
    """``out += t b`` in place, float32; block by block (see ``Y_BLOCK_BYTES``) when ``out`` spans enough blocks."""
    rows = out.shape[0]
    if not block or rows < MIN_BLOCKS * block:
        out.addmm_(t, b)
        return
    for first in range(0, rows, block):
        part = out[first : first + block]
        part.sum()  # a streaming read: brings the block into cache at full memory bandwidth
        part.addmm_(t[first : first + block], b)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in float32."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b)
    return torch.mm(a.float(), b.float())
