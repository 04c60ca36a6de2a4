"""CUDA-only checks: Triton against the torch backend on realistic shapes (bf16 included) and the CUDA benchmark."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from loraplane.kernels import BatchPlanner, LoraSlots, lora_delta

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("ranks", [(16,), (8, 16, 64)], ids=["r16", "mixed"])
def test_triton_matches_torch_on_cuda(dtype: torch.dtype, ranks: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(0)
    slices = (1024, 256, 256)  # packed q/k/v
    slots = LoraSlots(8, max(ranks), 1024, slices, dtype=dtype, device="cuda")
    for slot in range(7):
        rank = ranks[slot % len(ranks)]
        a = [torch.randn(rank, 1024, generator=generator) / 32 for _ in slices]
        b = [torch.randn(width, rank, generator=generator) / rank**0.5 for width in slices]
        slots.load(slot, a, b, 2.0)
    weights = torch.tensor([k**-1.5 for k in range(1, 9)])
    token_slots = (torch.multinomial(weights, 300, replacement=True, generator=generator) - 1).tolist()
    planner = BatchPlanner(4096, 8)
    x = torch.randn(300, 1024, generator=generator).to("cuda", dtype)
    for layout in (token_slots, sorted(token_slots), [s for s in token_slots[:4] for _ in range(64)]):
        plan = planner.plan(layout).to("cuda")
        inputs = x[: len(layout)]
        expected = lora_delta(inputs, slots, plan, backend="torch").float()
        got = lora_delta(inputs, slots, plan, backend="triton").float()
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype])


def test_cuda_benchmark_prints_one_json_object() -> None:
    from loraplane.bench.kernels import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--quick", "--device", "cuda", "--json", "--case", "decode_64x16"]) == 0
    report = json.loads(out.getvalue())
    case = report["cases"][0]
    assert case["backend"] == "triton" and case["achieved_gbps"] > 0
