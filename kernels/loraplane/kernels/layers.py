"""Wrapping a model's linear layers with multi-LoRA slots (what the engine and the PEFT-reference tests use)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from loraplane.kernels.merge import merged_weight
from loraplane.kernels.ops import Backend, apply_lora, lora_delta
from loraplane.kernels.peft import PeftAdapter
from loraplane.kernels.plan import BatchPlan, BatchPlanner, _runs
from loraplane.kernels.slots import LoraSlots

#: The rows of one weight in a merged step: a range of consecutive rows, or their indices.
Rows = slice | torch.Tensor


@dataclass(frozen=True)
class MergeSplit:
    """One step's rows divided by the weight that serves them (shared by every layer of the step).

    ``groups``: ``(slot, rows)`` for the rows of each merged slot present, ``(-1, rows)`` for every other row (base
    rows and rows of adapters that are not merged: the unmerged weight). ``rest``: the step's plan with the merged
    slots' rows set to -1, i.e. the LoRA the unmerged rows still need. Ranges when each weight's rows are
    consecutive (the engine lays rows out by slot), index tensors otherwise.
    """

    groups: tuple[tuple[int, Rows], ...]
    rest: BatchPlan


class LoraContext:
    """The current step's plan (and optional backend override), shared by every :class:`LoraLinear`.

    ``merged_slots``: slots served from merged weights in every layer (:func:`merge_slot`); their rows skip the
    LoRA ops and use ``W + scale * B A``, every other row the unmerged weight plus its own adapter. Taking a slot
    out of this set (without :func:`unmerge_slot`) serves it unmerged again while the layers keep its copies, so a
    caller can choose per step at no cost.
    """

    def __init__(self, backend: Backend | str | None = None) -> None:
        self.plan: BatchPlan | None = None
        self.backend = backend
        self.merged_slots: frozenset[int] = frozenset()
        self._split_of: tuple[BatchPlan, frozenset[int]] | None = None
        self._split: MergeSplit | None = None
        self._planner: BatchPlanner | None = None

    def merge_split(self) -> MergeSplit | None:
        """How the current plan's rows divide between merged and unmerged weights; None when no merged slot has
        rows in it (computed once per plan and merged set, for every layer)."""
        plan = self.plan
        if plan is None or not self.merged_slots:
            return None
        cached = self._split_of
        if cached is not None and cached[0] is plan and cached[1] == self.merged_slots:
            return self._split
        self._split_of = (plan, self.merged_slots)
        self._split = self._compute_split(plan, self.merged_slots)
        return self._split

    def _compute_split(self, plan: BatchPlan, merged: frozenset[int]) -> MergeSplit | None:
        present = {seg.slot for seg in plan.segments} & merged
        if not present:
            return None
        token_slots = plan.token_slots.tolist()
        keys = [s if s in present else -1 for s in token_slots]
        runs = _runs(keys)
        device = plan.token_slots.device
        groups: list[tuple[int, Rows]]
        if len(runs) == len({run.slot for run in runs}):  # each weight's rows are consecutive: row ranges
            groups = [(run.slot, slice(run.start, run.end)) for run in runs]
        else:
            groups = [(key, torch.tensor([i for i, k in enumerate(keys) if k == key], dtype=torch.long, device=device))
                      for key in sorted(set(keys))]
        rest_slots = [-1 if s in present else s for s in token_slots]
        needed_slots = max(token_slots) + 1
        if self._planner is None or self._planner.max_tokens < len(rest_slots) or self._planner.num_slots < needed_slots:
            self._planner = BatchPlanner(max(len(rest_slots), 256), max(needed_slots, 16))
        rest = self._planner.plan(rest_slots, decode=plan.mode == "decode")
        if device.type != "cpu":
            rest = rest.to(device)
        return MergeSplit(tuple(groups), rest)


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
        self.fan_in_fan_out = not isinstance(base, nn.Linear)  # transformers' Conv1D keeps weights [in, out]
        #: slot -> (the slot's version when merged, W + scale * B A, or None where the adapter has no weights here)
        self._merged: dict[int, tuple[int, torch.Tensor | None]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base(x)`` plus each token's LoRA delta (tokens flattened over leading dimensions); rows of merged
        slots use their merged weight instead (:meth:`merge`)."""
        plan = self.context.plan
        split = self.context.merge_split() if plan is not None and self.context.merged_slots else None
        if split is not None:
            return self._forward_split(x, split)
        y = self.base(x)
        if plan is None or plan.no_lora:
            return y
        flat_y = y.reshape(-1, self.slots.d_out)
        apply_lora(flat_y, x.reshape(-1, self.slots.d_in), self.slots, plan, self.context.backend)
        return flat_y.view(y.shape)

    def _forward_split(self, x: torch.Tensor, split: MergeSplit) -> torch.Tensor:
        """A merged step: each group of rows through its own weight, then the unmerged rows' LoRA (``rest``)."""
        weights = [(self._merged_weight(slot) if slot >= 0 else None, rows) for slot, rows in split.groups]
        flat_x = x.reshape(-1, self.slots.d_in)
        if all(weight is None for weight, _ in weights):  # no merged slot touches this layer: one GEMM
            flat_y = self.base(flat_x)
        elif len(weights) == 1:
            flat_y = self._linear(flat_x, weights[0][0])
        else:
            flat_y = torch.empty(flat_x.shape[0], self.slots.d_out, dtype=flat_x.dtype, device=flat_x.device)
            for weight, rows in weights:
                if isinstance(rows, slice):
                    flat_y[rows] = self._linear(flat_x[rows], weight)
                else:
                    flat_y.index_copy_(0, rows, self._linear(flat_x.index_select(0, rows), weight))
        if not split.rest.no_lora:
            apply_lora(flat_y, flat_x, self.slots, split.rest, self.context.backend)
        return flat_y.view(*x.shape[:-1], self.slots.d_out)

    @property
    def base_weight(self) -> torch.Tensor:
        """The base layer's weight (``[out, in]``, or ``[in, out]`` for a ``Conv1D``); never written by merging."""
        return cast(torch.Tensor, self.base.weight)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """The base layer's computation on rows ``x`` with ``weight`` (None: the base weight) in its layout."""
        w = self.base_weight if weight is None else weight
        bias = cast(torch.Tensor | None, getattr(self.base, "bias", None))
        if not self.fan_in_fan_out:
            return F.linear(x, w, bias)
        return torch.addmm(bias, x, w) if bias is not None else x @ w

    def _merged_weight(self, slot: int) -> torch.Tensor | None:
        entry = self._merged.get(slot)
        if entry is None:
            raise RuntimeError(f"slot {slot} is merged in the context but not in this layer (merge_slot merges every layer)")
        version, weight = entry
        if version != self.slots.slot_versions[slot]:
            raise RuntimeError(f"slot {slot} changed after it was merged: unmerge it before loading or clearing the slot")
        return weight

    @torch.no_grad()
    def merge(self, slot: int) -> int:
        """Build this layer's merged weight for ``slot`` (the base weight is never written); bytes allocated.

        A slot with no weights in this layer needs no copy: its rows use the base weight.
        """
        self.slots._check_slot(slot)
        version = self.slots.slot_versions[slot]
        if self.slots.ranks[slot] == 0:
            self._merged[slot] = (version, None)
            return 0
        weight = merged_weight(self.base_weight, self.slots, slot, self.fan_in_fan_out)
        self._merged[slot] = (version, weight)
        return weight.nbytes

    def unmerge(self, slot: int) -> None:
        """Drop this layer's merged weight for ``slot`` (restoring is freeing the copy: the base was never written)."""
        self._merged.pop(slot, None)

    def merge_nbytes(self, slot: int) -> int:
        """Bytes :meth:`merge` would allocate for ``slot`` now."""
        return self.base_weight.nbytes if self.slots.ranks[slot] else 0

    @property
    def merged_nbytes(self) -> int:
        """Bytes of this layer's merged weights."""
        return sum(w.nbytes for _, w in self._merged.values() if w is not None)

    def load_adapter(self, slot: int, adapter: PeftAdapter) -> bool:
        """Load the adapter's modules for this layer into ``slot`` (cleared if it has none); True if it has any."""
        if slot in self._merged or slot in self.context.merged_slots:
            raise RuntimeError(f"slot {slot} is merged: unmerge it (unmerge_slot) before loading another adapter")
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


def merge_slot(layers: Iterable[LoraLinear], slot: int) -> int:
    """Serve ``slot`` merged in every layer: build the merged weights, then add it to the context's merged slots;
    returns the bytes allocated. Rows of other slots and rows without LoRA keep the unmerged weight."""
    layers = list(layers)
    total = sum(layer.merge(slot) for layer in layers)
    for context in {id(layer.context): layer.context for layer in layers}.values():
        context.merged_slots = context.merged_slots | {slot}
    return total


def unmerge_slot(layers: Iterable[LoraLinear], slot: int) -> None:
    """Serve ``slot`` through the LoRA ops again and free its merged weights."""
    layers = list(layers)
    for context in {id(layer.context): layer.context for layer in layers}.values():
        context.merged_slots = context.merged_slots - {slot}
    for layer in layers:
        layer.unmerge(slot)


def load_adapter(layers: dict[str, LoraLinear], slot: int, adapter: PeftAdapter) -> None:
    """Load ``adapter`` into ``slot`` of every wrapped layer; fails if it targets a module that is not wrapped."""
    wrapped_modules = {name for layer in layers.values() for name in layer.slice_modules}
    missing = sorted(set(adapter.modules) - wrapped_modules)
    if missing:
        raise ValueError(f"adapter targets modules that are not LoRA-wrapped: {missing[:5]}")
    for layer in layers.values():
        layer.load_adapter(slot, adapter)
