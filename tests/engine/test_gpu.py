"""On a CUDA GPU the engine gives the same greedy answers as on the CPU (fp32), with slots on the device."""

from __future__ import annotations

import pytest

from loraplane.engine.app import EngineOptions
from tests.engine.helpers import GeneratedAdapter, completion, inprocess

pytestmark = pytest.mark.gpu


async def _answers(device: str, adapters: list[GeneratedAdapter]) -> list[list[int]]:
    options = EngineOptions(device=device, max_loras=2, max_cpu_loras=3, lora_modules={a.name: a.path for a in adapters})
    async with inprocess(options) as (built, http):
        answers = []
        for model in ["tiny", *(a.name for a in adapters)]:
            body = (await http.post("/v1/completions", json=completion(model, "hello gpu", 8, return_token_ids=True))).json()
            answers.append(body["choices"][0]["token_ids"])
        if device != "cpu":
            assert next(built.engine.model.lora_linears()).slots.lora_a.is_cuda
    return answers


async def test_cuda_answers_match_cpu(tiny_adapters: list[GeneratedAdapter]) -> None:
    adapters = tiny_adapters[:4]
    assert await _answers("cuda", adapters) == await _answers("cpu", adapters)
