"""Triton backend: SGMV-style kernels over the plan's segments (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

Every program handles one tile of ``BLOCK_M`` rows of one segment (rows are read through ``sorted_tokens``, so
gathered and contiguous plans take the same path) and one range of output columns of one slice. Rows without an
adapter are in no segment and cost nothing. The fused kernel keeps the ``[BLOCK_M x rank]`` shrink result in
registers and expands it straight into ``y``; the intermediate never reaches global memory.

float32 inputs use exact fp32 dot products (no TF32). The interpreter cannot compute bfloat16 dot products, so
bfloat16 is refused on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loraplane.kernels.plan import BatchPlan
from loraplane.kernels.slots import LoraSlots

INTERPRET_ENV = "TRITON_INTERPRET"


@triton.jit
def _rows_of_tile(sorted_ptr, seg_start_ptr, seg_rows_ptr, m_tiles, BLOCK_M: tl.constexpr):
    """The tile's segment, its input rows and their mask."""
    pid = tl.program_id(0)
    segment = pid // m_tiles
    tile = pid % m_tiles
    seg_start = tl.load(seg_start_ptr + segment)
    seg_rows = tl.load(seg_rows_ptr + segment)
    offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < seg_rows
    rows = tl.load(sorted_ptr + seg_start + offs, mask=mask, other=0)
    return segment, rows, mask


@triton.jit
def _columns_of_program(slice_ptr, n_per_program):
    """The program's output slice, its first column and the slice's end column."""
    slice_index = tl.program_id(2)
    offset = tl.load(slice_ptr + 2 * slice_index)
    end = offset + tl.load(slice_ptr + 2 * slice_index + 1)
    return slice_index, offset + tl.program_id(1) * n_per_program, end


@triton.jit
def _shrink_tile(
    x_ptr, a_ptr, rows, row_mask, slot, rank_first, d_in, stride_xm, stride_as, stride_ar,
    FP32: tl.constexpr, BLOCK_M: tl.constexpr, RANK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``x[rows] @ A[slot, rank_first : rank_first + RANK]^T`` accumulated in float32, ``[BLOCK_M, RANK]``."""
    acc = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    ranks = tl.arange(0, RANK)
    for k0 in range(0, d_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < d_in
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(
            a_ptr + slot * stride_as + (rank_first + ranks[None, :]) * stride_ar + ks[:, None],
            mask=k_mask[:, None],
            other=0.0,
        )
        if FP32:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    return acc


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, t_ptr, sorted_ptr, seg_slot_ptr, seg_start_ptr, seg_rows_ptr,
    m_tiles, d_in, stride_xm, stride_as, stride_ar, stride_tm,
    FP32: tl.constexpr, BLOCK_M: tl.constexpr, RANK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    segment, rows, row_mask = _rows_of_tile(sorted_ptr, seg_start_ptr, seg_rows_ptr, m_tiles, BLOCK_M)
    if tl.sum(row_mask.to(tl.int32)) == 0:
        return
    slot = tl.load(seg_slot_ptr + segment)
    rank_first = tl.program_id(1) * RANK  # one program column per output slice
    acc = _shrink_tile(
        x_ptr, a_ptr, rows, row_mask, slot, rank_first, d_in, stride_xm, stride_as, stride_ar,
        FP32, BLOCK_M, RANK, BLOCK_K,
    )
    ranks = tl.arange(0, RANK)
    tl.store(t_ptr + rows[:, None] * stride_tm + rank_first + ranks[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _expand_tile(
    t, y_ptr, b_ptr, rows, row_mask, slot, column, width, n_end, stride_ym, stride_bs, stride_br,
    FP32: tl.constexpr, BLOCK_M: tl.constexpr, RANK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``y[rows, column + n] += t @ B[slot, :RANK, column + n]`` for ``n`` in ``[n_start, n_end)`` tiles."""
    ranks = tl.arange(0, RANK)
    for n0 in range(column, n_end, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_mask = ns < width
        b = tl.load(b_ptr + slot * stride_bs + ranks[:, None] * stride_br + ns[None, :], mask=n_mask[None, :], other=0.0)
        if FP32:
            delta = tl.dot(t, b, input_precision="ieee")
        else:
            delta = tl.dot(t.to(b.dtype), b)
        mask = row_mask[:, None] & n_mask[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + ns[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_kernel(
    t_ptr, b_ptr, y_ptr, sorted_ptr, seg_slot_ptr, seg_start_ptr, seg_rows_ptr, slice_ptr,
    m_tiles, n_per_program, stride_tm, stride_bs, stride_br, stride_ym,
    FP32: tl.constexpr, BLOCK_M: tl.constexpr, RANK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    segment, rows, row_mask = _rows_of_tile(sorted_ptr, seg_start_ptr, seg_rows_ptr, m_tiles, BLOCK_M)
    slice_index, column, width = _columns_of_program(slice_ptr, n_per_program)
    if (tl.sum(row_mask.to(tl.int32)) == 0) | (column >= width):
        return
    slot = tl.load(seg_slot_ptr + segment)
    ranks = tl.arange(0, RANK)
    t = tl.load(
        t_ptr + rows[:, None] * stride_tm + slice_index * RANK + ranks[None, :], mask=row_mask[:, None], other=0.0
    )
    _expand_tile(
        t, y_ptr, b_ptr, rows, row_mask, slot, column, width, tl.minimum(column + n_per_program, width),
        stride_ym, stride_bs, stride_br, FP32, BLOCK_M, RANK, BLOCK_N,
    )


@triton.jit
def _fused_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, sorted_ptr, seg_slot_ptr, seg_start_ptr, seg_rows_ptr, slice_ptr,
    m_tiles, n_per_program, d_in, stride_xm, stride_as, stride_ar, stride_bs, stride_br, stride_ym,
    FP32: tl.constexpr, BLOCK_M: tl.constexpr, RANK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    segment, rows, row_mask = _rows_of_tile(sorted_ptr, seg_start_ptr, seg_rows_ptr, m_tiles, BLOCK_M)
    slice_index, column, width = _columns_of_program(slice_ptr, n_per_program)
    if (tl.sum(row_mask.to(tl.int32)) == 0) | (column >= width):
        return
    slot = tl.load(seg_slot_ptr + segment)
    t = _shrink_tile(
        x_ptr, a_ptr, rows, row_mask, slot, slice_index * RANK, d_in, stride_xm, stride_as, stride_ar,
        FP32, BLOCK_M, RANK, BLOCK_K,
    )
    _expand_tile(
        t, y_ptr, b_ptr, rows, row_mask, slot, column, width, tl.minimum(column + n_per_program, width),
        stride_ym, stride_bs, stride_br, FP32, BLOCK_M, RANK, BLOCK_N,
    )


class TritonBackend:
    """Shrink, expand and the fused delta as Triton kernels over the plan's segments."""

    name = "triton"

    def __init__(self, block_k: int = 64, block_n: int = 128, target_programs: int = 256) -> None:
        self.block_k = block_k
        self.block_n = block_n
        self.target_programs = target_programs
        self._slice_tables: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def shrink(self, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> torch.Tensor:
        """See :func:`loraplane.kernels.ops.shrink`."""
        t = torch.zeros(plan.num_tokens, slots.lora_a.shape[1], dtype=torch.float32, device=x.device)
        if plan.no_lora:
            return t
        plan, block_m, m_tiles = self._prepare(x, plan)
        grid = (len(plan.segments) * m_tiles, slots.n_slices)
        _shrink_kernel[grid](
            x, slots.lora_a, t, plan.sorted_tokens, plan.segment_slots, plan.segment_starts, plan.segment_rows,
            m_tiles, slots.d_in, x.stride(0), slots.lora_a.stride(0), slots.lora_a.stride(1), t.stride(0),
            FP32=x.dtype == torch.float32, BLOCK_M=block_m, RANK=slots.rank_pad, BLOCK_K=self.block_k,
        )
        return t

    def expand(self, y: torch.Tensor, t: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """See :func:`loraplane.kernels.ops.expand`."""
        if plan.no_lora:
            return
        plan, block_m, m_tiles = self._prepare(y, plan)
        grid, n_per_program = self._n_grid(plan, slots, m_tiles)
        _expand_kernel[grid](
            t, slots.lora_b, y, plan.sorted_tokens, plan.segment_slots, plan.segment_starts, plan.segment_rows,
            self._slice_table(slots), m_tiles, n_per_program, t.stride(0), slots.lora_b.stride(0),
            slots.lora_b.stride(1), y.stride(0),
            FP32=y.dtype == torch.float32, BLOCK_M=block_m, RANK=slots.rank_pad, BLOCK_N=self.block_n,
        )

    def apply(self, y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """See :func:`loraplane.kernels.ops.apply_lora` (one fused launch)."""
        if plan.no_lora:
            return
        plan, block_m, m_tiles = self._prepare(x, plan)
        grid, n_per_program = self._n_grid(plan, slots, m_tiles)
        _fused_kernel[grid](
            x, slots.lora_a, slots.lora_b, y, plan.sorted_tokens, plan.segment_slots, plan.segment_starts,
            plan.segment_rows, self._slice_table(slots), m_tiles, n_per_program, slots.d_in, x.stride(0),
            slots.lora_a.stride(0), slots.lora_a.stride(1), slots.lora_b.stride(0), slots.lora_b.stride(1),
            y.stride(0),
            FP32=x.dtype == torch.float32, BLOCK_M=block_m, RANK=slots.rank_pad, BLOCK_K=self.block_k,
            BLOCK_N=self.block_n,
        )

    def _prepare(self, tensor: torch.Tensor, plan: BatchPlan) -> tuple[BatchPlan, int, int]:
        """Validate the input, move the plan next to it, and pick the row tiling."""
        self._check(tensor)
        plan = _on(plan, tensor.device)
        block_m, m_tiles = self._m_tiles(plan)
        return plan, block_m, m_tiles

    @staticmethod
    def _check(tensor: torch.Tensor) -> None:
        interpreted = tensor.device.type == "cpu" and os.environ.get(INTERPRET_ENV) == "1"
        if tensor.device.type != "cuda" and not interpreted:
            raise ValueError(f"the triton backend needs CUDA tensors (or {INTERPRET_ENV}=1 on CPU)")
        if interpreted and tensor.dtype == torch.bfloat16:
            raise ValueError("the Triton interpreter miscomputes bfloat16 dot products; use fp16/fp32 on CPU")
        if tensor.stride(-1) != 1:
            raise ValueError("the triton backend needs row-major x / y / t (last stride 1)")

    @staticmethod
    def _m_tiles(plan: BatchPlan) -> tuple[int, int]:
        """``BLOCK_M`` from the plan's mode (16 rows for decode segments, 32 for prefill) and tiles per segment."""
        block_m = 16 if plan.mode == "decode" else 32
        return block_m, triton.cdiv(plan.max_segment, block_m)

    def _n_grid(self, plan: BatchPlan, slots: LoraSlots, m_tiles: int) -> tuple[tuple[int, int, int], int]:
        """Split each slice's columns so the launch has about ``target_programs`` programs."""
        row_programs = len(plan.segments) * m_tiles * slots.n_slices
        widest = max(slots.out_slices)
        splits = max(1, min(triton.cdiv(widest, self.block_n), self.target_programs // max(row_programs, 1)))
        n_per_program = triton.cdiv(triton.cdiv(widest, splits), self.block_n) * self.block_n
        return (len(plan.segments) * m_tiles, triton.cdiv(widest, n_per_program), slots.n_slices), n_per_program

    def _slice_table(self, slots: LoraSlots) -> torch.Tensor:
        key = (slots.out_slices, slots.device)
        table = self._slice_tables.get(key)
        if table is None:
            pairs = [v for pair in zip(slots.slice_offsets, slots.out_slices, strict=True) for v in pair]
            table = torch.tensor(pairs, dtype=torch.int32, device=slots.device)
            self._slice_tables[key] = table
        return table


def _on(plan: BatchPlan, device: torch.device) -> BatchPlan:
    """The plan with tensors on ``device`` (engines should call ``plan.to(device)`` once per step instead)."""
    return plan if plan.sorted_tokens.device == device else plan.to(device)
