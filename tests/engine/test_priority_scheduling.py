"""vLLM's priority scheduling in the reference engine: lower ``priority`` values are admitted first."""

from __future__ import annotations

import asyncio

import pytest

from loraplane.engine.app import EngineOptions
from loraplane.engine.core import RequestError, SamplingParams
from tests.engine.helpers import completion, inprocess


async def _finish_order(policy: str, priorities: list[int]) -> list[int]:
    options = EngineOptions(model="tiny", max_num_seqs=1, scheduling_policy=policy)
    async with inprocess(options) as (built, _http):
        engine = built.engine
        # submitted in one go, before any step runs: they all wait for the one sequence slot
        requests = [engine.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0, priority=p), None)
                    for p in priorities]
        order: list[int] = []

        async def drain(i: int) -> None:
            async for _event in engine.stream(requests[i]):
                pass
            order.append(i)

        await asyncio.gather(*(drain(i) for i in range(len(requests))))
        return order


async def test_a_waiting_request_of_a_lower_priority_value_is_admitted_first() -> None:
    assert await _finish_order("priority", [5, 0, -3, 0]) == [2, 1, 3, 0]  # ties keep arrival order
    assert await _finish_order("fcfs", [0, 0, 0]) == [0, 1, 2]


async def test_a_priority_without_the_priority_policy_is_refused_as_vllm_does() -> None:
    async with inprocess(EngineOptions(model="tiny")) as (built, http):
        with pytest.raises(RequestError, match="Priority scheduling is not enabled"):
            built.engine.submit([1, 2], SamplingParams(priority=1), None)
        response = await http.post("/v1/completions", json=completion("tiny", "hi", priority=2))
        assert response.status_code == 400, response.text
    async with inprocess(EngineOptions(model="tiny", scheduling_policy="priority")) as (_built, http):
        response = await http.post("/v1/completions", json=completion("tiny", "hi", priority=2))
        assert response.status_code == 200, response.text
