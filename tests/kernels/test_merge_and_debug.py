"""Merge/unmerge round trip, the merge heuristic, and the per-layer debugging breakdown."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loraplane.kernels import BatchPlanner, LoraSlots
from loraplane.kernels.layers import LoraContext, LoraLinear
from loraplane.kernels.merge import merge_adapter, should_merge, unmerge_adapter


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
