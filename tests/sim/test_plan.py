"""``loraplane plan``: adapter bytes against real PEFT files, and a recommendation that meets its SLO."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplane.sim.plan import BaseModel, PlanError, main, parse_traffic, read_adapters


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny transformers Llama config and three PEFT adapters saved by peft itself."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("plan")
    config = LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, torch_dtype="float32",
    )  # fmt: skip
    config.save_pretrained(root / "base")
    adapters = root / "adapters"
    for i, (rank, targets) in enumerate([(8, ["q_proj", "v_proj"]), (16, ["q_proj", "k_proj", "down_proj"]), (4, "all-linear")]):
        torch.manual_seed(i)
        model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=rank, target_modules=targets))
        model.save_pretrained(adapters / f"tenant-{i}")
    return root / "base", adapters


def test_adapter_bytes_match_the_files_peft_wrote(model_and_adapters: tuple[Path, Path]) -> None:
    base_dir, adapters_dir = model_and_adapters
    base = BaseModel.from_config(base_dir)
    specs = read_adapters(adapters_dir, base)
    assert [s.rank for s in specs] == [8, 16, 4]
    for spec in specs:
        assert spec.file_bytes is not None and spec.file_bytes > 0
        assert spec.nbytes == spec.file_bytes, spec.name
    # (64 + 64) q + (64 + 32) v per layer, 2 layers, rank 8, fp32
    assert specs[0].nbytes == 2 * (128 + 96) * 8 * 4


@pytest.mark.slow
def test_plan_recommends_a_pool_that_meets_the_slo(
    model_and_adapters: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    base_dir, adapters_dir = model_and_adapters
    argv = ["--base-model", str(base_dir), "--adapters", str(adapters_dir), "--traffic", "tenant-0=20,tenant-1=5,tenant-2=1",
            "--slo-ttft-p99", "250", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_lora_rank"] == 16 and out["files_checked"] == 3 and out["file_mismatches"] == {}
    assert out["max_loras"] == 2  # three adapters with traffic: the largest power of two not above that
    assert out["max_cpu_loras"] == 3
    assert out["meets_slo"] and out["ttft_ms"]["p99"] <= 250
    assert out["pods"] >= 1
    # a much tighter SLO never needs fewer pods
    assert main([*argv[:-3], "--slo-ttft-p99", "60", "--json"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["pods"] >= out["pods"]


def test_bad_input_is_a_clear_error(tmp_path: Path, model_and_adapters: tuple[Path, Path]) -> None:
    base_dir, adapters_dir = model_and_adapters
    with pytest.raises(PlanError, match="unknown adapter"):
        parse_traffic("nobody=3", ["tenant-0"])
    with pytest.raises(PlanError, match="total rate"):
        parse_traffic("lots", ["tenant-0"])
    manifest = tmp_path / "m.yaml"
    manifest.write_text("- {name: a, rank: x}\n")
    with pytest.raises(PlanError, match="integer rank"):
        read_adapters(manifest, BaseModel.from_config(base_dir))
    assert main(["--base-model", str(tmp_path / "missing.json"), "--adapters", str(adapters_dir), "--traffic", "1",
                 "--slo-ttft-p99", "100"]) == 2  # fmt: skip
