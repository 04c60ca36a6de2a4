"""Correctness against an external reference: a tiny random Llama from transformers with LoRA adapters from peft."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from loraplane.kernels import BatchPlanner  # noqa: E402
from loraplane.kernels.layers import (  # noqa: E402
    LoraContext,
    LoraLinear,
    inject_lora,
    load_adapter,
    merge_slot,
    unmerge_slot,
)
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
#: The CPU backends: the torch reference and the native C kernels (where a C compiler builds them).
NO_COMPILER = shutil.which(os.environ.get("CC") or "cc") is None
CPU_BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(NO_COMPILER, reason="no C compiler"))]
#: Adapters served from merged weights (merge forced on): none, one, two; the others and base rows stay unmerged.
MERGED = [(), ("alpha",), ("gamma", "beta")]
MERGED_IDS = ["unmerged", "merged-alpha", "merged-gamma-beta"]


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
    return peft_model, ours, context, layers


@contextmanager
def _merged(layers: dict[str, LoraLinear], names: tuple[str, ...]) -> Iterator[None]:
    """Serve the named adapters from merged weights for the duration (every other row stays unmerged)."""
    for name in names:
        merge_slot(layers.values(), SLOT_OF[name])
    try:
        yield
    finally:
        for name in names:
            unmerge_slot(layers.values(), SLOT_OF[name])


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
    peft_model, _, _, _ = models
    peft_model.save_pretrained(str(tmp_path), selected_adapters=["gamma", "beta"])
    gamma = load_peft_adapter(tmp_path / "gamma")
    down = gamma.modules["model.layers.0.mlp.down_proj"]
    up = gamma.modules["model.layers.1.mlp.up_proj"]
    assert (down.rank, down.scale) == (4, 32 / 4)
    assert (up.rank, up.scale) == (16, 5.0 / 16)
    beta = load_peft_adapter(tmp_path / "beta")
    assert beta.modules["model.layers.0.self_attn.k_proj"].scale == pytest.approx(8 / 2.0)


@pytest.mark.parametrize("merged", MERGED, ids=MERGED_IDS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mixed_batch_matches_peft_row_alone_and_merged(models, backend: str, merged: tuple[str, ...]) -> None:
    peft_model, ours, context, layers = models
    context.backend = backend
    tokens = _tokens()
    by_slot = sorted(range(len(ROWS)), key=lambda row: -1 if ROWS[row] is None else SLOT_OF[ROWS[row]])
    with _merged(layers, merged):
        assert context.merged_slots == {SLOT_OF[name] for name in merged}
        batch = _ours(ours, context, tokens, ROWS)  # an adapter's rows apart: merged rows gathered
        grouped = _ours(ours, context, tokens[by_slot], [ROWS[row] for row in by_slot])  # as the engine lays rows out
    torch.testing.assert_close(grouped, batch[by_slot], atol=1e-5, rtol=0)
    for row, name in enumerate(ROWS):
        alone = _peft_alone(peft_model, tokens[row : row + 1], name)
        torch.testing.assert_close(batch[row : row + 1], alone, atol=1e-4, rtol=0)
        peft_merged = _peft_alone(peft_model, tokens[row : row + 1], name, merged=True)
        torch.testing.assert_close(batch[row : row + 1], peft_merged, atol=1e-4, rtol=0)
    with torch.no_grad(), peft_model.disable_adapter():
        base = peft_model(input_ids=tokens).logits
    for row, name in enumerate(ROWS):  # every adapter changes its rows: the comparison above can fail
        assert (name is None) == bool(torch.allclose(batch[row], base[row], atol=1e-4))


@pytest.mark.parametrize("merged", MERGED, ids=MERGED_IDS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_permuting_adapters_permutes_outputs_only(models, backend: str, merged: tuple[str, ...]) -> None:
    _, ours, context, layers = models
    context.backend = backend
    tokens = _tokens()
    with _merged(layers, merged):
        first = _ours(ours, context, tokens, ROWS)
        permutation = [3, 6, 0, 5, 2, 4, 1]
        second = _ours(ours, context, tokens[permutation], [ROWS[i] for i in permutation])
    torch.testing.assert_close(second, first[permutation], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gpt2_conv1d_fan_in_fan_out_matches_peft_and_merges(tmp_path: Path, backend: str) -> None:
    """GPT-2 stores c_attn as a Conv1D ``[in, out]`` (PEFT's fan_in_fan_out): served and merged like PEFT."""
    from loraplane.kernels.merge import merge_adapter, unmerge_adapter

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16)
    base = transformers.GPT2LMHeadModel(config).eval()
    ours = copy.deepcopy(base)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    peft_model = peft.get_peft_model(base, lora).eval()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(str(tmp_path))
    adapter = load_peft_adapter(tmp_path)
    assert adapter.config.fan_in_fan_out
    context = LoraContext(backend=backend)
    layers = inject_lora(ours, ["c_attn"], num_slots=2, max_rank=8, context=context)
    load_adapter(layers, 1, adapter)
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    context.plan = BatchPlanner(32, 2).plan([1] * 6 + [-1] * 6)
    with torch.no_grad():
        served = ours(input_ids=tokens).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=tokens[1:]).logits
        torch.testing.assert_close(served[:1], peft_model(input_ids=tokens[:1]).logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(served[1:], plain, atol=1e-4, rtol=0)
    layer = layers["transformer.h.0.attn.c_attn"]
    original = layer.base.weight.detach().clone()
    merge_adapter(layer.base.weight.data, layer.slots, 1, fan_in_fan_out=True)
    context.plan = None
    with torch.no_grad():
        merged = ours(input_ids=tokens[:1]).logits
    torch.testing.assert_close(merged, served[:1], atol=1e-4, rtol=0)
    unmerge_adapter(layer.base.weight.data, layer.slots, 1, fan_in_fan_out=True)
    torch.testing.assert_close(layer.base.weight.data, original, atol=1e-6, rtol=0)
