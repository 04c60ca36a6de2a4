"""Merge/unmerge round trip, merged copies beside a base that never moves, the merge heuristic, and the per-layer
debugging breakdown."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loraplane.kernels import BatchPlanner, LoraSlots
from loraplane.kernels.layers import LoraContext, LoraLinear, merge_slot, unmerge_slot
from loraplane.kernels.merge import merge_adapter, merged_weight, should_merge, unmerge_adapter


def _layer(dtype: torch.dtype = torch.float32) -> tuple[nn.Linear, LoraSlots, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    base = nn.Linear(24, 20, bias=True).to(dtype)
    slots = LoraSlots(3, 8, 24, (20,), dtype=dtype)
    a, b = torch.randn(6, 24), torch.randn(20, 6)
    slots.load(1, [a.to(dtype)], [b.to(dtype)], 0.75)
    return base, slots, a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_merge_equals_lora_path_and_unmerge_restores(dtype: torch.dtype, fan_in_fan_out: bool) -> None:
    base, slots, _, _ = _layer(dtype)
    weight = base.weight.detach().clone()
    if fan_in_fan_out:  # Conv1D stores [in, out]
        weight = weight.t().contiguous()
    original = weight.clone()
    merge_adapter(weight, slots, 1, fan_in_fan_out)
    x = torch.randn(4, 24).to(dtype)
    merged_w = weight.t() if fan_in_fan_out else weight
    context = LoraContext()
    context.plan = BatchPlanner(8, 3).plan([1] * 4)
    lora_out = LoraLinear(base, slots, context, ("m",))(x)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(
        (x.float() @ merged_w.float().t() + base.bias.float()), lora_out.float(), atol=tolerance, rtol=tolerance
    )
    assert not torch.allclose(weight.float(), original.float(), atol=tolerance)
    largest = weight.float().abs().max().item()
    unmerge_adapter(weight, slots, 1, fan_in_fan_out)
    # restored to within the rounding of the merged magnitude (one ulp each way)
    torch.testing.assert_close(weight, original, atol=2 * torch.finfo(dtype).eps * largest, rtol=0)
    with pytest.raises(ValueError, match="does not fit"):
        merge_adapter(weight[:, :5], slots, 1, fan_in_fan_out)


def test_should_merge_only_for_a_dominant_long_running_adapter() -> None:
    assert should_merge({0: 95, -1: 5}, remaining_steps=1000, lora_seconds_per_step=1e-3, merge_seconds=0.1) == 0
    assert should_merge({0: 60, 1: 40}, remaining_steps=1000, lora_seconds_per_step=1e-3, merge_seconds=0.1) is None
    assert should_merge({0: 100}, remaining_steps=10, lora_seconds_per_step=1e-3, merge_seconds=0.1) is None
    assert should_merge({-1: 10}, remaining_steps=1000, lora_seconds_per_step=1e-3, merge_seconds=0.1) is None


def test_explain_locates_base_and_delta() -> None:
    base, slots, a, b = _layer()
    context = LoraContext()
    layer = LoraLinear(base, slots, context, ("m",))
    x = torch.randn(3, 2, 24)
    context.plan = BatchPlanner(8, 3).plan([1, -1, 1, 1, -1, 0])
    out = layer(x).reshape(6, 20)
    report = layer.explain(x, rows=[0, 1, 5])
    assert report.slots.tolist() == [1, -1, 0]
    flat = x.reshape(6, 24)
    torch.testing.assert_close(report.base, base(flat[[0, 1, 5]]))
    torch.testing.assert_close(report.delta[0], 0.75 * (flat[0] @ a.t()) @ b.t(), atol=1e-4, rtol=1e-4)
    assert not report.delta[1:].any()  # the no-LoRA row and the empty slot 0 add nothing
    torch.testing.assert_close(report.output, out[[0, 1, 5]], atol=1e-5, rtol=1e-5)


def _two_adapter_layer(dtype: torch.dtype) -> tuple[LoraLinear, LoraContext]:
    torch.manual_seed(1)
    base = nn.Linear(24, 20, bias=True).to(dtype)
    slots = LoraSlots(3, 8, 24, (20,), dtype=dtype)
    for slot, rank in ((0, 4), (1, 8)):
        slots.load(slot, [torch.randn(rank, 24).to(dtype)], [torch.randn(20, rank).to(dtype)], 0.5)
    context = LoraContext(backend="torch")
    return LoraLinear(base, slots, context, ("m",)), context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_weight_is_the_in_place_merge_and_leaves_the_base_alone(dtype: torch.dtype) -> None:
    layer, _ = _two_adapter_layer(dtype)
    original = layer.base_weight.detach().clone()
    for fan_in_fan_out in (False, True):
        weight = original.t().contiguous() if fan_in_fan_out else original.clone()
        merged = merged_weight(weight, layer.slots, 1, fan_in_fan_out)
        in_place = weight.clone()
        merge_adapter(in_place, layer.slots, 1, fan_in_fan_out)
        torch.testing.assert_close(merged, in_place, atol=2 * torch.finfo(dtype).eps * in_place.abs().max().item(), rtol=0)
        assert merged.dtype == dtype and merged.data_ptr() != weight.data_ptr()
    assert torch.equal(layer.base_weight, original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_thousand_merge_cycles_leave_the_base_bitwise_equal(dtype: torch.dtype) -> None:
    """The kept copy: merging builds W + BA beside W, unmerging drops it, so no cycle can move a base weight."""
    layer, context = _two_adapter_layer(dtype)
    original = layer.base_weight.detach().clone()
    x = torch.randn(6, 24).to(dtype)
    planner = BatchPlanner(8, 3)
    plan_slots = [-1, 0, 0, 1, 1, -1]
    context.plan = planner.plan(plan_slots)
    with torch.no_grad():
        before = layer(x)
        merged_rows: list[torch.Tensor] = []
        for cycle in range(1000):
            slot = cycle % 2
            merge_slot([layer], slot)
            if cycle < 2:  # merged rows take W + BA; base and the other adapter's rows the unmerged path
                out = layer(x)
                merged_rows.append(out[[1, 2]] if slot == 0 else out[[3, 4]])
                torch.testing.assert_close(out[[0, 5]], before[[0, 5]], atol=0, rtol=0)
            unmerge_slot([layer], slot)
        assert not context.merged_slots and layer.merged_nbytes == 0
        after = layer(x)
    assert torch.equal(layer.base_weight, original)
    assert torch.equal(after, before)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(merged_rows[0].float(), before[[1, 2]].float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(merged_rows[1].float(), before[[3, 4]].float(), atol=tolerance, rtol=tolerance)


def test_unmerging_in_place_drifts_in_bf16() -> None:
    """Why the engine keeps the base: subtracting the delta back rounds, and 1,000 round trips move weights."""
    layer, _ = _two_adapter_layer(torch.bfloat16)
    weight = layer.base_weight.detach().clone()
    original = weight.clone()
    for _ in range(1000):
        merge_adapter(weight, layer.slots, 1)
        unmerge_adapter(weight, layer.slots, 1)
    assert not torch.equal(weight, original)


def test_a_merged_slot_that_changes_is_refused_not_served_stale() -> None:
    layer, context = _two_adapter_layer(torch.float32)
    context.plan = BatchPlanner(8, 3).plan([0, 0, 1])
    merge_slot([layer], 0)
    x = torch.randn(3, 24)
    layer(x)
    with pytest.raises(RuntimeError, match="unmerge it"):
        layer.load_adapter(0, None)  # type: ignore[arg-type]  # refused before the adapter is read
    layer.slots.load(0, [torch.randn(2, 24)], [torch.randn(20, 2)], 1.0)  # behind the layer's back
    with pytest.raises(RuntimeError, match="changed after it was merged"):
        layer(x)
    unmerge_slot([layer], 0)
    layer(x)


def test_a_layer_the_merged_adapter_does_not_touch_keeps_one_gemm() -> None:
    layer, context = _two_adapter_layer(torch.float32)
    layer.slots.clear(2)
    assert layer.merge(2) == 0 and layer.merge_nbytes(2) == 0
    context.merged_slots = frozenset({2})
    context.plan = BatchPlanner(8, 3).plan([2, 2, 1, -1])
    x = torch.randn(4, 24)
    with torch.no_grad():
        merged = layer(x)
        context.merged_slots = frozenset()
        unmerged = layer(x)
    torch.testing.assert_close(merged, unmerged, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged[:2], layer.base(x[:2]), atol=1e-6, rtol=0)
