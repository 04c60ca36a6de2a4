"""Wrapping a model's linear layers with multi-LoRA slots (what the engine and the PEFT-reference tests use)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loraplane.kernels.ops import Backend, apply_lora, lora_delta
from loraplane.kernels.peft import PeftAdapter
from loraplane.kernels.plan import BatchPlan
from loraplane.kernels.slots import LoraSlots


class LoraContext:
    """The current step's plan (and optional backend override), shared by every :class:`LoraLinear`."""

    def __init__(self, backend: Backend | str | None = None) -> None:
        self.plan: BatchPlan | None = None
        self.backend = backend


@dataclass(frozen=True)
class LayerBreakdown:
    """One layer's output for chosen rows, split so a wrong result is located at once (``base`` or ``delta``)."""

    rows: torch.Tensor
    slots: torch.Tensor
    base: torch.Tensor
    delta: torch.Tensor
    output: torch.Tensor


def base_shape(base: nn.Module) -> tuple[int, int]:
    """``(d_in, d_out)`` of an ``nn.Linear`` or a transformers ``Conv1D`` (weights stored fan-in first)."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    nx, nf = getattr(base, "nx", None), getattr(base, "nf", None)
    if isinstance(nx, int) and isinstance(nf, int):
        return nx, nf
    raise TypeError(f"cannot wrap {type(base).__name__}: not a linear layer")


class LoraLinear(nn.Module):
    """A base linear layer plus multi-LoRA slots; each token's adapter comes from the context's plan.

    ``slice_modules`` names the adapter modules packed into this layer's output, in order (one name for a plain
    layer, e.g. three for a fused q/k/v projection).
    """

    def __init__(
        self,
        base: nn.Module,
        slots: LoraSlots,
        context: LoraContext,
        slice_modules: Sequence[str],
    ) -> None:
        super().__init__()
        d_in, d_out = base_shape(base)
        if (slots.d_in, slots.d_out) != (d_in, d_out) or len(slice_modules) != slots.n_slices:
            raise ValueError("the slots do not match the base layer or the slice modules")
        self.base = base
        self.slots = slots
        self.context = context
        self.slice_modules = tuple(slice_modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base(x)`` plus each token's LoRA delta (tokens flattened over leading dimensions)."""
        y = self.base(x)
        plan = self.context.plan
        if plan is None or plan.no_lora:
            return y
        flat_y = y.reshape(-1, self.slots.d_out)
        apply_lora(flat_y, x.reshape(-1, self.slots.d_in), self.slots, plan, self.context.backend)
        return flat_y.view(y.shape)

    def load_adapter(self, slot: int, adapter: PeftAdapter) -> bool:
        """Load the adapter's modules for this layer into ``slot`` (cleared if it has none); True if it has any."""
        a_list, b_list, scales = adapter.for_slices(self.slice_modules)
        if all(a.numel() == 0 for a in a_list):
            self.slots.clear(slot)
            return False
        self.slots.load(slot, a_list, b_list, scales)
        return True

    @torch.no_grad()
    def explain(self, x: torch.Tensor, rows: Sequence[int]) -> LayerBreakdown:
        """Debug aid: base output, LoRA delta and final output of chosen token rows under the current plan."""
        plan = self.context.plan
        flat_x = x.reshape(-1, self.slots.d_in)
        index = torch.as_tensor(list(rows), dtype=torch.long)
        base = self.base(flat_x[index])
        if plan is None or plan.no_lora:
            delta = torch.zeros_like(base)
            slots = torch.full((len(index),), -1, dtype=torch.int32)
        else:
            delta = lora_delta(flat_x, self.slots, plan, self.context.backend)[index.to(flat_x.device)]
            slots = plan.token_slots.cpu()[index]
        return LayerBreakdown(rows=index, slots=slots, base=base, delta=delta, output=base + delta)


def inject_lora(
    model: nn.Module,
    target_modules: Iterable[str],
    num_slots: int,
    max_rank: int,
    context: LoraContext,
    dtype: torch.dtype | None = None,
) -> dict[str, LoraLinear]:
    """Wrap every linear submodule whose last name component is in ``target_modules``; returns them by path."""
    targets = set(target_modules)
    wrapped: dict[str, LoraLinear] = {}
    for path, module in list(model.named_modules()):
        if path.rsplit(".", 1)[-1] not in targets or isinstance(module, LoraLinear):
            continue
        d_in, d_out = base_shape(module)
        weight = module.weight
        slots = LoraSlots(num_slots, max_rank, d_in, (d_out,), dtype=dtype or weight.dtype, device=weight.device)
        layer = LoraLinear(module, slots, context, (path,))
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, layer)
        wrapped[path] = layer
    return wrapped


def load_adapter(layers: dict[str, LoraLinear], slot: int, adapter: PeftAdapter) -> None:
    """Load ``adapter`` into ``slot`` of every wrapped layer; fails if it targets a module that is not wrapped."""
    wrapped_modules = {name for layer in layers.values() for name in layer.slice_modules}
    missing = sorted(set(adapter.modules) - wrapped_modules)
    if missing:
        raise ValueError(f"adapter targets modules that are not LoRA-wrapped: {missing[:5]}")
    for layer in layers.values():
        layer.load_adapter(slot, adapter)
