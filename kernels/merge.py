"""Merging one adapter into a base weight and back, and when a batch is faster served merged."""

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
