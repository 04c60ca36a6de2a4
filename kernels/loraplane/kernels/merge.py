"""Merging one adapter into a base weight and back, and when a batch is faster served merged.

Two ways to serve an adapter merged: :func:`merged_weight` builds a separate merged copy next to a base weight that
is never written (the engine's way: restoring the base is dropping the copy, bitwise exact however often it is
done), and :func:`merge_adapter` / :func:`unmerge_adapter` add and subtract the delta in place (no second copy,
but every round trip may move a weight by a rounding step).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loraplane.kernels.slots import LoraSlots

#: An adapter must own at least this share of a step's LoRA-or-base rows before merging it can pay off.
MIN_MERGE_SHARE = 0.9


def _delta_for(weight: torch.Tensor, slots: LoraSlots, slot: int, fan_in_fan_out: bool) -> torch.Tensor:
    delta = slots.delta_weight(slot).to(weight.device)
    delta = delta.t() if fan_in_fan_out else delta
    if delta.shape != weight.shape:
        raise ValueError(f"adapter delta {tuple(delta.shape)} does not fit the weight {tuple(weight.shape)}")
    return delta


@torch.no_grad()
def merged_weight(weight: torch.Tensor, slots: LoraSlots, slot: int, fan_in_fan_out: bool = False) -> torch.Tensor:
    """A new tensor ``W + scale * B A`` (``weight`` untouched): float32 accumulate, rounded once to its dtype.

    Each output slice's delta is one GEMM at the slot's own rank (not the padded one). ``fan_in_fan_out`` for
    ``[in, out]`` weights (transformers' ``Conv1D``).
    """
    slots._check_slot(slot)
    shape = (slots.d_in, slots.d_out) if fan_in_fan_out else (slots.d_out, slots.d_in)
    if tuple(weight.shape) != shape:
        raise ValueError(f"adapter delta {shape} does not fit the weight {tuple(weight.shape)}")
    merged = weight.to(torch.float32, copy=True)
    rows = merged.t() if fan_in_fan_out else merged  # [d_out, d_in] view
    rank = slots.ranks[slot]
    if rank:
        for index, (offset, width) in enumerate(zip(slots.slice_offsets, slots.out_slices, strict=True)):
            first = index * slots.rank_pad
            a = slots.lora_a[slot, first : first + rank, : slots.d_in].to(weight.device, torch.float32)
            b_t = slots.slice_b(slot, index, rank).to(weight.device, torch.float32)  # [rank, width], scaled
            rows[offset : offset + width].addmm_(b_t.t(), a)
    return merged if weight.dtype == torch.float32 else merged.to(weight.dtype)


@torch.no_grad()
def merge_adapter(weight: torch.Tensor, slots: LoraSlots, slot: int, fan_in_fan_out: bool = False) -> None:
    """``W += scale * B A`` in place (computed in float32, rounded once); weights ``[in, out]`` if fan_in_fan_out."""
    weight.copy_((weight.float() + _delta_for(weight, slots, slot, fan_in_fan_out)).to(weight.dtype))


@torch.no_grad()
def unmerge_adapter(weight: torch.Tensor, slots: LoraSlots, slot: int, fan_in_fan_out: bool = False) -> None:
    """Undo :func:`merge_adapter` (the base weight comes back within the dtype's rounding)."""
    weight.copy_((weight.float() - _delta_for(weight, slots, slot, fan_in_fan_out)).to(weight.dtype))


def should_merge(
    token_counts: Mapping[int, int],
    remaining_steps: float,
    lora_seconds_per_step: float,
    merge_seconds: float,
    min_share: float = MIN_MERGE_SHARE,
) -> int | None:
    """The slot worth merging for the coming steps, or None.

    ``token_counts`` maps slot -> rows per step (-1 = rows without LoRA). Once an adapter is merged, every OTHER
    row needs a correction delta (its own adapter minus the merged one), so merging only saves time when one
    adapter owns nearly all rows (``min_share``) and the LoRA work saved over the expected remaining steps
    (``remaining_steps * lora_seconds_per_step``, measured by the engine) exceeds the cost of merging and later
    unmerging (``2 * merge_seconds``: each pass reads and writes every base weight once).
    """
    total = sum(token_counts.values())
    candidates = [(count, slot) for slot, count in token_counts.items() if slot >= 0]
    if total == 0 or not candidates:
        return None
    count, slot = max(candidates)
    if count / total < min_share:
        return None
    return slot if remaining_steps * lora_seconds_per_step > 2 * merge_seconds else None
