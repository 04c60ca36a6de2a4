"""A vLLM punica wrapper for the CPU platform that computes LoRA with loraplane's SGMV (see vllm_plugin.py).

Imported by vLLM only (through the plugin's ``get_punica_wrapper`` qualname), so it may import vLLM at the top.
vLLM's own wrapper keeps everything loraplane does not replace: the metadata (``update_metadata``), the embedding
LoRA and the MoE paths. Linear layers and the logits head run ``loraplane.kernels.apply_lora`` over a
:class:`~loraplane.kernels.BatchPlan` built once per mapping change from vLLM's per-row slot indices (the sampler
rows' plan only when a logits layer asks for it), on
:class:`~loraplane.kernels.vllm_plugin.StackedMirror` copies of vLLM's stacked weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from loraplane.kernels.ops import apply_lora
from loraplane.kernels.plan import BatchPlan, BatchPlanner
from loraplane.kernels.vllm_plugin import StackedMirror


class LoraplanePunicaWrapperCPU(PunicaWrapperCPU):
    """vLLM's CPU punica wrapper with ``add_lora_linear`` and ``add_lora_logits`` computed by loraplane.

    Rows whose slot index is -1 (base-model requests) get no LoRA, whatever the batch holds.
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str, **kwargs: Any):
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        self.mirror = StackedMirror()
        self._max_tokens = max_num_batched_tokens
        self._token_planner: BatchPlanner | None = None
        self._sampler_planner: BatchPlanner | None = None
        self._token_plan: BatchPlan | None = None
        self._sampler_plan: BatchPlan | None = None

    def update_metadata(
        self, mapping: Any, lora_index_to_id: list[int | None], max_loras: int, vocab_size: int, **kwargs: Any
    ) -> None:
        """vLLM's metadata, then loraplane's plans of the token and sampler rows (once per mapping change)."""
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        slots = len(lora_index_to_id)
        if self._token_planner is None or self._token_planner.num_slots != slots:
            self._token_planner = BatchPlanner(self._max_tokens, slots)
            self._sampler_planner = BatchPlanner(self._max_tokens, slots)
        self._token_plan = self._token_planner.plan(self.token_lora_indices)
        self._sampler_plan = None  # planned at the first logits call of this mapping (most models have none)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        """``y[:, slice s] += x A_s^T B_s^T`` per row's slot, in place (no LoRA for slot -1)."""
        if not self._apply(self._token_plan, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices):
            super().add_lora_linear(
                y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs
            )

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """The logits head's LoRA per request (vLLM's sampler indices), in place."""
        width = (lora_b_stacked.shape[2],)
        if self._sampler_plan is None and self._sampler_planner is not None:
            self._sampler_plan = self._sampler_planner.plan(self.sampler_indices)
        if not self._apply(self._sampler_plan, y, x, (lora_a_stacked,), (lora_b_stacked,), scale, width):
            super().add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)

    def _apply(
        self,
        plan: BatchPlan | None,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: Sequence[torch.Tensor],
        lora_b: Sequence[torch.Tensor],
        scale: float,
        out_slices: Sequence[int],
    ) -> bool:
        """Run loraplane's op; False (vLLM's op runs instead) for a call outside what the mirror covers."""
        y2 = y if y.dim() == 2 else y.view(-1, y.shape[-1])
        x2 = x if x.dim() == 2 else x.view(-1, x.shape[-1])
        if (
            plan is None
            or scale != 1.0
            or x2.shape[0] != plan.num_tokens
            or y2.shape != (x2.shape[0], sum(out_slices))
            or x2.dtype != lora_a[0].dtype
            or y2.dtype != lora_a[0].dtype
        ):
            return False
        if plan.no_lora:
            return True
        apply_lora(y2, x2, self.mirror.slots_for(lora_a, lora_b, out_slices), plan)
        return True
