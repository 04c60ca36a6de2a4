"""External reference: a random ``LlamaForCausalLM`` saved by ``transformers`` and a ``peft`` LoRA on it.

The engine must reproduce transformers' logits (fp32, atol 1e-4) and greedy tokens, and peft's greedy tokens with
the adapter loaded through ``/v1/load_lora_adapter`` of a real engine process, unmerged and with merge forced on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from loraplane.api import ADAPTER_DIGEST_HEADER, adapter_digest
from loraplane.engine.model import KVCache, LlamaModel, SequenceChunk, read_checkpoint
from loraplane.kernels import BatchPlanner
from tests.engine.helpers import EngineProcess

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow
PROMPT = [3, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
NEW_TOKENS = 8


def _hf_model(tie: bool) -> torch.nn.Module:
    torch.manual_seed(1234 + tie)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _word_tokenizer() -> Any:
    """A tiny word-level ``tokenizers`` tokenizer (the model directory's ``tokenizer.json``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 5, "world": 6}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def _greedy(model: torch.nn.Module, prompt: Sequence[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


@pytest.mark.parametrize("tie", [True, False], ids=["tied-embeddings", "untied-embeddings"])
def test_logits_match_transformers(tie: bool, tmp_path: Path) -> None:
    hf = _hf_model(tie)
    hf.save_pretrained(tmp_path)
    config, weights = read_checkpoint(tmp_path)
    model = LlamaModel(config, weights, max_loras=1, max_lora_rank=8)
    ids = torch.tensor(PROMPT)
    kv = KVCache(config, max_seqs=2, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    row = kv.allocate(len(PROMPT) + 1)
    assert row is not None
    planner = BatchPlanner(max_tokens=64, num_slots=1)
    logits = model.forward(ids, torch.arange(len(PROMPT)), [SequenceChunk(row, 0, len(PROMPT), 0)],
                           planner.plan([-1] * len(PROMPT)), kv, all_logits=True)
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    # one decode step through the KV cache gives the next position's logits too
    step_token = int(reference[-1].argmax())
    step = model.forward(torch.tensor([step_token]), torch.tensor([len(PROMPT)]), [SequenceChunk(row, 0, 1, len(PROMPT))],
                         planner.plan([-1]), kv)
    with torch.no_grad():
        reference_step = hf(torch.tensor([[*PROMPT, step_token]])).logits[0, -1]
    torch.testing.assert_close(step[0], reference_step, atol=1e-4, rtol=0)


@pytest.mark.parametrize("merge", ["auto", "force"])
def test_greedy_tokens_match_transformers_and_peft_over_http(
    tmp_path: Path, adapter_root: Path, start_engine: Callable[[Sequence[str]], EngineProcess], merge: str
) -> None:
    hf = _hf_model(tie=False)
    model_dir = tmp_path / "hf-llama"
    hf.save_pretrained(model_dir)
    tokenizer = _word_tokenizer()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    base_tokens = _greedy(hf, PROMPT)
    lora_config = peft.LoraConfig(r=8, lora_alpha=24, init_lora_weights=False, lora_dropout=0.0,
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(99)
    peft_model = peft.get_peft_model(hf, lora_config).eval()
    with torch.no_grad():  # make the delta large enough to change greedy tokens
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(8.0)
    adapter_dir = adapter_root / "peft-reference"
    peft_model.save_pretrained(adapter_dir)
    lora_tokens = _greedy(peft_model, PROMPT)
    assert lora_tokens != base_tokens, "the reference adapter must change the output"

    engine = start_engine(["--model", str(model_dir), "--max-lora-rank", "8", "--enable-lora-runtime-updating",
                           "--adapter-root", str(adapter_root), "--lora-merge", merge])
    with httpx.Client(base_url=engine.url, timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        base = http.post("/v1/completions", json={**body, "model": "hf-llama"})
        assert base.status_code == 200, base.text
        assert base.json()["choices"][0]["token_ids"] == base_tokens
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "reference@v1", "lora_path": "peft-reference"})
        assert loaded.status_code == 200, loaded.text
        with_lora = http.post("/v1/completions", json={**body, "model": "reference@v1"})
        assert with_lora.json()["choices"][0]["token_ids"] == lora_tokens
        assert with_lora.headers[ADAPTER_DIGEST_HEADER] == adapter_digest(adapter_dir)
        text = http.post("/v1/completions", json={**body, "model": "hf-llama", "prompt": "hello world unknown"})
        assert text.json()["choices"][0]["prompt_token_ids"] == tokenizer.encode("hello world unknown").ids == [5, 6, 0]
        merges = [line for line in http.get("/metrics").text.splitlines()
                  if line.startswith('loraplane_engine_lora_merges_total{action="merge"}')]
    assert (sum(float(line.split()[-1]) for line in merges) > 0) == (merge == "force")  # forced: served merged
