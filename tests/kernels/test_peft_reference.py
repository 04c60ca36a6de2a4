"""Correctness against an external reference: a tiny random Llama from transformers with LoRA adapters from peft."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from loraplane.kernels import BatchPlanner  # noqa: E402
from loraplane.kernels.layers import LoraContext, inject_lora, load_adapter  # noqa: E402
from loraplane.kernels.peft import load_peft_adapter  # noqa: E402

SEQ_LEN = 5
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: name -> LoraConfig kwargs: several ranks, rsLoRA on one, different target modules, per-module patterns.
ADAPTERS = {
    "alpha": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "beta": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj"]),
    "gamma": dict(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 4},
        alpha_pattern={"up_proj": 5.0},
    ),
}
SLOT_OF = {"alpha": 0, "beta": 1, "gamma": 2}
#: Batch rows: several adapters, some rows without LoRA, one adapter on non-adjacent rows.
ROWS = ["alpha", None, "gamma", "beta", "alpha", None, "gamma"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    base = transformers.LlamaForCausalLM(config).eval()
    ours = copy.deepcopy(base)
    peft_model = None
    root = tmp_path_factory.mktemp("adapters")
    for name, kwargs in ADAPTERS.items():
        lora_config = peft.LoraConfig(init_lora_weights=False, **kwargs)
        if peft_model is None:
            peft_model = peft.get_peft_model(base, lora_config, adapter_name=name)
        else:
            peft_model.add_adapter(name, lora_config)
    assert peft_model is not None
    peft_model.eval()
    for name in ADAPTERS:
        with torch.no_grad():  # PEFT's random init leaves B tiny; make every delta clearly visible
            for param_name, param in peft_model.named_parameters():
                if f"lora_B.{name}." in param_name:
                    param.normal_(0.0, 0.2)
        peft_model.save_pretrained(str(root), selected_adapters=[name])
    context = LoraContext(backend="torch")
    layers = inject_lora(ours, TARGETS, num_slots=4, max_rank=16, context=context)
    for name, slot in SLOT_OF.items():
        directory = root / name if (root / name).is_dir() else root
        load_adapter(layers, slot, load_peft_adapter(Path(directory)))
    return peft_model, ours, context


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 96, (len(ROWS), SEQ_LEN), generator=generator)


def _ours(model, context: LoraContext, tokens: torch.Tensor, rows: list[str | None]) -> torch.Tensor:
    token_slots = [SLOT_OF[name] if name else -1 for name in rows for _ in range(SEQ_LEN)]
    context.plan = BatchPlanner(max_tokens=256, num_slots=4).plan(token_slots)
    try:
        with torch.no_grad():
            return model(input_ids=tokens).logits
    finally:
        context.plan = None


def _peft_alone(peft_model, tokens: torch.Tensor, name: str | None, merged: bool = False) -> torch.Tensor:
    with torch.no_grad():
        if name is None:
            with peft_model.disable_adapter():
                return peft_model(input_ids=tokens).logits
        peft_model.set_adapter(name)
        if merged:
            peft_model.merge_adapter()
        try:
            return peft_model(input_ids=tokens).logits
        finally:
            if merged:
                peft_model.unmerge_adapter()


def test_saved_adapters_parse_with_patterns_and_rslora(models, tmp_path: Path) -> None:
    peft_model, _, _ = models
    peft_model.save_pretrained(str(tmp_path), selected_adapters=["gamma", "beta"])
    gamma = load_peft_adapter(tmp_path / "gamma")
    down = gamma.modules["model.layers.0.mlp.down_proj"]
    up = gamma.modules["model.layers.1.mlp.up_proj"]
    assert (down.rank, down.scale) == (4, 32 / 4)
    assert (up.rank, up.scale) == (16, 5.0 / 16)
    beta = load_peft_adapter(tmp_path / "beta")
    assert beta.modules["model.layers.0.self_attn.k_proj"].scale == pytest.approx(8 / 2.0)


def test_mixed_batch_matches_peft_row_alone_and_merged(models) -> None:
    peft_model, ours, context = models
    tokens = _tokens()
    batch = _ours(ours, context, tokens, ROWS)
    for row, name in enumerate(ROWS):
        alone = _peft_alone(peft_model, tokens[row : row + 1], name)
        torch.testing.assert_close(batch[row : row + 1], alone, atol=1e-4, rtol=0)
        merged = _peft_alone(peft_model, tokens[row : row + 1], name, merged=True)
        torch.testing.assert_close(batch[row : row + 1], merged, atol=1e-4, rtol=0)
    with torch.no_grad(), peft_model.disable_adapter():
        base = peft_model(input_ids=tokens).logits
    for row, name in enumerate(ROWS):  # every adapter changes its rows: the comparison above can fail
        assert (name is None) == bool(torch.allclose(batch[row], base[row], atol=1e-4))


def test_permuting_adapters_permutes_outputs_only(models) -> None:
    _, ours, context = models
    tokens = _tokens()
    first = _ours(ours, context, tokens, ROWS)
    permutation = [3, 6, 0, 5, 2, 4, 1]
    second = _ours(ours, context, tokens[permutation], [ROWS[i] for i in permutation])
    torch.testing.assert_close(second, first[permutation], atol=1e-5, rtol=1e-5)
