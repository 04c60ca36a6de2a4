"""The weight store of one LoRA-wrapped linear layer: stacked, padded A/B slots."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: K (d_in), N (d_out) and the slot rank are padded to a multiple of this (tensor-core / cube-unit tiles).
ALIGN = 16


def round_up(value: int, multiple: int = ALIGN) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def lora_scale(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoraSlots:
    """Stacked LoRA weights of one linear layer, one adapter per slot.

    Layout (both contiguous by (slot, rank), zero-padded):

    * ``lora_a``: ``[num_slots, n_slices * rank_pad, k_pad]``; rows ``s*rank_pad .. s*rank_pad + r`` hold slice
      ``s``'s A (``[r, d_in]``).
    * ``lora_b``: ``[num_slots, rank_pad, n_pad]``; columns ``offset_s .. offset_s + width_s`` hold slice ``s``'s
      B transposed (``[r, d_out_s]``), already multiplied by the adapter's scale.

    ``rank_pad`` is ``max_rank`` rounded up to 16, ``k_pad``/``n_pad`` are ``d_in``/``sum(out_slices)`` rounded
    up to 16. ``ranks[slot]`` is the rank loaded in a slot (0 = empty). ``version`` increases on every change, and
    ``slot_versions[slot]`` takes the new ``version`` when that slot changes, so
    backends can cache derived layouts.
    """

    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        d_in: int,
        out_slices: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots <= 0 or max_rank <= 0 or d_in <= 0:
            raise ValueError("num_slots, max_rank and d_in must be positive")
        if not out_slices or any(w <= 0 for w in out_slices):
            raise ValueError(f"out_slices must be non-empty positive widths, got {tuple(out_slices)}")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.d_in = d_in
        self.out_slices = tuple(int(w) for w in out_slices)
        self.slice_offsets = tuple(sum(self.out_slices[:i]) for i in range(len(self.out_slices)))
        self.d_out = sum(self.out_slices)
        self.rank_pad = round_up(max_rank)
        self.k_pad = round_up(d_in)
        self.n_pad = round_up(self.d_out)
        self.dtype = dtype
        self.device = torch.device(device)
        n_slices = len(self.out_slices)
        self.lora_a = torch.zeros(num_slots, n_slices * self.rank_pad, self.k_pad, dtype=dtype, device=self.device)
        self.lora_b = torch.zeros(num_slots, self.rank_pad, self.n_pad, dtype=dtype, device=self.device)
        self.ranks = [0] * num_slots
        self.version = 0
        self.slot_versions = [0] * num_slots

    @property
    def n_slices(self) -> int:
        """Number of packed output slices (3 for a fused q/k/v projection)."""
        return len(self.out_slices)

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked A and B tensors."""
        return self.lora_a.nbytes + self.lora_b.nbytes

    def adapter_nbytes(self, slot: int) -> int:
        """Bytes a kernel reads for the adapter in ``slot`` at its own rank (0 when empty)."""
        rank = self.ranks[slot]
        return rank * (self.n_slices * self.d_in + self.d_out) * self.lora_a.element_size()

    def load(
        self,
        slot: int,
        lora_a: Sequence[torch.Tensor],
        lora_b: Sequence[torch.Tensor],
        scale: float | Sequence[float],
    ) -> None:
        """Write one adapter into ``slot``: per slice ``A [r, d_in]`` and ``B [d_out_slice, r]``.

        ``scale`` (one value, or one per slice) is folded into B here, once, in float32 before the cast to the
        slot dtype. A slice whose adapter does not touch it may be given as empty tensors (``r = 0``).
        """
        self._check_slot(slot)
        if len(lora_a) != self.n_slices or len(lora_b) != self.n_slices:
            raise ValueError(f"expected {self.n_slices} A and B tensors (one per output slice)")
        scales = [float(scale)] * self.n_slices if isinstance(scale, int | float) else [float(s) for s in scale]
        if len(scales) != self.n_slices:
            raise ValueError(f"expected {self.n_slices} scales")
        ranks = []
        for index, (a, b, width) in enumerate(zip(lora_a, lora_b, self.out_slices, strict=True)):
            rank = a.shape[0] if a.dim() == 2 else 0
            if a.numel() and (a.dim() != 2 or a.shape[1] != self.d_in):
                raise ValueError(f"slice {index}: A must be [r, {self.d_in}], got {tuple(a.shape)}")
            if b.numel() and (b.dim() != 2 or tuple(b.shape) != (width, rank)):
                raise ValueError(f"slice {index}: B must be [{width}, {rank}], got {tuple(b.shape)}")
            if rank > self.max_rank:
                raise ValueError(f"slice {index}: rank {rank} exceeds this layer's max_rank {self.max_rank}")
            ranks.append(rank if a.numel() else 0)
        self.clear(slot)
        for index, (a, b, s) in enumerate(zip(lora_a, lora_b, scales, strict=True)):
            rank = ranks[index]
            if rank == 0:
                continue
            row = index * self.rank_pad
            offset = self.slice_offsets[index]
            self.lora_a[slot, row : row + rank, : self.d_in] = a.to(self.device, torch.float32).to(self.dtype)
            scaled_b = b.to(self.device, torch.float32) * s
            self.lora_b[slot, :rank, offset : offset + self.out_slices[index]] = scaled_b.t().to(self.dtype)
        self.ranks[slot] = max(ranks)
        self._changed(slot)

    def clear(self, slot: int) -> None:
        """Zero ``slot`` (an empty slot contributes nothing even if a plan points at it)."""
        self._check_slot(slot)
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.ranks[slot] = 0
        self._changed(slot)

    def _changed(self, slot: int) -> None:
        self.version += 1
        self.slot_versions[slot] = self.version

    def slice_b(self, slot: int, index: int, rank: int | None = None) -> torch.Tensor:
        """View ``[rank, width]`` of slice ``index``'s scaled B^T in ``slot`` (rank defaults to the slot's)."""
        offset = self.slice_offsets[index]
        rows = self.ranks[slot] if rank is None else rank
        return self.lora_b[slot, :rows, offset : offset + self.out_slices[index]]

    def delta_weight(self, slot: int) -> torch.Tensor:
        """Dense ``[d_out, d_in]`` scaled ``B @ A`` of the adapter in ``slot`` (float32; for merging)."""
        self._check_slot(slot)
        rows = []
        for index in range(self.n_slices):
            row = index * self.rank_pad
            a = self.lora_a[slot, row : row + self.rank_pad, : self.d_in].float()
            b = self.slice_b(slot, index, self.rank_pad).float()
            rows.append(b.t() @ a)
        return torch.cat(rows, dim=0)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
